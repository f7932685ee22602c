"""Render README.md from nbs/index.ipynb (quarto, which nbdev-readme needs, is not installable here).

Directive cells (`#| ...`) are left out, nbval markers are stripped, code is fenced as python, and
links relative to nbs/ (`../exempla/...`) are made relative to the repository root.
Run `python tools/readme.py` after editing nbs/index.ipynb; tests/test_project.py checks README.md is current."""
from pathlib import Path
import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parents[1]


def render() -> str:
    nb = nbformat.read(ROOT / 'nbs' / 'index.ipynb', as_version=4)
    nb.cells = [c for c in nb.cells if not (c.cell_type == 'code' and c.source.lstrip().startswith('#|'))]
    for c in nb.cells:
        if c.cell_type == 'markdown':   # an exported markdown cell starts with its `#| export` line
            lines = c.source.splitlines()
            while lines and lines[0].startswith('#|'): lines.pop(0)
            c.source = '\n'.join(lines)
        if c.cell_type == 'code':
            c.source = '\n'.join(l for l in c.source.splitlines() if not l.startswith('# NBVAL_'))
    nb.metadata['language_info'] = {'name': 'python'}
    body, _ = MarkdownExporter().from_notebook_node(nb)
    return body.replace('](../', '](')   # links written relative to nbs/ become relative to the repository root


if __name__ == '__main__':
    tmp = ROOT / 'README.md.tmp'
    tmp.write_text(render())
    tmp.replace(ROOT / 'README.md')
