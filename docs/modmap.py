"""The module map, read from the package itself: which module imports which (`from . import x`,
`from .x import y`), drawn in layers so that every arrow points down the page. A cycle fails the
build: the graph must be one-way."""
import ast, io
from pathlib import Path

SKIP = {'__init__', '__main__', '_modidx'}


def imports(pkg: Path):
    "{module: sorted sibling modules it imports} for every module file of the package."
    mods = sorted(p.stem for p in pkg.glob('*.py') if p.stem not in SKIP)
    deps = {}
    for m in mods:
        tree = ast.parse((pkg / f'{m}.py').read_text(encoding='utf-8'))
        ds = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module: ds.add(node.module.split('.')[0])
                else: ds.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == pkg.name:
                ds.update(a.name for a in node.names)
        deps[m] = sorted(d for d in ds if d in mods and d != m)
    return deps


def layers(deps):
    "{module: depth}, depth = 1 + the deepest dependency; raises ValueError naming a cycle."
    depth, visiting = {}, []
    def visit(m):
        if m in depth: return depth[m]
        if m in visiting:
            raise ValueError('module import cycle: '
                             + ' -> '.join(visiting[visiting.index(m):] + [m]))
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


def picture(deps, depth):
    "PNG bytes: one row per layer, arrows from each module to those it imports directly."
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rows = {}
    for m in sorted(deps, key=lambda m: (depth[m], m)): rows.setdefault(depth[m], []).append(m)
    width = max(len(r) for r in rows.values())
    edges = reduced(deps)
    users = {m: [u for u in deps if m in edges[u]] for m in deps}
    def place():
        return {m: ((i + 0.5) * width / len(r), -d)
                for d, r in rows.items() for i, m in enumerate(r)}
    for sweep in range(4):  # barycentre ordering: each module near the mean of its neighbours
        pos = place()
        order = sorted(rows) if sweep % 2 == 0 else sorted(rows, reverse=True)
        for d in order:
            near = edges if sweep % 2 == 0 else users
            def key(m):
                xs = [pos[n][0] for n in near[m]]
                return (sum(xs) / len(xs) if xs else pos[m][0], m)
            rows[d].sort(key=key)
            pos = place()
    pos = place()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * width), len(rows) + 0.6), dpi=100)
    for m, ds in edges.items():
        for d in ds:
            arrow = {'arrowstyle': '->', 'color': '0.55', 'lw': 1, 'shrinkA': 12, 'shrinkB': 12}
            ax.annotate('', xy=pos[m], xytext=pos[d], arrowprops=arrow)
    for m, (x, y) in pos.items():
        ax.text(x, y, m, ha='center', va='center', fontsize=10, family='monospace',
                bbox={'boxstyle': 'round,pad=0.35', 'fc': '#eef3fb', 'ec': '#3b6ea8'})
    ax.set_xlim(0, width); ax.set_ylim(-len(rows) + 0.4, 0.6); ax.axis('off')
    ax.set_title('gradus modules: an arrow runs from a module to one that imports it',
                 fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format='png', bbox_inches='tight', metadata={'Software': None})
    plt.close(fig)
    return buf.getvalue()


def _summary(pkg, m):
    doc = ast.get_docstring(ast.parse((pkg / f'{m}.py').read_text(encoding='utf-8'))) or ''
    first = doc.strip().split('\n\n')[0].replace('\n', ' ')
    return first.replace('|', '\\|')


def table(pkg, deps, depth, notebooks):
    "Markdown: module, its notebook page, what it imports, its one-line summary; in layer order."
    nb_of = {nb.module: nb.name for nb in notebooks if nb.module}
    rows = ['| module | notebook | imports | what it owns |', '|---|---|---|---|']
    for m in sorted(deps, key=lambda m: (depth[m], m)):
        page = f'{{doc}}`{nb_of[m]}`' if m in nb_of else ''
        uses = ', '.join(f'`{d}`' for d in deps[m]) or '(numpy and friends only)'
        rows.append(f'| `gradus.{m}` | {page} | {uses} | {_summary(pkg, m)} |')
    return '\n'.join(rows) + '\n'


def generate(pkg: Path, notebooks):
    "{file name: text or bytes} for docs' `_generated/` folder."
    deps = imports(pkg)
    depth = layers(deps)
    return {'modules.png': picture(deps, depth),
            'module_table.md': table(pkg, deps, depth, notebooks)}
