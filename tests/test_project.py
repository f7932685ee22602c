"""The project's own invariants: the package matches the notebooks, notebooks are clean, README is
current, the code passes ruff and the module graph is one-way."""
import ast, difflib, json, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = sorted(p for p in (ROOT / 'nbs').rglob('*.ipynb') if '.ipynb_checkpoints' not in p.parts)


def test_export_changes_nothing(tmp_path):
    "Running nbdev-export on a copy of the project reproduces gradus/ exactly."
    for name in ('nbs', 'gradus'):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'pyproject.toml', tmp_path / 'pyproject.toml')
    exe = Path(sys.executable).with_name('nbdev-export')
    subprocess.run([str(exe)], cwd=tmp_path, check=True, capture_output=True)
    def modules(root):
        return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob('*.py')
                if '__pycache__' not in p.parts}
    made, have = modules(tmp_path / 'gradus'), modules(ROOT / 'gradus')
    drift = sorted(n for n in made.keys() | have.keys() if made.get(n) != have.get(n))
    assert not drift, f"nbdev-export changes {drift}: edit the notebooks, export, commit both"


@pytest.mark.parametrize('nb', NBS, ids=[p.relative_to(ROOT / 'nbs').as_posix() for p in NBS])
def test_notebook_is_clean(nb):
    "nbdev-clean would change nothing: no execution counts, no stray metadata, no output ids."
    from nbdev.clean import _nbdev_clean
    from fastcore.nbio import read_nb, nb2dict
    stored = json.loads(nb.read_text())
    cleaned = read_nb(nb)
    _nbdev_clean(cleaned, path=nb)
    cleaned = nb2dict(cleaned)
    for c in cleaned['cells']: c.pop('idx_', None)
    dump = lambda d: json.dumps(d, sort_keys=True, indent=1).splitlines()
    diff = [l for l in difflib.unified_diff(dump(stored), dump(cleaned), lineterm='')][:12]
    assert not diff, f"{nb.name} is not clean; run nbdev-clean:\n" + '\n'.join(diff)


def test_readme_is_current():
    """README.md is nbs/index.ipynb rendered by tools/readme.py; regenerate it after editing the
    index notebook."""
    sys.path.insert(0, str(ROOT / 'tools'))
    try: from readme import render
    finally: sys.path.pop(0)
    assert (ROOT / 'README.md').read_text() == render(), \
        "README.md is stale: run `python tools/readme.py`"


def test_module_lines_within_100():
    """Every line of gradus/*.py is at most 100 characters, except what nbdev writes by itself: the
    `__all__` list (wrapped at 120 columns) and, in `__init__.py`, the package summary before
    `__version__` (one line per module description). ruff's E501 is therefore off for gradus/."""
    long = []
    for p in sorted((ROOT / 'gradus').rglob('*.py')):
        if p.name == '_modidx.py': continue
        in_all, summary = False, p.name == '__init__.py'
        for i, line in enumerate(p.read_text().splitlines(), 1):
            summary = summary and not line.startswith('__version__')
            in_all = summary or line.startswith('__all__ = [') or (
                in_all and line.startswith(' ' * 11))
            if len(line) > 100 and not in_all: long.append(f"{p.name}:{i}: {len(line)} characters")
    assert not long, "lines over 100 characters (edit the notebook, then nbdev-export):\n" + \
        '\n'.join(long)


def test_ruff_clean():
    "ruff (pyflakes, lines <= 100 characters; configured in pyproject.toml) passes everywhere."
    cmd = [sys.executable, '-m', 'ruff', 'check', '--no-cache', '--output-format', 'concise',
           'gradus', 'tests', 'exempla']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check gradus tests exempla:\n{r.stdout}{r.stderr}"


# The module graph stated in nbs/index.ipynb, by wing. A wing (a sub-package of gradus, a folder
# of nbs/) may import only the wings it is stated to build on, so the two libraries stay apart:
# `formats` (files and tokenizers, numpy only) never reaches the autodiff stack, and nothing of
# Part I reaches Part II. Inside a wing, a module may import only modules of strictly lower rank,
# so every edge points down and no cycle can form. The package's top (errors, __main__) is a
# wing of its own; `formats` needs only numpy, so any wing may read files (Part I's checkpoints are
# safetensors files). A new module gets its rank here, at its place in its wing's order.
WING_DEPS = {
    'errors': set(),
    'formats': {'errors'},
    'core': {'errors'},
    'learn': {'errors', 'core', 'formats'},
    'transformer': {'errors', 'core', 'learn'},
    'lm': {'errors', 'core', 'learn', 'transformer', 'formats'},
    'scale': {'errors', 'core', 'learn'},
    'jobs': {'errors', 'core', 'learn', 'transformer', 'formats', 'lm', 'scale'},
    'exercises': {'errors', 'core', 'learn', 'transformer', 'formats', 'lm', 'scale',
                  'jobs'},
    '__main__': {'jobs'},
}
RANKS = {
    'errors': 0, '__main__': 0,
    'core.dtype': 0, 'core.pytree': 0, 'core.shape': 1, 'core.tensor': 2, 'core.ops': 3,
    'core.graph': 4, 'core.codegen': 4.1, 'core.cache': 4.2, 'core.fuse': 4.5, 'core.autograd': 5,
    'core.kernels': 5.5,
    'learn.loss': 0, 'learn.random': 0, 'learn.nn': 1, 'learn.optim': 1, 'learn.train': 2,
    'transformer.causal_softmax': 0, 'transformer.attention': 1, 'transformer.gpt': 2,
    'formats.safetensors': 0, 'formats.quants': 1, 'formats.gguf': 2, 'formats.spm': 2,
    'formats.tokenizer': 3,
    'lm.sampling': 0, 'lm.qkernels': 0, 'lm.stream': 0.5, 'lm.decode': 1, 'lm.engine': 1.5,
    'lm.qlinear': 1.8, 'lm.models': 2, 'lm.lora': 3, 'lm.adapters': 3.5, 'lm.finetune': 3.7,
    'lm.chat': 4,
    'scale.lowering': 0,
    'jobs.shakespeare': 0, 'jobs.finetune': 0.5, 'jobs.cli': 1,
    'exercises.checking': 0, 'exercises.core': 1, 'exercises.learn': 1,
    'exercises.transformer': 1, 'exercises.jobs': 1, 'exercises.formats': 1, 'exercises.lm': 1,
    'exercises.scale': 1, 'exercises.graphs': 1, 'exercises.blocks': 1,
    'exercises.decoding': 1, 'exercises.models': 1, 'exercises.adapting': 1,
}
UNRANKED = {'__init__', '_modidx'}   # the package's front door (and nbdev's index) import anything


def wing_of(mod):
    "'core' for 'core.tensor'; a top-level module ('errors', 'cli') is its own wing."
    return mod.split('.')[0]


def _import_module_name(node):
    """For a call `importlib.import_module(name, ...)` / `import_module(name, ...)`: `name` when it
    is written out as a string, '' when it is computed; None for any other node."""
    f = getattr(node, 'func', None)
    if not isinstance(node, ast.Call) or getattr(f, 'attr', getattr(f, 'id', None)) != \
            'import_module':
        return None
    arg = node.args[0] if node.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ''


def _resolve(package, level, module):
    """The gradus module path ('core.tensor') that `from <level dots><module> import ...` names in
    a module of `package` ('core', or '' at the top)."""
    parts = package.split('.') if package else []
    parts = parts[:len(parts) - (level - 1)] if level > 1 else parts
    return '.'.join(parts + (module.split('.') if module else []))


def edges_of(tree, modules=(), package=''):
    """[(imported gradus module, line, at top level?, names)] of a parsed module in `package`.
    Modules are dotted paths below gradus ('core.tensor'); `modules` is the set of them, so that
    `from . import nn` in package 'learn' is an edge to 'learn.nn' and `from ..core import tensor`
    one to 'core.tensor'. An absolute import of gradus (`import gradus`, `from gradus.core.tensor
    import x`) is recorded as an import of 'gradus' itself, followed by the module it names. A
    deferred import, `importlib.import_module('gradus.scale.lowering')` with the name written out,
    is an edge this check sees: 'deferred' stands in the top-level flag; a computed name is
    recorded as '<computed>'. `names` are the names imported from the module (for the check that
    no underscore name crosses a wing)."""
    top, edges = {id(n) for n in tree.body}, []

    def target(path, names=()):
        "An edge to `path`, or to its member module when `from path import member`."
        out = []
        if path in modules: out.append(path)
        for n in names:
            sub = f"{path}.{n}" if path else n
            if sub in modules: out.append(sub)
        return out

    for node in ast.walk(tree):
        if (name := _import_module_name(node)) is not None:
            if name.startswith('.'):
                edges += [(m, node.lineno, 'deferred', ()) for m in
                          target(_resolve(package, len(name) - len(name.lstrip('.')),
                                          name.lstrip('.')))]
            elif name.split('.')[0] == 'gradus':
                edges += [('gradus', node.lineno, 'deferred', ())]
                edges += [(m, node.lineno, 'deferred', ()) for m in target(name[7:])]
            elif not name: edges.append(('<computed>', node.lineno, False, ()))
            continue
        flag = id(node) in top
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            path = _resolve(package, node.level, node.module)
            names = [a.name for a in node.names]
            for m in target(path, names):
                edges.append((m, node.lineno, flag, tuple(names) if m == path else ()))
        elif isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'gradus':
            edges.append(('gradus', node.lineno, flag, ()))
            path, names = node.module[7:], [a.name for a in node.names]
            edges += [(m, node.lineno, flag, tuple(names) if m == path else ())
                      for m in target(path, names)]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split('.')[0] == 'gradus':
                    edges.append(('gradus', node.lineno, flag, ()))
                    edges += [(m, node.lineno, flag, ()) for m in target(a.name[7:])]
    return edges


def package_imports():
    "{module path: edges_of(module)} for every module of gradus/, 'core.tensor' for core/tensor.py."
    pkg = ROOT / 'gradus'
    paths = sorted(p for p in pkg.rglob('*.py') if '__pycache__' not in p.parts)
    name = lambda p: '.'.join(p.relative_to(pkg).with_suffix('').parts)
    mods = {name(p) for p in paths}
    out = {}
    for p in paths:
        mod = name(p)
        if mod.endswith('__init__') and mod != '__init__': continue   # a wing's empty __init__
        package = '.'.join(p.relative_to(pkg).parent.parts)
        out[mod] = edges_of(ast.parse(p.read_text(), str(p)), mods, package)
    return out


def find_cycle(graph):
    "A list of modules forming an import cycle in {module: set of imports}, or None."
    state = {}
    def visit(m, path):
        state[m] = 'open'
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 'open': return path[path.index(d):] + [d]
            if d not in state and (c := visit(d, path + [d])): return c
        state[m] = 'done'
    for m in sorted(graph):
        if m not in state and (c := visit(m, [m])): return c


def _file(mod): return 'gradus/' + mod.replace('.', '/') + '.py'


def edge_problems(mod, dep, at_top, names=()):
    "What is wrong with `mod` importing `dep` (a gradus module or 'gradus'): a list of reasons."
    if dep == 'gradus': return ["imports the package `gradus` itself (import modules relatively)"]
    why = [] if at_top else [f"a function-local import of {dep} hides an edge"]
    if mod in UNRANKED: return why
    if dep not in RANKS: return why + [f"imports gradus.{dep}, which has no rank in RANKS"]
    w, dw = wing_of(mod), wing_of(dep)
    if w != dw:
        if dw not in WING_DEPS.get(w, set()):
            why.append(f"wing {w} imports {dep} of wing {dw}, which it does not build on")
        private = [n for n in names if n.startswith('_')]
        if private:
            why.append(f"imports {', '.join(private)} from {dep} across wings (only public "
                       "names cross a wing)")
    elif RANKS[dep] >= RANKS[mod]:
        why.append(f"{mod} (rank {RANKS[mod]}) imports {dep} (rank {RANKS[dep]}): "
                   "not pointing down")
    return why


def graph_problems(imports):
    "Every way `imports` ({module: edges_of(module)}) breaks the stated graph, one line each."
    unknown = sorted(set(imports) - set(RANKS) - UNRANKED)
    problems = [f"{_file(m)} has no rank: add it to RANKS in tests/test_project.py at its "
                "place in the graph nbs/index.ipynb states" for m in unknown]
    for mod, edges in imports.items():
        if mod in unknown: continue
        for dep, line, at_top, names in edges:
            problems += [f"{_file(mod)}:{line}: {w}"
                         for w in edge_problems(mod, dep, at_top, names)]
    graph = {m: {e[0] for e in edges if e[0] in imports} for m, edges in imports.items()}
    if (cycle := find_cycle(graph)): problems.append('import cycle: ' + ' -> '.join(cycle))
    return problems


def test_module_graph_is_one_way():
    """The import graph of gradus/ is the one nbs/index.ipynb states: each wing imports only the
    wings it builds on and only their public names; inside a wing every edge points to a lower
    rank; no module imports `gradus` itself, no function-local import hides an edge, and there is
    no cycle."""
    problems = graph_problems(package_imports())
    assert not problems, '\n'.join(problems)


def test_module_graph_check_can_fail():
    "The checks above see each kind of break, on small made-up sources and graphs."
    mods = {'learn.nn', 'learn.loss', 'core.tensor', 'core.autograd', 'transformer.gpt',
            'scale.lowering', 'core'}
    src = ("from . import nn, loss\nimport gradus\nfrom gradus.core.tensor import add\n"
           "def f():\n    from ..core.autograd import _grad\n"
           "    from gradus.transformer import gpt\n"
           "    importlib.import_module('gradus.scale.lowering'); import_module(name)\n"
           "    importlib.import_module('jax'); importlib.import_module('.nn', 'gradus.learn')\n")
    assert sorted(edges_of(ast.parse(src), mods, 'learn'), key=lambda e: e[1]) == [
        ('learn.nn', 1, True, ()), ('learn.loss', 1, True, ()), ('gradus', 2, True, ()),
        ('gradus', 3, True, ()), ('core.tensor', 3, True, ('add',)),
        ('core.autograd', 5, False, ('_grad',)), ('gradus', 6, False, ()),
        ('transformer.gpt', 6, False, ()), ('gradus', 7, 'deferred', ()),
        ('scale.lowering', 7, 'deferred', ()), ('<computed>', 7, False, ()),
        ('learn.nn', 8, 'deferred', ())]
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b'}, 'b': set(), 'c': {'a'}}) is None
    found = graph_problems({
        'core.tensor': [('core.autograd', 7, True, ())],
        'core.autograd': [('core.tensor', 2, True, ())],
        'formats.gguf': [('learn.nn', 3, True, ()), ('formats.quants', 4, False, ())],
        'formats.quants': [], 'learn.nn': [('gradus', 9, True, ()),
                                           ('core.tensor', 10, True, ('Primitive', '_aval'))],
        'core.mystery': [('core.tensor', 1, True, ())],
        'jobs.cli': [('__main__', 5, False, ()), ('scale.lowering', 6, 'deferred', ())],
        'scale.lowering': [('jobs.cli', 8, 'deferred', ())], '__main__': []})
    assert found == [
        "gradus/core/mystery.py has no rank: add it to RANKS in tests/test_project.py at its "
        "place in the graph nbs/index.ipynb states",
        "gradus/core/tensor.py:7: core.tensor (rank 2) imports core.autograd (rank 5): not "
        "pointing down",
        "gradus/formats/gguf.py:3: wing formats imports learn.nn of wing learn, which it does "
        "not build on",
        "gradus/formats/gguf.py:4: a function-local import of formats.quants hides an edge",
        "gradus/learn/nn.py:9: imports the package `gradus` itself (import modules relatively)",
        "gradus/learn/nn.py:10: imports _aval from core.tensor across wings (only public names "
        "cross a wing)",
        "gradus/jobs/cli.py:5: a function-local import of __main__ hides an edge",
        "gradus/jobs/cli.py:5: wing jobs imports __main__ of wing __main__, which it does not "
        "build on",
        "gradus/scale/lowering.py:8: wing scale imports jobs.cli of wing jobs, which it does not "
        "build on",
        "import cycle: core.autograd -> core.tensor -> core.autograd"], found


def module_aliases(tree, modules, package):
    "{local name: gradus module path} for `from . import tensor as T` and the like in a module."
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            path = _resolve(package, node.level, node.module)
            for a in node.names:
                sub = f"{path}.{a.name}" if path else a.name
                if sub in modules: out[a.asname or a.name] = sub
    return out


def shared_internals():
    """[(module, sibling, name, line)] for every underscore name one module takes from another
    module of gradus, by import (`from .graph import _run`) or by attribute (`T._promote`)."""
    pkg = ROOT / 'gradus'
    paths = sorted(p for p in pkg.rglob('*.py') if '__pycache__' not in p.parts)
    name = lambda p: '.'.join(p.relative_to(pkg).with_suffix('').parts)
    mods = {name(p) for p in paths}
    found = []
    for p in paths:
        mod, package = name(p), '.'.join(p.relative_to(pkg).parent.parts)
        if mod.split('.')[-1] in UNRANKED: continue
        tree = ast.parse(p.read_text(), str(p))
        for dep, line, _, names in edges_of(tree, mods, package):
            found += [(mod, dep, n, line) for n in names if n.startswith('_') and dep != mod]
        aliases = module_aliases(tree, mods, package)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith('_')
                    and not node.attr.startswith('__')):
                found.append((mod, aliases[node.value.id], node.attr, node.lineno))
    return found


def test_no_module_takes_another_modules_underscore_names():
    """A name one module uses from another is part of its wing's shared vocabulary: it has a public
    name (and, for a function or class, a docstring — checked below), never an underscore name
    reached into from outside. Across wings the graph test already refuses them."""
    found = sorted(set(shared_internals()))
    lines = [f"{_file(m)}:{line}: uses {dep}.{n}" for m, dep, n, line in found]
    assert not lines, ("underscore names used across modules (give each a documented public "
                       "name):\n" + '\n'.join(lines))


def test_shared_names_have_docstrings():
    "Every function or class that one module of gradus imports from a sibling has a docstring."
    pkg = ROOT / 'gradus'
    imports = package_imports()
    missing = []
    for mod, edges in imports.items():
        for dep, line, _, names in edges:
            if dep == 'gradus' or dep == mod or not names: continue
            tree = ast.parse((pkg / (dep.replace('.', '/') + '.py')).read_text())
            defs = {n.name: n for n in tree.body
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
            missing += [f"{_file(mod)}:{line}: {dep}.{n} has no docstring" for n in names
                        if n in defs and not ast.get_docstring(defs[n])]
    assert not missing, '\n'.join(sorted(set(missing)))
