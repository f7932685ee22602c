"""Every notebook named in prose exists and is the one meant.

The prose is every notebook's Markdown and its code's comments and strings, README.md, the site's
hand-written pages (docs/*.md) and the exempla's READMEs. A notebook is named there

- by path, `nbs/core/05_graph.ipynb` or `core/05_graph`: the file must exist at that path;
- by file name, `05_graph.ipynb` or `05_graph`: a notebook must have that stem;
- by number, "notebook 16", "notebooks 14 and 15", "lessons 00-04": a notebook must have that
  number;
- by module, "the decode notebook", "the `decode` notebook", {nb}`decode`: a notebook must export
  (or be named after) that module;

and where a name and a number are given together ("the decode notebook (23)", "notebook 23
(`decode`)", "the decode notebook's (16)") they must name the same notebook; where a name is said
to live in one ("the `Trace` class lives in the graph notebook", "`custom_vjp` of the autograd
notebook"), that notebook must define it. A bad reference is reported on one line: file, cell (or
line), the text, and what is wrong with it."""
import io, json, re, tokenize
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'

# "the next notebook" and the like: words that stand where a module name could, naming none
GENERIC = {
    'this', 'that', 'the', 'a', 'an', 'next', 'previous', 'last', 'first', 'same', 'whole', 'one',
    'other', 'each', 'every', 'lesson', 'lessons', 'companion', 'following', 'preceding', 'earlier',
    'later', 'own', 'its', 'their', 'which', 'whose', 'any', 'an', 'index', 'later', 'present',
    'current', 'main', 'previous', 'former', 'latter', 'second', 'third', 'final', 'source',
    'entire', 'original', 'new', 'old', 'single', 'given', 'your', 'my', 'our', 'his', 'her',
}


class Notebook(NamedTuple):
    path: str       # relative to the repository: 'nbs/core/05_graph.ipynb'
    stem: str       # '05_graph'
    number: str     # '05' ('' when unnumbered); with its companion letter, '05a'
    names: tuple    # what prose may call it: ('graph',), the module's last part and the stem's
    defines: frozenset  # the names its code cells define at the top level (def, class, x = ...)


def notebooks(root=ROOT):
    "Every notebook of nbs/ and of its wings' folders, with what it may be called."
    out = []
    nbs = root / 'nbs'
    for p in sorted([*nbs.glob('*.ipynb'), *nbs.glob('*/*.ipynb')]):
        if p.stem.startswith('.') or '.ipynb_checkpoints' in p.parts: continue
        m = re.match(r'^(\d+[a-z]?)_(\w+)$', p.stem)
        number, tail = (m.group(1), m.group(2)) if m else ('', p.stem)
        names, defines = {tail}, set()
        try: cells = json.loads(p.read_text(encoding='utf-8'))['cells']
        except (OSError, ValueError): cells = []
        for c in cells:
            if c['cell_type'] != 'code': continue
            src = ''.join(c['source'])
            d = re.search(r'^\s*#\|\s*default_exp\s+(\S+)', src, re.M)
            if d: names.add(d.group(1).split('.')[-1].strip('_'))
            defines.update(a or b for a, b in _DEFINED.findall(src))
        out.append(Notebook(p.relative_to(root).as_posix(), p.stem, number, tuple(sorted(names)),
                            frozenset(defines)))
    return out


class Bad(NamedTuple):
    where: str   # 'nbs/core/05_graph.ipynb: cell 17' or 'README.md: line 80'
    text: str    # the reference as written
    why: str

    def __str__(self): return f"{self.where}: {self.text!r}: {self.why}"

# ------------------------------------------------------------------------------ the references

_NUM = r'\d{1,2}[a-z]?'
_PATH = re.compile(r'\bnbs/(?:[\w-]+/)*[\w.-]+\.ipynb\b')
_WING_STEM = re.compile(r'(?<![\w/.-])(?!nbs/)([a-z]+)/(\d{2}[a-z]?_[a-z][a-z0-9_]*?)'
                        r'(\.ipynb)?(?![\w-])')  # core/05_graph: a notebook of a wing
_STEM = re.compile(r'(?<![\w/.-])(\d{2}[a-z]?_[a-z][a-z0-9_]*?)(\.ipynb)?(?![\w-])')
# prose wraps: a space in these patterns is any run of white space, a line break included
_NUMBERED = re.compile(r'\b(?:notebooks?|lessons?)\s+(' + _NUM
                       + r'(?:(?:,\s+|\s+and\s+|\s+or\s+|[–-])' + _NUM + r')*)\b(?![.,]\d)', re.I)
_NAMED = re.compile(r"\bthe\s+([`*]?)([A-Za-z_]\w*)\1\s+(?:and\s+([`*]?)([A-Za-z_]\w*)\3\s+)?"
                    r"(notebook|notebooks|companion|lesson)\b(?:'s)?(?:\s*\((" + _NUM + r")\))?")
_NB_ROLE = re.compile(r'\{nb\}`(?:[^`<]*<)?(\w+)>?`(?:\s*\((' + _NUM + r')\))?')
_NUMBER_NAME = re.compile(rf'\bnotebook\s+({_NUM})\s+\(([`*]?)(\w+)\2\)')
_LIVES = re.compile(r'`(\w+)(?:\(\))?`(?:\s+class|\s+function)?\s+(?:lives\s+in|live\s+in|'
                    r'is\s+defined\s+in|are\s+defined\s+in|of|from)\s+the\s+([`*]?)(\w+)\2\s+'
                    r'notebook\b')
_DEFINED = re.compile(r'^(?:async )?(?:def|class)\s+(\w+)|^(\w+)\s*(?::[^=\n]*)?=(?!=)', re.M)


def _numbers(text):
    "'14, 15 and 16' -> ['14', '15', '16']; a range '00–16' -> its two ends."
    return re.findall(_NUM, text)


def _norm(n):
    "'5' and '05' are one number; '5a' and '05a' one companion."
    m = re.match(r'(\d+)([a-z]?)$', n)
    return f'{int(m.group(1)):02d}{m.group(2)}'


def check_text(text, where, nbs):
    """The bad references in one piece of prose `text` (a cell's Markdown, a comment, a file's
    line); `where` says where it is."""
    by_path = {nb.path for nb in nbs}
    by_stem = {nb.stem: nb for nb in nbs}
    by_number = {}
    for nb in nbs:
        if nb.number: by_number.setdefault(_norm(nb.number), []).append(nb)
    by_name = {}
    for nb in nbs:
        for n in nb.names: by_name.setdefault(n.lower(), []).append(nb)
    bad = []

    def named(name):
        return by_name.get(name.lower().strip('_'), [])

    def agree(name, number, ref):
        "A name and a number given together name one notebook."
        hits = [nb for nb in named(name) if nb.number and _norm(nb.number) == _norm(number)]
        if hits: return
        meant = ', '.join(f'{nb.stem}' for nb in named(name)) or 'no notebook'
        bad.append(Bad(where, ref, f"{name} is {meant}, not notebook {number}"))

    for m in _PATH.finditer(text):
        path = m.group(0)
        if path not in by_path:
            stem = Path(path).stem
            hint = f' (it is {by_stem[stem].path})' if stem in by_stem else ''
            bad.append(Bad(where, path, f'no such notebook{hint}'))
    for m in _WING_STEM.finditer(text):
        path = f'nbs/{m.group(1)}/{m.group(2)}.ipynb'
        if path not in by_path:
            stem = m.group(2)
            hint = f' (it is {by_stem[stem].path})' if stem in by_stem else ''
            bad.append(Bad(where, m.group(0), f'no notebook {path}{hint}'))
    for m in _STEM.finditer(text):
        stem = m.group(1)
        if stem in by_stem: continue
        num = stem.split('_')[0]
        tail = stem[len(num) + 1:]
        near = [nb.stem for nb in nbs if tail in nb.names or nb.stem.endswith('_' + tail)]
        hint = f' (perhaps {", ".join(near)})' if near else ''
        bad.append(Bad(where, m.group(0), f'no notebook named {stem}{hint}'))
    for m in _NUMBERED.finditer(text):
        for n in _numbers(m.group(1)):
            if _norm(n) not in by_number:
                bad.append(Bad(where, m.group(0), f'no notebook numbered {n}'))
    for m in _NUMBER_NAME.finditer(text):
        agree(m.group(3), m.group(1), m.group(0))
    for m in _NAMED.finditer(text):
        names = [n for n in (m.group(2), m.group(4)) if n]
        kind, number = m.group(5), m.group(6)
        if kind in ('companion', 'lesson') and not any(named(n) for n in names): continue
        for n in names:
            if n.lower() in GENERIC: continue
            if not named(n):
                bad.append(Bad(where, m.group(0), f'no notebook for module {n!r}'))
            elif number: agree(n, number, m.group(0))
    for m in _LIVES.finditer(text):
        name, module = m.group(1), m.group(3)
        homes = named(module)
        if homes and not any(name in nb.defines for nb in homes):
            where_def = [nb.stem for nb in nbs if name in nb.defines]
            hint = f' (it is defined in {", ".join(where_def)})' if where_def else ''
            bad.append(Bad(where, m.group(0),
                           f'{", ".join(nb.stem for nb in homes)} does not define {name}{hint}'))
    for m in _NB_ROLE.finditer(text):
        name, number = m.group(1), m.group(2)
        if not named(name): bad.append(Bad(where, m.group(0), f'no notebook for module {name!r}'))
        elif number: agree(name, number, m.group(0))
    return bad

# ---------------------------------------------------------------------------------- the prose


def code_prose(source):
    "The comments and string literals of a code cell (IPython lines left out), one piece each."
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(('%', '!'))]
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO('\n'.join(lines) + '\n').readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING): out.append(tok.string)
            elif getattr(tokenize, 'FSTRING_MIDDLE', None) == tok.type: out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        out = [ln for ln in lines if ln.lstrip().startswith('#')]
    return out


def prose(root=ROOT):
    "[(where, text)]: every piece of prose that may name a notebook."
    out = []
    for nb in notebooks(root):
        cells = json.loads((root / nb.path).read_text(encoding='utf-8'))['cells']
        for i, c in enumerate(cells):
            src = ''.join(c['source'])
            if c['cell_type'] == 'markdown': out.append((f'{nb.path}: cell {i}', src))
            elif c['cell_type'] == 'code':
                out += [(f'{nb.path}: cell {i}', piece) for piece in code_prose(src)]
    files = [root / 'README.md', *sorted((root / 'docs').glob('*.md')),
             *sorted((root / 'exempla').glob('**/README.md'))]
    for f in files:
        if not f.is_file(): continue
        for i, line in enumerate(f.read_text(encoding='utf-8').splitlines(), 1):
            out.append((f'{f.relative_to(root).as_posix()}: line {i}', line))
    return out


def bad_references(root=ROOT):
    nbs = notebooks(root)
    return [b for where, text in prose(root) for b in check_text(text, where, nbs)]

# --------------------------------------------------------------------------------------- tests


def test_every_notebook_named_in_prose_exists_and_is_the_one_meant():
    assert len(notebooks()) > 30
    bad = bad_references()
    assert not bad, f'{len(bad)} references to notebooks are wrong:\n' + '\n'.join(map(str, bad))


def _tree(tmp_path):
    "A small repository: two wings, a lesson with a companion, a README."
    def nb(rel, module, code=''):
        p = tmp_path / 'nbs' / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        cells = [{'cell_type': 'markdown', 'metadata': {}, 'source': f'# {module}'},
                 {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
                  'source': f'#| default_exp {module}\n{code}'}]
        p.write_text(json.dumps({'cells': cells, 'metadata': {}, 'nbformat': 4,
                                 'nbformat_minor': 5}))
    nb('core/05_graph.ipynb', 'core.graph', 'class Trace:\n    pass\nLIMIT: int = 3')
    nb('core/05a_codegen.ipynb', 'core.codegen')
    nb('lm/23_decode.ipynb', 'lm.decode')
    nb('lm/23a_stream.ipynb', 'lm.stream')
    nb('errors.ipynb', 'errors')
    return notebooks(tmp_path)


RIGHT = [
    'See `nbs/core/05_graph.ipynb`, `05a_codegen.ipynb` and 23_decode, `lm/23a_stream`.',
    'lessons 05-05a, the lesson 23',
    'Notebook 23 decodes; notebooks 05 and 05a trace; notebook 5 too.',
    'the decode notebook (23), the `graph` notebook, the decode notebook\'s (23)',
    'notebook 23 (`decode`), {nb}`decode`, {nb}`the cache <decode>` (23)',
    'the next notebook, the same notebook, the stream companion, the errors notebook',
    'a (16) that names no notebook; 2024_04 and 10_000 are not notebook names',
    'the `Trace` class lives in the graph notebook; `LIMIT` of the graph\nnotebook',
    '`FormatError` used to live in the decode notebook',
]
WRONG = {
    'Trace lives in `nbs/05_graph.ipynb`.': "no such notebook (it is nbs/core/05_graph.ipynb)",
    'Read `nbs/lm/05_graph.ipynb`.': 'no such notebook (it is nbs/core/05_graph.ipynb)',
    'the codegen cells of 05_codegen': 'no notebook named 05_codegen (perhaps 05a_codegen)',
    'as notebook 16 shows': 'no notebook numbered 16',
    'the lessons 05-07': 'no notebook numbered 07',
    '(`lm/05_graph`)': 'no notebook nbs/lm/05_graph.ipynb (it is nbs/core/05_graph.ipynb)',
    'notebooks 05 and 17': 'no notebook numbered 17',
    "as the decode notebook's (16) says": 'decode is 23_decode, not notebook 16',
    'the graph notebook (23)': 'graph is 05_graph, not notebook 23',
    'notebook 05 (`decode`)': 'decode is 23_decode, not notebook 05',
    'Trace lives in the autograd notebook': "no notebook for module 'autograd'",
    'the `sampling` notebook': "no notebook for module 'sampling'",
    '{nb}`autograd`': "no notebook for module 'autograd'",
    '{nb}`graph` (23)': 'graph is 05_graph, not notebook 23',
    'the `Trace` class lives in the\ndecode notebook':
        '23_decode does not define Trace (it is defined in 05_graph)',
    'the decode\nnotebook\'s (16)': 'decode is 23_decode, not notebook 16',
    '(`LIMIT` of the stream notebook)':
        '23a_stream does not define LIMIT (it is defined in 05_graph)',
}


def test_the_check_passes_right_references(tmp_path):
    nbs = _tree(tmp_path)
    found = [str(b) for text in RIGHT for b in check_text(text, 'x', nbs)]
    assert found == []


def test_the_check_catches_wrong_references(tmp_path):
    "It can fail: each made-up wrong reference is found, on one line saying what is wrong."
    nbs = _tree(tmp_path)
    for text, why in WRONG.items():
        found = check_text(text, 'README.md: line 3', nbs)
        assert [b.why for b in found] == [why], (text, [str(b) for b in found])
        assert str(found[0]).startswith('README.md: line 3: ') and '\n' not in str(found[0])


def test_the_check_reads_cells_comments_and_pages(tmp_path):
    "A wrong name in a notebook's comment, a docstring, a Markdown cell or a page is found."
    _tree(tmp_path)
    p = tmp_path / 'nbs' / 'lm' / '23a_stream.ipynb'
    nb = json.loads(p.read_text())
    nb['cells'] += [
        {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
         'source': 'x = 1  # as in notebook 42\ndef f():\n    "See 05_graf."\n%time f()'},
        {'cell_type': 'markdown', 'metadata': {}, 'source': 'the tensor notebook'}]
    p.write_text(json.dumps(nb))
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'page.md').write_text('fine\n{nb}`gguf`\n')
    found = sorted(map(str, bad_references(tmp_path)))
    assert found == [
        "docs/page.md: line 2: '{nb}`gguf`': no notebook for module 'gguf'",
        "nbs/lm/23a_stream.ipynb: cell 2: '05_graf': no notebook named 05_graf",
        "nbs/lm/23a_stream.ipynb: cell 2: 'notebook 42': no notebook numbered 42",
        "nbs/lm/23a_stream.ipynb: cell 3: 'the tensor notebook': no notebook for module "
        "'tensor'"], found


def test_the_front_page_lists_every_notebook_with_its_module():
    """README's reading order names every notebook at its path (a companion marked ↳), with the
    module it exports to."""
    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    rows = dict(re.findall(r'^\| (?:↳ )?`(nbs/[^`]+\.ipynb)`[^|]*\| `(gradus[\w.]*)` \|', readme,
                           re.M))
    for nb in notebooks():
        if nb.stem == 'index': continue
        assert nb.path in rows, f'README.md: no row for {nb.path}'
        src = json.loads((ROOT / nb.path).read_text(encoding='utf-8'))['cells']
        mods = [m for c in src if c['cell_type'] == 'code'
                for m in re.findall(r'^\s*#\|\s*(?:default_exp|exporti?)\s+([\w.]+)',
                                    ''.join(c['source']), re.M)]
        if mods: assert rows[nb.path] == f'gradus.{mods[0]}', (nb.path, rows[nb.path], mods[0])
        companion = re.match(r'\d+[a-z]_', nb.stem) is not None
        assert (f'| ↳ `{nb.path}`' in readme) == companion, f'{nb.path}: companion mark'
    assert set(rows) <= {nb.path for nb in notebooks()}, sorted(set(rows) - {
        nb.path for nb in notebooks()})
