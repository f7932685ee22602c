"""The project's own invariants: the package matches the notebooks, notebooks are clean, README is current."""
import difflib, json, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = sorted((ROOT / 'nbs').glob('*.ipynb'))


def test_export_changes_nothing(tmp_path):
    "Running nbdev-export on a copy of the project reproduces gradus/ exactly."
    for name in ('nbs', 'gradus'): shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns('__pycache__'))
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
    "README.md is nbs/index.ipynb rendered by tools/readme.py; regenerate it after editing the index notebook."
    sys.path.insert(0, str(ROOT / 'tools'))
    try: from readme import render
    finally: sys.path.pop(0)
    assert (ROOT / 'README.md').read_text() == render(), "README.md is stale: run `python tools/readme.py`"
