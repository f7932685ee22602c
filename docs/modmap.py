"""The module map, read from the package itself: which module imports which, by wing. A wing is a
sub-package of gradus (`gradus/core/`, the folder `nbs/core/`); the package's own modules
(`errors`, `__main__`) stand as wings of one module each. The picture draws the wings in layers,
left to right, each box listing its modules in reading order, an arrow from a wing to each wing
that imports it directly; the tables list every module with its notebook, by wing. An import cycle,
between wings or between modules, fails the build: the graph must be one-way."""
import ast, io, re
from pathlib import Path

SKIP = {'__init__', '_modidx'}


def module_names(pkg: Path):
    "Dotted names below the package of its module files: ['core.dtype', ..., 'errors']."
    paths = sorted(p for p in pkg.rglob('*.py') if '__pycache__' not in p.parts)
    return sorted('.'.join(p.relative_to(pkg).with_suffix('').parts) for p in paths
                  if p.stem not in SKIP)


def wing_of(mod):
    "'core' for 'core.tensor'; a module of the package itself ('errors') is its own wing."
    return mod.split('.')[0]


def _resolve(package, level, module):
    "The dotted path `from <level dots><module>` names in a module of `package` ('core' or '')."
    parts = package.split('.') if package else []
    if level > 1: parts = parts[:len(parts) - (level - 1)]
    return '.'.join(parts + (module.split('.') if module else []))


def _edges(tree, mods, package, pkgname):
    "The gradus modules one parsed module imports: relative, absolute, or deferred by name."
    def target(path, names=()):
        out = {path} & mods
        out |= {f'{path}.{n}' if path else n for n in names} & mods
        return out
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level > 0: found |= target(_resolve(package, node.level, node.module), names)
            elif (node.module or '').split('.')[0] == pkgname:
                found |= target(node.module[len(pkgname) + 1:], names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(pkgname + '.'): found |= target(a.name[len(pkgname) + 1:])
        elif isinstance(node, ast.Call) and getattr(node.func, 'attr', getattr(
                node.func, 'id', None)) == 'import_module' and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value   # importlib.import_module('..scale.lowering', __package__)
            if name.startswith('.'):
                level = len(name) - len(name.lstrip('.'))
                found |= target(_resolve(package, level, name.lstrip('.')))
            elif name.startswith(pkgname + '.'): found |= target(name[len(pkgname) + 1:])
    return found


def imports(pkg: Path):
    "{module: sorted gradus modules it imports} for every module file of the package."
    mods = module_names(pkg)
    deps = {}
    for m in mods:
        path = pkg / (m.replace('.', '/') + '.py')
        tree = ast.parse(path.read_text(encoding='utf-8'))
        package = m.rpartition('.')[0]
        deps[m] = sorted(d for d in _edges(tree, set(mods), package, pkg.name) if d != m)
    return deps


def wing_imports(deps):
    "{wing: sorted wings its modules import}, a wing's imports of itself left out."
    out = {}
    for m, ds in deps.items():
        out.setdefault(wing_of(m), set()).update(wing_of(d) for d in ds)
    return {w: sorted(ds - {w}) for w, ds in out.items()}


def layers(deps):
    "{node: depth}, depth = 1 + the deepest dependency; raises ValueError naming a cycle."
    depth, visiting = {}, []
    def visit(m):
        if m in depth: return depth[m]
        if m in visiting:
            raise ValueError('import cycle: ' + ' -> '.join(visiting[visiting.index(m):] + [m]))
        visiting.append(m)
        depth[m] = 1 + max((visit(d) for d in deps[m]), default=-1)
        visiting.pop()
        return depth[m]
    for m in deps: visit(m)
    return depth


def reduced(deps):
    "The edges left by the transitive reduction (an import implied by a longer path is not drawn)."
    def reach(m, seen):
        for d in deps[m]:
            if d not in seen: seen.add(d); reach(d, seen)
        return seen
    out = {}
    for m, ds in deps.items():
        indirect = set().union(*[reach(d, set()) for d in ds]) if ds else set()
        out[m] = [d for d in ds if d not in indirect]
    return out


def _number(name):
    "The reading-order number of a notebook name ('05a_graph_codegen' -> '05a'), or ''."
    m = re.match(r'^(\d+[a-z]?)_', name or '')
    return m.group(1) if m else ''


def reading_order(mods, nb_of):
    "Modules sorted by their notebooks' numbers (unnumbered ones last, by name)."
    def key(m):
        n = _number(nb_of.get(m))
        return (0, int(re.match(r'\d+', n).group()), n, m) if n else (1, 0, '', m)
    return sorted(mods, key=key)


def picture(deps, nb_of):
    "PNG bytes: the wings left to right in layers, each box listing its modules, arrows between."
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    wdeps = wing_imports(deps)
    depth = layers(wdeps)
    members = {w: reading_order([m for m in deps if wing_of(m) == w], nb_of) for w in wdeps}
    edges = [(d, w) for w, ds in reduced(wdeps).items() for d in ds]
    long = sorted((e for e in edges if depth[e[1]] - depth[e[0]] > 1),
                  key=lambda e: (depth[e[0]], depth[e[1]]))
    ends = {w for e in long for w in e}  # wings at the ends of a long edge go to the bottom
    cols = {}
    for w in sorted(wdeps, key=lambda w: (depth[w], w in ends, w)):
        cols.setdefault(depth[w], []).append(w)
    line, pad, gap = 0.34, 0.22, 0.45
    chars = max([len(f'gradus.{w}') + 1 for w in wdeps]
                + [len(m.split('.', 1)[-1]) + 7 for m in deps])  # '05a  name', indented
    boxw = max(2.15, 0.2 + 0.112 * chars)  # about 0.11 of an axis unit a character at 9.5-10 pt
    colw = boxw + 0.75
    solo = {w for w in wdeps if members[w] == [w]}  # errors, __main__: a module, not a folder
    height = {w: (1 + (w not in solo) * len(members[w])) * line + 2 * pad for w in wdeps}
    total = max(sum(height[w] for w in ws) + gap * (len(ws) - 1) for ws in cols.values())
    box = {}  # wing -> (x left, y bottom, y top)
    for d, ws in cols.items():
        y = total - (total - sum(height[w] for w in ws) - gap * (len(ws) - 1)) / 2
        for w in ws:
            box[w] = (d * colw, y - height[w], y)
            y -= height[w] + gap
    # an edge between neighbouring columns is straight; one that skips a column runs below the
    # boxes (down from its wing, along, up into the importing wing), so that it crosses none
    floor = min(b for _, b, _ in box.values()) - 0.3 * (len(long) + 1) if long else 0.0
    fig, ax = plt.subplots(figsize=(colw * len(cols) * 0.95, (total - floor) * 0.95 + 0.8),
                           dpi=100)
    arrow = {'arrowstyle': '->', 'color': '0.5', 'lw': 1.1, 'shrinkA': 2, 'shrinkB': 2}
    for d, w in edges:
        (x0, b0, t0), (x1, b1, t1) = box[d], box[w]
        if (d, w) in long:
            k = long.index((d, w))
            y = min(b for _, b, _ in box.values()) - 0.3 * (k + 1)
            sx, tx = x0 + boxw * (0.6 + 0.08 * k), x1 + boxw * (0.3 - 0.08 * k)
            ax.plot([sx, sx, tx], [b0, y, y], color='0.5', lw=1.1)
            ax.annotate('', xy=(tx, b1), xytext=(tx, y), arrowprops={**arrow, 'shrinkA': 0})
        else:
            ax.annotate('', xy=(x1, (b1 + t1) / 2), xytext=(x0 + boxw, (b0 + t0) / 2),
                        arrowprops=arrow)
    for w, (x, b, t) in box.items():
        ax.add_patch(FancyBboxPatch((x, b), boxw, t - b, boxstyle='round,pad=0,rounding_size=0.12',
                                    fc='#f6f6f6' if w in solo else '#eef3fb', ec='#3b6ea8', lw=1.2))
        y = t - pad - line / 2
        ax.text(x + 0.12, y, f'gradus.{w}', ha='left', va='center', fontsize=10,
                family='monospace', weight='bold')
        if w in solo: continue
        for m in members[w]:
            y -= line
            ax.text(x + 0.25, y, f'{_number(nb_of.get(m)):>3}  {m.split(".", 1)[1]}', ha='left',
                    va='center', fontsize=9.5, family='monospace')
    ax.set_xlim(-0.1, colw * (len(cols) - 1) + boxw + 0.1)
    ax.set_ylim(floor - 0.1, total + 0.1)
    ax.axis('off')
    ax.set_title('gradus by wing: an arrow runs from a wing to a wing that imports it '
                 '(modules by notebook number)', fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format='png', bbox_inches='tight', metadata={'Software': None})
    plt.close(fig)
    return buf.getvalue()


def _summary(pkg, m):
    path = pkg / (m.replace('.', '/') + '.py')
    doc = ast.get_docstring(ast.parse(path.read_text(encoding='utf-8'))) or ''
    first = doc.strip().split('\n\n')[0].replace('\n', ' ')
    return first.replace('|', '\\|')


def table(pkg, deps, nb_of):
    """Markdown: a section per wing in the picture's order, saying which wings it builds on, with a
    table of its modules in reading order: module, notebook page, what it imports (modules of its
    own wing by name, others with their wing), its summary."""
    wdeps = wing_imports(deps)
    depth = layers(wdeps)
    out = []
    for w in sorted(wdeps, key=lambda w: (depth[w], w)):
        on = ', '.join(f'`gradus.{d}`' for d in wdeps[w]) or 'nothing of gradus (numpy and friends)'
        out += [f'## `gradus.{w}`', '', f'Builds on: {on}.', '',
                '| module | notebook | imports | what it owns |', '|---|---|---|---|']
        for m in reading_order([m for m in deps if wing_of(m) == w], nb_of):
            page = f'{{doc}}`{nb_of[m]}`' if m in nb_of else ''
            uses = ', '.join(f'`{d.split(".", 1)[1] if wing_of(d) == w and "." in d else d}`'
                             for d in deps[m]) or '(numpy and friends only)'
            out.append(f'| `gradus.{m}` | {page} | {uses} | {_summary(pkg, m)} |')
        out.append('')
    return '\n'.join(out)


def generate(pkg: Path, notebooks):
    """{file name: text or bytes} for docs' `_generated/` folder. `notebooks` have `.module`
    ('core.tensor', as `#| default_exp` writes it) and `.name` (the page)."""
    deps = imports(pkg)
    layers(deps)  # a cycle between modules fails here, one between wings in the picture
    nb_of = {nb.module: nb.name for nb in notebooks if nb.module}
    return {'modules.png': picture(deps, nb_of), 'module_table.md': table(pkg, deps, nb_of)}
