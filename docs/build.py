"""Build gradus's documentation site from the notebooks' stored outputs (nothing is executed).

    python docs/build.py            # -> docs/_build/html/index.html
    python docs/build.py --out DIR  # -> DIR/html/index.html

Steps: every notebook (`nbs/*.ipynb` and the wings' `nbs/<wing>/*.ipynb`) is preprocessed into
`<out>/src/` (nbdev's cell directives honoured, nbval markers stripped, API entries written after
each export cell, backticked API names and notebook paths linked), the hand-written pages of
`docs/` are copied beside them with a generated module map, and Sphinx + myst-nb renders the lot
with warnings as errors. The sidebar has a section per wing in reading order (`SECTIONS`), each
lesson followed by its lettered companions (`05a_...`). A page is named by its notebook's stem
(`05_graph`), which is unique across wings (the build fails otherwise). Preprocessed files are
rewritten only when their content changes, so a rebuild is incremental.
"""
import argparse, ast, hashlib, json, re, sys, types
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
NBS = ROOT / 'nbs'
PAGES = ['quickstart', 'first-notebook', 'module-map', 'backward']  # hand-written, sidebar order
PKG = 'gradus'

# The sidebar's sections in reading order: (caption, wing, which of its notebooks). The wing is a
# folder of nbs/ ('' for nbs/ itself); `numbers` keeps the notebooks whose number is in it (None:
# every notebook of the wing, numbered or not), `stems` names unnumbered ones. Every notebook but
# the index falls in exactly one section: a new wing or an unplaced notebook fails the build until
# it is given its place.
SECTIONS = [
    ('Part I, training: the autodiff core', 'core', None, ()),
    ('Part I, training: learning', 'learn', None, ()),
    ('Part I, training: the transformer', 'transformer', None, ()),
    ('Part I, training: the main job', 'jobs', range(0, 17), ()),
    ('Part II, running a real model: formats and tokenizers', 'formats', None, ()),
    ('Part II, running a real model: language models', 'lm', range(0, 31), ()),
    ('Part III, adapting a real model', 'lm', range(31, 100), ()),
    ('Part III, adapting a real model: the command', 'jobs', range(31, 100), ()),
    ('Beyond one machine', 'scale', None, ()),
    ('The command line', 'jobs', range(17, 31), ()),
    ('The command line', '', range(0, 100), ()),
    ('Errors', '', (), ('errors',)),
    ('Exercises', 'exercises', None, ()),
]
_STEM = re.compile(r'^(\d+)([a-z]?)_\w+$')  # 05_graph (a lesson), 05a_graph_codegen (its companion)

# ------------------------------------------------------------------------------------ directives
_DIRECTIVE = re.compile(r'^\s*#\|\s*(.*?)\s*$')
_NBVAL = re.compile(r'^\s*#\s*NBVAL_\w+\s*$')
_HIDE_LINE = re.compile(r'#\|\s*hide_line\s*$')
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def parse_directives(source):
    """`(directives, body_lines)` of a code cell: nbdev reads `#| key[: value]` / `#| key arg`
    comment lines at the top of a cell. Keys are lower-cased, values stripped
    (`{'export': '', 'echo': 'false', 'default_exp': 'nn'}`)."""
    lines, dirs, i = source.splitlines(), {}, 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if not m:
            if lines[i].strip() == '' and not dirs: i += 1; continue
            break
        text = m.group(1)
        colon = re.match(r'^[\w-]+\s*:', text)
        key, _, val = text.partition(':') if colon else text.partition(' ')
        dirs[key.strip().lower()] = val.strip()
        i += 1
    return dirs, lines[i:]


def _false(v): return v.strip().lower() in ('false', 'no', '0')


def shown_source(body_lines):
    "The code a reader sees: `#| hide_line` lines and nbval marker lines removed."
    keep = [ln for ln in body_lines if not _HIDE_LINE.search(ln) and not _NBVAL.match(ln)]
    return '\n'.join(keep).strip('\n')


EXPORT_KEYS = ('export', 'exports')  # exporti is internal: its source shows, it adds no API entries

# --------------------------------------------------------------------------------- the API index


def _bound(target):
    "Names an assignment target binds (`a`, `a, b`); `obj.attr = ...` and `d[k] = ...` bind none."
    if isinstance(target, ast.Name): return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)): return [n for e in target.elts for n in _bound(e)]
    if isinstance(target, ast.Starred): return _bound(target.value)
    return []


def public_names(tree):
    """nbdev's rule for a module's `__all__`, read from one export cell: the top-level functions,
    classes and assigned names that do not start with `_`, plus those listed in `_all_ = [...]`.
    In source order, with the defining statement."""
    out = []
    for node in tree.body:
        if isinstance(node, _DEFS + (ast.ClassDef,)): out.append((node.name, node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n for t in targets for n in _bound(t)]
            if names == ['_all_'] and isinstance(node.value, (ast.List, ast.Tuple)):
                out.extend((e.value if isinstance(e, ast.Constant) else e.id, 'all')
                           for e in node.value.elts if isinstance(e, (ast.Constant, ast.Name)))
            else: out.extend((n, node) for n in names)
    listed = {n for n, node in out if node == 'all'}
    defs = {n: node for n, node in out if node != 'all'}
    public = [(n, node) for n, node in out
              if node != 'all' and (not n.startswith('_') or n in listed)]
    return public + [(n, None) for n in listed if n not in defs]


def _modname(mod): return PKG if mod == '__init__' else f'{PKG}.{mod}'
def _in_pkg(module): return bool(module) and module.startswith(PKG + '.')


class Notebook:
    """One notebook split into cells (with their directives), its module and its import aliases;
    its wing (the folder of nbs/ it is in, '' for nbs/ itself), number and companion letter
    (`05a_graph_codegen`: 5, 'a'; an unnumbered notebook: None, '')."""
    def __init__(self, path, wing=''):
        self.path, self.name, self.wing = path, path.stem, wing
        m = _STEM.match(self.name)
        self.number, self.letter = (int(m.group(1)), m.group(2)) if m else (None, '')
        try: self.nb = json.loads(path.read_text(encoding='utf-8'))
        except json.JSONDecodeError as e: raise SystemExit(f'{path}: not a notebook ({e})') from e
        self.module, self.cells, self.aliases = None, [], {}
        for cell in self.nb['cells']:
            src = ''.join(cell.get('source', ''))
            code = cell['cell_type'] == 'code'
            # a Markdown cell's directives (`#| export`: part of the package docstring) are nbdev's
            # business, not the reader's: they are read and left out of the page
            dirs, body = parse_directives(src) if cell['cell_type'] in ('code', 'markdown') \
                else ({}, src.splitlines())
            if code and 'default_exp' in dirs: self.module = dirs['default_exp'].split()[0]
            self.cells.append((cell, dirs, body))
        for cell, dirs, body in self.cells:
            if cell['cell_type'] != 'code': continue
            tree = self._parse(body)
            if tree is None: continue
            for node in ast.walk(tree):  # `from gradus.core import tensor as T`: `T.sum` is linked
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == PKG:
                    for a in node.names: self.aliases[a.asname or a.name] = f'{PKG}.{a.name}'
                elif isinstance(node, ast.ImportFrom) and _in_pkg(node.module):
                    for a in node.names:
                        self.aliases[a.asname or a.name] = f'{node.module}.{a.name}'
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split('.')[0] == PKG: self.aliases[a.asname or a.name] = a.name

    @staticmethod
    def _parse(body):
        try: return ast.parse('\n'.join(body))
        except SyntaxError: return None  # IPython syntax (`%time`, `!ls`): not an export cell

    def export_module(self, dirs):
        "The module an export cell writes to (`#| export other` overrides `#| default_exp`)."
        for k in EXPORT_KEYS:
            if k in dirs:
                mod = dirs[k].split()[0] if dirs[k].split() else self.module
                if mod is None:
                    raise SystemExit(f'{self.path}: #| {k} cell before any #| default_exp')
                return mod
        return None

    def cell_entries(self, dirs, body):
        """[(fullname, name, statement)] for the public names an export cell defines. Read from
        the source alone: nothing is imported (a module may need packages the docs lack)."""
        mod = self.export_module(dirs)
        if mod is None: return []
        modname = _modname(mod)
        tree = self._parse(body)
        if tree is None: raise SystemExit(f'{self.path}: an export cell is not valid Python')
        seen, out = set(), []
        for name, node in public_names(tree):
            if name in seen: continue
            seen.add(name)
            out.append((f'{modname}.{name}', name, node))
        return out

    def reexports(self):
        "{name: fullname} for names the export cells import from the package (`gradus/__init__`)."
        out = {}
        for cell, dirs, body in self.cells:
            if cell['cell_type'] != 'code' or self.export_module(dirs) is None: continue
            tree = self._parse(body)
            for node in (tree.body if tree else []):
                if isinstance(node, ast.ImportFrom) and _in_pkg(node.module):
                    for a in node.names: out[a.asname or a.name] = f'{node.module}.{a.name}'
        return out


def build_index(notebooks):
    "fullname -> docname of every API entry (the first definition wins); short name -> [fullnames]."
    full, short = {}, {}
    for nb in notebooks:
        if nb.module: full.setdefault(_modname(nb.module), nb.name)  # `gradus.x`: its notebook
        for cell, dirs, body in nb.cells:
            if cell['cell_type'] != 'code': continue
            for fullname, name, node in nb.cell_entries(dirs, body):
                if fullname in full: continue
                full[fullname] = nb.name
                short.setdefault(name, []).append(fullname)
                if isinstance(node, ast.ClassDef):
                    for mname, _ in _methods(node): full[f'{fullname}.{mname}'] = nb.name
    return full, short


# --------------------------------------------------------------------------------------- linking
_FENCE = re.compile(r'^\s*(```+|~~~+)')
_TICKED = re.compile(r'(?<![`}\w])`([A-Za-z_][\w.]*)(\(\))?`(?!`)')
_NB_PATH = re.compile(r'(?<![`}\w\[])`nbs/((?:[\w-]+/)?)([\w.-]+)\.ipynb`(?!`)')
_NB_STEM = re.compile(r'(?<![`}\w\[])`(\d+[a-z]?_\w+)((?:\.ipynb)?)`(?!`)')  # `05a_codegen`


class Linker:
    """Backticked API names in Markdown become cross-references (as nbdev's add_links does), and
    backticked notebook paths (`nbs/core/05_graph.ipynb`) and names (`05_graph`, `05_graph.ipynb`)
    links to their pages. `pages` maps a
    page name to the notebook's wing ({'05_graph': 'core'}): a path links only if it is right.
    `modules` are the package's modules (`gradus.core.tensor`): a dotted name is looked for in
    them and in the packages above them (`tensor.sum`, `core.tensor.sum`, `lm.decode`)."""
    def __init__(self, full, short, pages, reexports, modules=()):
        self.full, self.short, self.pages = full, short, pages
        self.reexports = {k: v for k, v in reexports.items() if v in full}
        self.scopes = {PKG} | {'.'.join(m.split('.')[:i]) for m in modules
                               for i in range(1, m.count('.') + 2)}

    def resolve(self, text, nb):
        "The full name a backticked `text` stands for in notebook `nb`, or None."
        if text in self.full: return text
        head, _, rest = text.partition('.')
        if rest and head in nb.aliases:  # T.sum, gd.grad, nn.linear
            base = nb.aliases[head]
            cand = f'{base}.{rest}'
            if cand in self.full: return cand
            if base == PKG:  # gd.grad, gd.tensor.sum: names the package re-exports
                first, _, more = rest.partition('.')
                if first in self.reexports:
                    cand = self.reexports[first] + (f'.{more}' if more else '')
                    if cand in self.full: return cand
        if rest:  # Class.method, or module.name / wing.module / wing.module.name
            for fn in self.short.get(head, []):
                if f'{fn}.{rest}' in self.full: return f'{fn}.{rest}'
            found = [f for f in self.full
                     if f.endswith(f'.{text}') and f[:-len(text) - 1] in self.scopes]
            return found[0] if len(found) == 1 else None
        cands = self.short.get(text, [])
        mine = [c for c in cands if nb.module and c.startswith(f'{PKG}.{nb.module}.')]
        if len(mine) == 1: return mine[0]
        return cands[0] if len(cands) == 1 else None

    def link(self, md, nb):
        out, fence = [], None
        for line in md.split('\n'):
            m = _FENCE.match(line)
            if fence:
                if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence): fence = None
                out.append(line); continue
            if m: fence = m.group(1); out.append(line); continue
            out.append(self._link_line(line, nb))
        return '\n'.join(out)

    def _link_line(self, line, nb):
        # maths and double-backtick code are left alone
        parts = re.split(r'(\$\$.*?\$\$|\$[^$]+\$|``[^`]+``)', line)
        for i in range(0, len(parts), 2):
            parts[i] = _NB_PATH.sub(lambda m: self._nb_link(m), parts[i])
            parts[i] = _NB_STEM.sub(lambda m: self._stem_link(m), parts[i])
            parts[i] = _TICKED.sub(lambda m: self._api_link(m, nb, parts[i]), parts[i])
        return ''.join(parts)

    def _nb_link(self, m):
        folder, stem = m.group(1).rstrip('/'), m.group(2)
        if self.pages.get(stem) != folder: return m.group(0)  # not a notebook there: left as is
        return f'{{doc}}`{m.group(0)[1:-1]} <{stem}>`'

    def _stem_link(self, m):
        if m.group(1) not in self.pages: return m.group(0)
        return f'{{doc}}`{m.group(0)[1:-1]} <{m.group(1)}>`'

    def _api_link(self, m, nb, text):
        before, after = text[:m.start()], text[m.end():]
        if before.endswith('[') and after.startswith(']'): return m.group(0)  # a link's text
        target = self.resolve(m.group(1), nb)
        if target is None: return m.group(0)
        title = m.group(1) + (m.group(2) or '')
        return f'{{py:obj}}`{title} <{target}>`'


# ----------------------------------------------------------------------------------- API entries


def _signature(node, drop_self=False):
    "The signature as written in the source (defaults read as code), or None if it states none."
    if isinstance(node, _DEFS):
        args = node.args
        if drop_self and args.args and args.args[0].arg in ('self', 'cls'):
            rest = args.args[1:]
            defaults = args.defaults[-len(rest):] if rest and args.defaults else []
            args = ast.arguments(posonlyargs=args.posonlyargs, args=rest, vararg=args.vararg,
                                 kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                                 kwarg=args.kwarg, defaults=defaults)
        sig = f'({ast.unparse(args)})'
        if node.returns is not None: sig += f' -> {ast.unparse(node.returns)}'
        return sig
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == '__init__':
                return _signature(item, True)
        fields = [item for item in node.body
                  if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
        if fields:  # NamedTuple / dataclass: the fields are the constructor's arguments
            parts = [f'{f.target.id}: {ast.unparse(f.annotation)}'
                     + ('' if f.value is None else f' = {ast.unparse(f.value)}') for f in fields]
            return '(' + ', '.join(parts) + ')'
    return None


def _methods(node):
    "Public methods of a class body that carry their own docstring: [(name, FunctionDef)]."
    return [(item.name, item) for item in node.body
            if isinstance(item, _DEFS) and not item.name.startswith('_')
            and ast.get_docstring(item)]


def _fence(body):
    "A backtick fence longer than any fence inside `body`."
    return '`' * (max([len(f) for f in re.findall(r'`{3,}', body)] + [2]) + 1)


def _directive(kind, sig, body, options):
    opts = ''.join(f':{k}: {v}\n' for k, v in options.items())
    tick = _fence(body)
    return f'{tick}{{py:{kind}}} {sig}\n{opts}\n{body}\n{tick}\n'


def entry_markdown(entries, nb, linker, emitted):
    """The Markdown cell listing the API entries of one export cell: signature and Markdown
    docstring for functions and classes (with their documented methods), the defining statement
    for other names."""
    blocks = []
    for fullname, name, node in entries:
        opts = {'module': fullname.rsplit('.', 1)[0]}
        if fullname in emitted: opts['no-index'] = ''  # redefined later: one index entry
        emitted.add(fullname)
        documented = isinstance(node, _DEFS + (ast.ClassDef,))
        doc = linker.link((ast.get_docstring(node) or '') if documented else '', nb)
        if isinstance(node, ast.ClassDef):
            body = doc
            for mname, mnode in _methods(node):
                body += '\n\n' + _directive('method', f'{mname}{_signature(mnode, True) or "()"}',
                                             linker.link(ast.get_docstring(mnode), nb), {})
            blocks.append(_directive('class', f'{name}{_signature(node) or ""}', body, opts))
        elif isinstance(node, _DEFS):
            blocks.append(_directive('function', f'{name}{_signature(node)}', doc, opts))
        else:
            stmt = ast.unparse(node) if node is not None else name
            if len(stmt) > 100: stmt = stmt[:97] + '...'
            text = f'Defined as `{stmt}`' if '`' not in stmt else ''
            blocks.append(_directive('data', name, text, opts))
    return '\n'.join(blocks)


# ------------------------------------------------------------------------------ the preprocessor


def close_heading_gaps(md, level):
    """Headings that skip a level (`#` then `###`, which nbdev's renderer allows) raised to one
    below the previous heading, so that the page outline has no holes. `level` is a one-item list
    carried across the cells of a notebook."""
    out, fence = [], None
    for line in md.split('\n'):
        m = _FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence): fence = None
        elif m: fence = m.group(1)
        else:
            h = re.match(r'^(#{1,6})(\s.*)$', line)
            if h:
                n = min(len(h.group(1)), level[0] + 1)
                level[0] = n
                line = '#' * n + h.group(2)
        out.append(line)
    return '\n'.join(out)


def process(nb, linker):
    "The notebook as the site shows it (a new nbformat dict), API entries after export cells."
    cells, emitted, level = [], set(), [0]
    for cell, dirs, body in nb.cells:
        if cell['cell_type'] == 'markdown':
            if 'hide' in dirs: continue
            md = close_heading_gaps('\n'.join(body), level)
            cells.append({'cell_type': 'markdown', 'metadata': {}, 'source': linker.link(md, nb)})
            continue
        if cell['cell_type'] != 'code' or 'default_exp' in dirs: continue
        entries = nb.cell_entries(dirs, body)  # a hidden export cell still documents its names
        if entries and 'hide' in dirs:
            cells.append({'cell_type': 'markdown', 'metadata': {},
                          'source': entry_markdown(entries, nb, linker, emitted)})
        if 'hide' in dirs: continue
        source = shown_source(body)
        outputs = [] if _false(dirs.get('output', 'true')) else cell.get('outputs', [])
        tags = ['remove-input'] if _false(dirs.get('echo', 'true')) or not source else []
        if source or outputs:
            cells.append({'cell_type': 'code', 'metadata': {'tags': tags} if tags else {},
                          'source': source, 'outputs': outputs, 'execution_count': None})
        if entries:
            cells.append({'cell_type': 'markdown', 'metadata': {},
                          'source': entry_markdown(entries, nb, linker, emitted)})
    if nb.module:  # the module's index entry and link target, right after the title cell
        at = 1 if cells and cells[0]['cell_type'] == 'markdown' else 0
        target = f'```{{py:module}} {_modname(nb.module)}\n:no-contents-entry:\n```'
        cells.insert(at, {'cell_type': 'markdown', 'metadata': {}, 'source': target})
    kernel = {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}
    meta = {'kernelspec': nb.nb.get('metadata', {}).get('kernelspec', kernel),
            'language_info': {'name': 'python'}}
    return {'nbformat': 4, 'nbformat_minor': 5, 'metadata': meta, 'cells': cells}


def find_notebooks(nbs=None):
    """Every notebook of `nbs` (default nbs/): its own (`index`, `errors`, `30_main`) and those of
    its wings, one folder down (`core/05_graph.ipynb`), as Notebooks. Page names are the stems, so
    two notebooks with one stem (in two wings) are refused."""
    nbs = Path(nbs or NBS)
    paths = [(p, '') for p in sorted(nbs.glob('*.ipynb'))]
    paths += [(p, p.parent.name) for p in sorted(nbs.glob('*/*.ipynb'))
              if not p.parent.name.startswith(('.', '_'))]
    notebooks, seen = [], {}
    for p, wing in paths:
        if p.stem in seen:
            raise SystemExit(f'{p} and {seen[p.stem]}: two notebooks named {p.stem!r} '
                             '(a page is named by its notebook)')
        seen[p.stem] = p
        notebooks.append(Notebook(p, wing))
    return notebooks


def title(nb):
    "The notebook's first `# ` heading as plain text (code marks and emphasis dropped)."
    for cell, _, body in nb.cells:
        if cell['cell_type'] != 'markdown': continue
        for line in body:
            if line.startswith('# '): return re.sub(r'[`*]', '', line[2:]).strip()
    return nb.name


def sections(notebooks):
    """[(caption, [Notebook])]: the sidebar's sections (`SECTIONS`, equal captions in a row merged)
    with their notebooks in reading order, each lesson followed by its lettered companions. Raises
    SystemExit naming a notebook that no section, or more than one, takes."""
    out, where = [], {}
    for caption, wing, numbers, stems in SECTIONS:
        took = [nb for nb in notebooks if nb.name != 'index' and nb.wing == wing and (
            numbers is None or nb.name in stems
            or (nb.number is not None and nb.number in numbers))]
        for nb in took: where.setdefault(nb.name, []).append(caption)
        if out and out[-1][0] == caption: out[-1][1].extend(took)
        else: out.append((caption, took))
    placed = {name for name, caps in where.items() if len(caps) == 1}
    bad = [nb.path for nb in notebooks if nb.name != 'index' and nb.name not in placed]
    if bad:
        raise SystemExit(f'{", ".join(map(str, bad))}: not in exactly one section of the sidebar '
                         '(docs/build.py, SECTIONS)')
    order = lambda nb: (nb.number if nb.number is not None else 10**6, nb.letter, nb.name)
    return [(caption, sorted(nbs, key=order)) for caption, nbs in out if nbs]


def lesson_of(nb, notebooks):
    "The lesson a companion (`05a_...`) follows (`05_...` of the same wing), or None."
    if not nb.letter: return None
    return next((o for o in notebooks if o.number == nb.number and not o.letter
                 and o.wing == nb.wing), None)


def companion_title(nb):
    "A companion's sidebar entry: its title, marked (`↳ companion: ...`) unless it says so itself."
    t = title(nb)
    return f'↳ {t}' if 'companion' in t.lower() else f'↳ companion: {t}'


def toctree_cell(notebooks):
    """The contents appended to the entry page: the hand-written pages, then a section per wing in
    reading order, a companion's entry marked as one."""
    pages = '\n'.join(PAGES + ['API index <genindex>'])
    out = ['## Contents\n\n', f'```{{toctree}}\n:caption: Guides\n:maxdepth: 1\n\n{pages}\n```\n']
    for caption, nbs in sections(notebooks):
        entries = '\n'.join(f'{companion_title(nb)} <{nb.name}>' if nb.letter else nb.name
                             for nb in nbs)
        out.append(f'\n```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n\n{entries}\n```\n')
    return ''.join(out)


def companion_notes(nb, notebooks):
    """Markdown cells that tie a lesson and its companions together: on a lesson, a closing note
    naming its companions; on a companion, an opening note naming its lesson. (where, text)."""
    if nb.letter:
        lesson = lesson_of(nb, notebooks)
        if lesson is None: return []
        return [('top', f'*A companion of {{doc}}`{lesson.name}`: the engineering behind that '
                        'lesson, with its own proofs. A learner may skip it.*')]
    comps = [o for o in notebooks if o.letter and lesson_of(o, notebooks) is nb]
    if not comps: return []
    names = ', '.join(f'{{doc}}`{o.name}`' for o in comps)
    many = len(comps) > 1
    return [('end', f'**Companion{"s" if many else ""}**: {names} {"hold" if many else "holds"} '
                    'the engineering behind this lesson (speed, hardening, plumbing) with its own '
                    'proofs; the next lesson does not need it.')]


def write_if_changed(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding='utf-8') != text:
        path.write_text(text, encoding='utf-8')


_REPO_LINK = re.compile(r'\]\(((?:\.\./)+[^)\s]+)\)')

def _repo_files(md, src, wanted, base=NBS):
    """Markdown links to repository files, written relative to the notebook's folder `base`
    (`](../exempla/x.png)` in nbs/, `](../../exempla/x.png)` in nbs/core/): the file is copied
    into `src/_repo/` and the link pointed there, so the page finds it."""
    def copy(m):
        f = (base / m.group(1)).resolve()
        if ROOT.resolve() not in f.parents or not f.is_file():
            raise SystemExit(f'{base}: a notebook links {m.group(1)}, which is not a file of the '
                             'repository')
        rel = f.relative_to(ROOT.resolve()).as_posix()
        dest = src / '_repo' / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists() or dest.read_bytes() != f.read_bytes():
            dest.write_bytes(f.read_bytes())
        wanted.add(f'_repo/{rel}')
        return f'](_repo/{rel})'
    return _REPO_LINK.sub(copy, md)


def prepare(src):
    "Write the Sphinx source folder `src`; returns the notebooks' names."
    notebooks = find_notebooks()
    if not any(nb.name == 'index' and not nb.wing for nb in notebooks):
        raise SystemExit('nbs/index.ipynb is missing')
    full, short = build_index(notebooks)
    reexports = {}
    for nb in notebooks:
        if nb.module == '__init__': reexports.update(nb.reexports())
    modules = {_modname(nb.module) for nb in notebooks if nb.module}
    linker = Linker(full, short, {nb.name: nb.wing for nb in notebooks}, reexports, modules)
    toc = toctree_cell(notebooks)  # fails before anything is written if a notebook has no place
    wanted = set()
    for nb in notebooks:
        out = process(nb, linker)
        for where, text in companion_notes(nb, notebooks):
            note = {'cell_type': 'markdown', 'metadata': {}, 'source': text}
            if where == 'end': out['cells'].append(note)
            else: out['cells'].insert(1 if out['cells'] else 0, note)
        if nb.name == 'index':
            out['cells'].append({'cell_type': 'markdown', 'metadata': {}, 'source': toc})
        for i, c in enumerate(out['cells']):
            c['id'] = f'c{i}'
            if c['cell_type'] == 'markdown':
                c['source'] = _repo_files(c['source'], src, wanted, nb.path.parent)
        text = json.dumps(out, indent=1, ensure_ascii=False) + '\n'
        write_if_changed(src / f'{nb.name}.ipynb', text)
        wanted.add(f'{nb.name}.ipynb')
    page_context = types.SimpleNamespace(module=None, aliases={"gd": PKG})
    for page in PAGES:  # hand-written pages get their backticked API names linked too
        text = linker.link((DOCS / f'{page}.md').read_text(encoding='utf-8'), page_context)
        write_if_changed(src / f'{page}.md', text)
        wanted.add(f'{page}.md')
    for sub in ('examples',):
        for f in sorted((DOCS / sub).glob('*')):
            write_if_changed(src / sub / f.name, f.read_text(encoding='utf-8'))
            wanted.add(f'{sub}/{f.name}')
    if str(DOCS) not in sys.path: sys.path.insert(0, str(DOCS))
    import modmap  # docs/modmap.py: the module table and dependency picture, read from the package
    for name, data in modmap.generate(ROOT / PKG, notebooks).items():
        p = src / '_generated' / name
        if isinstance(data, bytes):
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.exists() or p.read_bytes() != data: p.write_bytes(data)
        else: write_if_changed(p, data)
        wanted.add(f'_generated/{name}')
    for f in src.rglob('*'):  # a renamed or deleted notebook leaves no stale page
        if f.is_file() and f.relative_to(src).as_posix() not in wanted: f.unlink()
    return [nb.name for nb in notebooks]


def _code_stamp():
    return hashlib.sha256(b''.join((DOCS / f).read_bytes()
                                   for f in ('build.py', 'conf.py', 'modmap.py'))).hexdigest()


def build(out=DOCS / '_build', warnings_as_errors=True, quiet=False):
    "Prepare the sources under `out/src` and run Sphinx into `out/html`; returns the html folder."
    from sphinx.cmd.build import build_main
    out = Path(out).resolve()
    prepare(out / 'src')
    args = ['-b', 'html', '-c', str(DOCS), '-d', str(out / 'doctrees'),
            str(out / 'src'), str(out / 'html')]
    if warnings_as_errors: args[:0] = ['-W', '--keep-going']
    if quiet: args[:0] = ['-q']
    # Reread everything after a failure (so that its warnings come back) or when this script or the
    # configuration changed (Sphinx tracks the sources and config values, not the code around them).
    ok, stamp = out / '.last-build-ok', _code_stamp()
    if not ok.exists() or ok.read_text() != stamp: args[:0] = ['-E']
    ok.unlink(missing_ok=True)
    rc = build_main(args)
    if rc: raise SystemExit(f'sphinx-build failed (exit {rc})')
    ok.write_text(stamp)
    return out / 'html'


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', type=Path, default=DOCS / '_build',
                    help='output folder (default docs/_build)')
    ap.add_argument('--no-strict', action='store_true', help='report warnings without failing')
    ap.add_argument('-v', '--verbose', action='store_true',
                    help="show Sphinx's progress, not only its warnings")
    a = ap.parse_args()
    html = build(a.out, warnings_as_errors=not a.no_strict, quiet=not a.verbose)
    print(f'site: {html / "index.html"}')
