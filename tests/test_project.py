"""The project's own invariants: the package matches the notebooks, notebooks are clean, README is
current, the code passes ruff and the module graph is one-way."""
import ast, difflib, json, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = sorted((ROOT / 'nbs').glob('*.ipynb'))


def test_export_changes_nothing(tmp_path):
    "Running nbdev-export on a copy of the project reproduces gradus/ exactly."
    for name in ('nbs', 'gradus'):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'pyproject.toml', tmp_path / 'pyproject.toml')
    exe = Path(sys.executable).with_name('nbdev-export')
    subprocess.run([str(exe)], cwd=tmp_path, check=True, capture_output=True)
    made = {p.name: p.read_text() for p in (tmp_path / 'gradus').glob('*.py')}
    have = {p.name: p.read_text() for p in (ROOT / 'gradus').glob('*.py')}
    drift = sorted(n for n in made.keys() | have.keys() if made.get(n) != have.get(n))
    assert not drift, f"nbdev-export changes {drift}: edit the notebooks, export, commit both"


@pytest.mark.parametrize('nb', NBS, ids=[p.name for p in NBS])
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
    for p in sorted((ROOT / 'gradus').glob('*.py')):
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


# The module graph stated in nbs/index.ipynb, as a rank per module: a module may import only
# modules of strictly lower rank, so every edge points down and no cycle can form. Part I is the
# chain dtype -> shape -> tensor -> autograd -> loss/random -> nn/optim -> train; attention on nn,
# gpt on attention. The numpy-only group (safetensors < quants < gguf < spm < tokenizer) ranks below
# dtype: it may import its own lower members and nothing of the autograd stack. decode and models
# join the two arcs. A new module gets its rank here, at its place in that order.
RANKS = {'safetensors': -5, 'quants': -4, 'gguf': -3, 'qkernels': -3, 'spm': -2, 'tokenizer': -1,
         'dtype': 0, 'pytree': 0, 'shape': 1, 'tensor': 2, 'ops': 3, 'graph': 4, 'fuse': 4.5,
         'autograd': 5, 'kernels': 5.5, 'loss': 6, 'random': 6, 'nn': 7, 'optim': 7, 'sampling': 7,
         'train': 8, 'attention': 8,
         'gpt': 9, 'decode': 10, 'models': 11, 'shakespeare': 11, 'lowering': 11, 'engine': 12,
         'chat': 13, 'cli': 14, '__main__': 15}
NUMPY_ONLY = {'safetensors', 'quants', 'gguf', 'spm', 'tokenizer', 'qkernels'}
UNRANKED = {'__init__', '_modidx'}   # the package's front door (and nbdev's index) import anything


def _import_module_name(node):
    """For a call `importlib.import_module(name, ...)` / `import_module(name, ...)`: `name` when it
    is written out as a string, '' when it is computed; None for any other node."""
    f = getattr(node, 'func', None)
    if not isinstance(node, ast.Call) or getattr(f, 'attr', getattr(f, 'id', None)) != \
            'import_module':
        return None
    arg = node.args[0] if node.args else None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ''


def edges_of(tree, modules=()):
    """[(imported gradus module, line, at top level?)] of a parsed module. An absolute import
    (`import gradus`, `from gradus import x`, `from gradus.gguf import x`) is recorded as an
    import of 'gradus' itself, followed by the submodule it names, if any (for `from gradus
    import x`: when `x` is one of `modules`). A deferred import, `importlib.import_module('.x',
    ...)` with the name written out, is an edge to `x` that this check sees: recorded with
    'deferred' in place of the top-level flag (and ranked like any edge); a computed name is
    recorded as '<computed>', not at top level (it hides an edge)."""
    top, edges = {id(n) for n in tree.body}, []
    for node in ast.walk(tree):
        if (name := _import_module_name(node)) is not None:
            if name.startswith('.'): edges.append((name[1:].split('.')[0], node.lineno, 'deferred'))
            elif name.split('.')[0] == 'gradus': edges.append(('gradus', node.lineno, 'deferred'))
            elif not name: edges.append(('<computed>', node.lineno, False))
            continue
        if isinstance(node, ast.ImportFrom) and node.level > 0:  # from . import a; from .a import x
            names = [node.module.split('.')[0]] if node.module else [a.name for a in node.names]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            full = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            names = [n for f in full if f.split('.')[0] == 'gradus' for n in f.split('.')[:2]]
            if isinstance(node, ast.ImportFrom) and node.module == 'gradus':
                names += [a.name for a in node.names if a.name in modules]
        else: continue
        edges += [(n, node.lineno, id(node) in top) for n in names]
    return edges


def package_imports():
    "{module: edges_of(module)} for every gradus/*.py."
    paths = sorted((ROOT / 'gradus').glob('*.py'))
    return {p.stem: edges_of(ast.parse(p.read_text(), str(p)), {q.stem for q in paths})
            for p in paths}


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


def edge_problems(mod, dep, at_top):
    "What is wrong with `mod` importing `dep` (a gradus module or 'gradus'): a list of reasons."
    if dep == 'gradus': return ["imports the package `gradus` itself (import modules relatively)"]
    why = [] if at_top else [f"a function-local import of {dep} hides an edge"]
    if mod in UNRANKED: return why
    if dep not in RANKS: return why + [f"imports gradus.{dep}, which has no rank in RANKS"]
    if mod in NUMPY_ONLY and dep not in NUMPY_ONLY:
        return why + [f"numpy-only {mod} imports {dep} of the autograd stack"]
    if RANKS[dep] >= RANKS[mod]:
        why.append(f"{mod} (rank {RANKS[mod]}) imports {dep} (rank {RANKS[dep]}): "
                   "not pointing down")
    return why


def graph_problems(imports):
    "Every way `imports` ({module: edges_of(module)}) breaks the stated graph, one line each."
    unknown = sorted(set(imports) - set(RANKS) - UNRANKED)
    problems = [f"gradus/{m}.py has no rank: add it to RANKS in tests/test_project.py at its "
                "place in the graph nbs/index.ipynb states" for m in unknown]
    for mod, edges in imports.items():
        if mod in unknown: continue
        for dep, line, at_top in edges:
            problems += [f"gradus/{mod}.py:{line}: {w}" for w in edge_problems(mod, dep, at_top)]
    graph = {m: {d for d, _, _ in edges if d in imports} for m, edges in imports.items()}
    if (cycle := find_cycle(graph)): problems.append('import cycle: ' + ' -> '.join(cycle))
    return problems


def test_module_graph_is_one_way():
    """The import graph of gradus/*.py is the one nbs/index.ipynb states: every edge points to a
    lower rank, the numpy-only group never reaches the autograd stack, no module imports `gradus`
    itself, no function-local import hides an edge, and there is no cycle."""
    problems = graph_problems(package_imports())
    assert not problems, '\n'.join(problems)


def test_module_graph_check_can_fail():
    "The checks above see each kind of break, on small made-up sources and graphs."
    src = ("from . import nn, shape\nimport gradus\nfrom gradus.tensor import add\n"
           "def f():\n    from .autograd import grad\n    from gradus import gpt, jit\n"
           "    importlib.import_module('.lowering', 'gradus'); import_module(name)\n"
           "    importlib.import_module('jax'); importlib.import_module('gradus.nn')\n")
    assert sorted(edges_of(ast.parse(src), {'gpt'}), key=lambda e: e[1]) == [
        ('nn', 1, True), ('shape', 1, True), ('gradus', 2, True), ('gradus', 3, True),
        ('tensor', 3, True), ('autograd', 5, False), ('gradus', 6, False), ('gpt', 6, False),
        ('lowering', 7, 'deferred'), ('<computed>', 7, False), ('gradus', 8, 'deferred')]
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b'}, 'b': set(), 'c': {'a'}}) is None
    found = graph_problems({'tensor': [('autograd', 7, True)], 'autograd': [('tensor', 2, True)],
                            'gguf': [('nn', 3, True), ('quants', 4, False)], 'quants': [],
                            'nn': [('gradus', 9, True)], 'mystery': [('tensor', 1, True)],
                            'cli': [('__main__', 5, False), ('lowering', 6, 'deferred'),
                                    ('engine', 7, 'deferred')],
                            'lowering': [('cli', 8, 'deferred')], 'engine': []})
    assert found == [
        "gradus/mystery.py has no rank: add it to RANKS in tests/test_project.py at its place in "
        "the graph nbs/index.ipynb states",
        "gradus/tensor.py:7: tensor (rank 2) imports autograd (rank 5): not pointing down",
        "gradus/gguf.py:3: numpy-only gguf imports nn of the autograd stack",
        "gradus/gguf.py:4: a function-local import of quants hides an edge",
        "gradus/nn.py:9: imports the package `gradus` itself (import modules relatively)",
        "gradus/cli.py:5: a function-local import of __main__ hides an edge",
        "gradus/cli.py:5: cli (rank 14) imports __main__ (rank 15): not pointing down",
        "gradus/lowering.py:8: lowering (rank 11) imports cli (rank 14): not pointing down",
        "import cycle: autograd -> tensor -> autograd"], found
