"""Write README.md from nbs/index.ipynb (quarto, which nbdev-readme needs, is not installable here)."""
from pathlib import Path
from nbconvert import MarkdownExporter

root = Path(__file__).resolve().parents[1]
body, _ = MarkdownExporter().from_filename(str(root / 'nbs' / 'index.ipynb'))
tmp = root / 'README.md.tmp'
tmp.write_text(body)
tmp.replace(root / 'README.md')
