"""Checked outputs print nothing that varies by machine (issue 24).

A notebook cell marked `# NBVAL_CHECK_OUTPUT` has its stored output compared with a fresh run
(nbs/conftest.py), so it must print the same text on every CPU, BLAS build, thread count and
load. This static guard reads every such cell's stored output under nbs/ and refuses:

- **an error size at rounding level**: a printed number with `0 < |x| < TOLERANCE` (1e-4) and
  at most 3 significant digits as printed (`4e-16`, `3.2e-11`, `7.4e-05`). float32's eps (1.2e-7)
  grows through sums and condition numbers to 1e-5..1e-4, float64's stays far below, so a figure
  of that size is a measurement of rounding, and its digits change with the order of additions
  (SIMD width, FMA, BLAS kernel, threads). Not refused: a *bound* (the number follows `<`,
  `<=`, `≤`, `below`, `within`, `under`, `than`, `to`, `tolerance`, `eps`, `atol`, `rtol`: a
  stable claim such as `within 1e-12: True`); a value printed with 4 or more digits (a
  computed result beside its known answer, `4.248354e-18`); an IEEE format constant (finfo's
  eps, tiny and smallest subnormal of float16, bfloat16, float32, float64, printed as finfo's
  3 digits), the same on every machine.
- **a timing or rate**: `12 ms`, `3.1 µs`, `0.4 s`, `tok/s`, `GB/s`, `it/s`, `seconds`.
- **a thread count or a tuner's choice**: `2 threads`, `4 BLAS threads`, `threads: 2`,
  `threads(): 2`, `set_threads(2): 2`, `tuner chose`.
- **an absolute temporary or home path**: `/tmp/...`, `/var/folders/...`, `/home/...`, `/root/...`,
  `/Users/...`, `/private/...`, `/work/...`, `C:\\...`.

One line per offending cell: notebook, nbval's cell number (`Cell N`, code cells from 0, as in
`pytest "nbs/x.ipynb::Cell N"`) and the offending text. The dynamic check, the notebooks run
again as another CPU would and every checked cell compared, is tools/other_cpu.py.
"""
import json
import re
from pathlib import Path

import numpy as np
from nbval.plugin import find_comment_markers

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4

NUMBER = re.compile(r'(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])')
BOUND = re.compile(r'(?:<|<=|≤|\bbelow|\bwithin|\bunder|\bthan|\bto|\btolerance|\beps|\batol'
                   r'|\brtol)[\s=:(]*$', re.I)
TIMING = re.compile(r'\d\s*(?:ns|µs|us|ms|s|sec|seconds?)\b|\b(?:tok|it|GB|MB|kB|GiB|MiB)/s\b')
THREADS = re.compile(r'\d+\s+(?:\w+\s+)?threads?\b|threads?(?:\(\d*\))?\s*[:=]\s*\d|tuner\s+cho',
                     re.I)
PATH = re.compile(r'(?<![\w.])(?:/(?:tmp|var/folders|home|root|Users|private|work)/\S*'
                  r'|[A-Z]:\\\S+)')


def _constants():
    "IEEE format constants, to 3 significant digits: the same on every machine."
    from gradus.core.dtype import bfloat16
    out = set()
    for t in (np.float16, np.float32, np.float64, bfloat16):
        fi = np.finfo(t)
        out |= {float(f"{float(v):.2e}") for v in (fi.eps, fi.tiny, fi.smallest_subnormal)}
    return out


CONSTANTS = _constants()


def digits(token):
    "Significant digits of a number as printed: `4e-16` 1, `3.20e-11` 3, `0.000123` 3."
    mantissa = re.split('[eE]', token.lstrip('+-'))[0].replace('.', '').lstrip('0')
    return len(mantissa)


def rounding_level(line):
    "The numbers in `line` that are error sizes at rounding level (module docstring)."
    out = []
    for m in NUMBER.finditer(line):
        x = float(m.group())
        if not (0 < abs(x) < TOLERANCE) or digits(m.group()) > 3: continue
        if BOUND.search(line[:m.start()]): continue
        if abs(x) in CONSTANTS: continue      # printed exactly as finfo's 3 digits: 2.22e-16
        out.append(m.group())
    return out


def offences(text):
    "Why `text`, a checked cell's stored output, would vary by machine: a list of short reasons."
    found = []
    for line in text.splitlines():
        if r := rounding_level(line): found.append(f"rounding-level {', '.join(r)}: {line.strip()}")
        for name, pat in (('timing', TIMING), ('threads', THREADS), ('path', PATH)):
            if pat.search(line): found.append(f"{name}: {line.strip()}")
    return found


def cell_text(cell):
    "A code cell's stored output as nbval compares it: streams and text/plain results."
    parts = []
    for o in cell.get('outputs', []):
        if o.get('output_type') == 'stream': parts.append(''.join(o.get('text', '')))
        elif 'data' in o: parts.append(''.join(o['data'].get('text/plain', '')))
        elif o.get('output_type') == 'error': parts.append(o.get('evalue', ''))
    return '\n'.join(parts)


def checked_cells(nb):
    "[(nbval cell number, cell)] of the cells of notebook dict `nb` whose outputs are compared."
    code = [c for c in nb['cells'] if c['cell_type'] == 'code']
    src = lambda c: ''.join(c['source']) if isinstance(c['source'], list) else c['source']
    return [(i, c) for i, c in enumerate(code) if dict(find_comment_markers(src(c))).get('check')]


def sweep(notebooks):
    "One line per offending checked cell: `notebook::Cell N: reason; reason`."
    lines = []
    for p in notebooks:
        nb = json.loads(Path(p).read_text())
        for i, cell in checked_cells(nb):
            if found := offences(cell_text(cell)):
                name = Path(p).relative_to(ROOT) if Path(p).is_relative_to(ROOT) else Path(p).name
                lines.append(f"{name}::Cell {i}: " + ' | '.join(found))
    return lines


def test_checked_outputs_are_the_same_on_every_machine():
    notebooks = sorted((ROOT / 'nbs').rglob('*.ipynb'))
    notebooks = [p for p in notebooks if '.ipynb_checkpoints' not in p.parts]
    assert len(notebooks) > 20
    found = sweep(notebooks)
    assert not found, ("checked outputs that vary by machine (round them, or assert and print a "
                       "stable statement):\n" + '\n'.join(found))


def _nb(*cells):
    "A notebook dict of code cells, each `(source, printed text)`."
    return {'cells': [{'cell_type': 'code', 'source': s, 'metadata': {},
                       'outputs': [{'output_type': 'stream', 'name': 'stdout', 'text': t}]}
                      for s, t in cells]}


def test_the_guard_refuses_what_varies(tmp_path):
    bad = [('# NBVAL_CHECK_OUTPUT\nprint(err)', 'layer_norm: forward 4e-16, backward 3e-16\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(err)', 'central differences 3.2e-11 (< 1e-6)\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(err)', 'float32 worst error 2.2e-07 of the output\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(err)', 'largest difference 2.2e-16 (one ulp at 1)\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(t)', 'step took 12.5 ms\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(t)', 'decode 22.6 tok/s -> 2.18 GB/s\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(n)', 'the tuner chose 2 threads\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(n)', 'after it: 2 | threads(): 4\n'),
           ('# NBVAL_CHECK_OUTPUT\nprint(p)', 'wrote /tmp/tmpab12cd/model.gguf\n')]
    good = [('# NBVAL_CHECK_OUTPUT\nprint(ok)', 'backward within 1e-12: True\n'),
            ('# NBVAL_CHECK_OUTPUT\nprint(ok)', 'max |Δ| < 1e-6: True (tolerance 1e-5)\n'),
            ('# NBVAL_CHECK_OUTPUT\nprint(ok)', 'gradients equal to 1e-6: True\n'),
            ('# NBVAL_CHECK_OUTPUT\nprint(v)', 'log1p(exp(-40)) = 4.248354e-18, lr 1.000e-05\n'),
            ('# NBVAL_CHECK_OUTPUT\nprint(v)', 'float64 eps 2.22e-16 tiny 2.23e-308\n'),
            ('# NBVAL_CHECK_OUTPUT\nprint(v)', 'loss 1.722927, 3 steps, two threads add 400\n'),
            ('print(t)  # not checked', 'step took 12.5 ms, error 3e-16\n')]
    path = tmp_path / 'made_up.ipynb'
    path.write_text(json.dumps(_nb(*bad, *good)))
    found = sweep([path])
    assert [line.split(':', 3)[2].strip() for line in found] == [
        *(f'Cell {i}' for i in range(len(bad)))], found
    assert 'rounding-level 4e-16, 3e-16' in found[0] and 'rounding-level 3.2e-11' in found[1]
    assert found[4].endswith('timing: step took 12.5 ms') and 'path: wrote /tmp/' in found[8]
