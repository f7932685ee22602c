"""Run the notebook tests as a different machine would, and name every cell whose output differs.

A checked cell (`# NBVAL_CHECK_OUTPUT`) must print the same text on every CPU, BLAS build,
thread count and load. This tool re-runs the notebooks' tests (nbval, the same lax mode and
sanitizer as the test command) in a process that computes differently from this one:

  OPENBLAS_CORETYPE       another OpenBLAS kernel set: Sandybridge (AVX, no FMA), or Haswell when
                          this machine already runs Sandybridge's (threadpoolctl's `architecture`)
  OPENBLAS_NUM_THREADS    1 (or 2 where this machine runs BLAS on one thread)
  NPY_DISABLE_CPU_FEATURES  every SIMD group that this numpy dispatches to and this CPU has, so
                          its loops run at the build's baseline (`np.show_runtime()`: "found"
                          becomes empty; on numpy 2.4 the names are X86_V3, X86_V4, AVX512_ICL ...;
                          older numpy names single features, AVX2, FMA3, AVX512F ...)
  NUMBA_CPU_NAME          generic: numba compiles for a baseline x86-64 (SSE2, no AVX: other
                          vector widths, so fastmath reductions add in another order);
                          `--numba-cpu sandybridge` (AVX, no AVX2/FMA/F16C) where a kernel
                          cannot run on generic (gradus.lm.qkernels' `fpext half` crashes there)
  NUMBA_NUM_THREADS       1 (or 2): numba's parallel loops split their work differently
  NUMBA_CACHE_DIR, GRADUS_CACHE  fresh empty folders, so nothing compiled here is reused

Before the run it prints each variable's effect as a child process sees it (this machine's
value -> the run's), so a variable that no longer changes anything shows as unchanged.

Usage (from the repository root, in the project's virtual environment):

    python tools/other_cpu.py                          # every notebook under nbs/
    python tools/other_cpu.py nbs/learn nbs/core/00_dtype.ipynb   # folders or notebooks
    python tools/other_cpu.py --show                   # only the table of what changes
    python tools/other_cpu.py --keep NUMBA_CPU_NAME    # leave a variable as it is here
    python tools/other_cpu.py --numba-cpu sandybridge nbs/lm   # another CPU for numba

It prints a line per notebook and a block per failing cell: `notebook::Cell N` (nbval's
numbering: code cells from 0), whether a checked output differs, the cell raised, or it timed
out (a crashed kernel shows as a timed-out cell), and the end of pytest's report. Exit status 0
when every cell passes, 1 otherwise. All the notebooks take 30+ minutes on two busy cores (each
notebook runs in its own process, numba compiles everything afresh); a busy machine adds to the
time, not to the result.
The static guard beside it is tests/test_same_everywhere.py (run by the test command).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, numpy as np, numba
from threadpoolctl import threadpool_info
try: import numpy._core._multiarray_umath as U
except ImportError: import numpy.core._multiarray_umath as U
F, D = U.__cpu_features__, U.__cpu_dispatch__
blas = next((i for i in threadpool_info() if i['user_api'] == 'blas'), {})
print(json.dumps({'blas kernel': blas.get('architecture'), 'blas threads': blas.get('num_threads'),
                  'numpy SIMD dispatched': [f for f in D if F.get(f)],
                  'numba cpu': numba.config.CPU_NAME or 'host',
                  'numba threads': numba.config.NUMBA_NUM_THREADS}))
"""


def probe(env):
    "What a fresh Python with `env` computes with: BLAS kernel and threads, numpy SIMD, numba."
    out = subprocess.run([sys.executable, '-c', PROBE], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def other_env(here, keep=(), numba_cpu='generic'):
    "The environment of a machine unlike this one (`here`: `probe` of this one)."
    env = dict(os.environ)
    kernel = 'Haswell' if here['blas kernel'] == 'Sandybridge' else 'Sandybridge'
    new = {'OPENBLAS_CORETYPE': kernel,
           'OPENBLAS_NUM_THREADS': '2' if here['blas threads'] == 1 else '1',
           'NPY_DISABLE_CPU_FEATURES': ' '.join(here['numpy SIMD dispatched']),
           'NUMBA_CPU_NAME': numba_cpu,
           'NUMBA_NUM_THREADS': '2' if here['numba threads'] == 1 else '1'}
    for k, v in new.items():
        if k not in keep and v: env[k] = v
    return env


def notebooks(paths):
    "The notebooks named by `paths` (notebooks or folders, searched recursively), in order."
    out = []
    for p in map(Path, paths):
        found = sorted(p.rglob('*.ipynb')) if p.is_dir() else [p]
        out += [q for q in found if '.ipynb_checkpoints' not in q.parts]
    return out


def failures(nb, env, report, timeout):
    """Run one notebook's tests under `env` in a fresh process; `(exit status, [(nodeid, report
    text)])` of its failed cells (a crashed run leaves what it had recorded)."""
    Path(report).write_text('')
    cmd = [sys.executable, __file__, '--child', report, f'--nbval-cell-timeout={timeout}', str(nb)]
    code = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode
    lines = Path(report).read_text().splitlines()
    return code, [tuple(json.loads(line)) for line in lines]


def checked_cells(nb_path):
    "{nbval cell number: True if its output is compared} for a notebook."
    from nbval.plugin import find_comment_markers
    nb = json.loads(Path(nb_path).read_text())
    code = [c for c in nb['cells'] if c['cell_type'] == 'code']
    src = lambda c: ''.join(c['source'])
    return {i: dict(find_comment_markers(src(c))).get('check', False) for i, c in enumerate(code)}


class _Recorder:
    "pytest plugin: appends `[nodeid, report text]` of every failed test to a file, at once."
    def __init__(self, path): self.path = path
    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, 'a') as f: f.write(json.dumps([report.nodeid,
                                                                 report.longreprtext]) + '\n')


def child(report, args):
    "Inside the changed environment: run pytest (the project's options) and record failures."
    import pytest
    return int(pytest.main(['-q', '-p', 'no:cacheprovider', *args], plugins=[_Recorder(report)]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('paths', nargs='*', default=['nbs'], help='notebooks or folders (default nbs)')
    ap.add_argument('--show', action='store_true', help='print what changes and run nothing')
    ap.add_argument('--keep', action='append', default=[], metavar='VAR',
                    help='leave this variable as it is here (repeatable)')
    ap.add_argument('--numba-cpu', default='generic', metavar='NAME',
                    help='the CPU numba compiles for (an LLVM name; default generic)')
    ap.add_argument('--timeout', type=int, default=900, metavar='S',
                    help='seconds a cell may run before it counts as failed (default 900)')
    ap.add_argument('--child', metavar='REPORT', help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args(argv)
    if a.child: return child(a.child, rest + a.paths)
    if rest: ap.error(f"unrecognized arguments: {' '.join(rest)}")
    here = probe(dict(os.environ))
    bad = 0
    with tempfile.TemporaryDirectory(prefix='gradus-other-cpu-') as tmp:
        env = other_env(here, a.keep, a.numba_cpu)
        env['NUMBA_CACHE_DIR'], env['GRADUS_CACHE'] = f'{tmp}/numba', f'{tmp}/gradus'
        there = probe(env)
        print('what a second machine computes with (here -> the run):')
        for k in here:
            mark = '' if here[k] != there[k] else '   (unchanged)'
            print(f'  {k:24} {here[k]} -> {there[k]}{mark}')
        changed = sorted(k for k in env if env[k] != os.environ.get(k))
        print('  ' + ' '.join(f'{k}={env[k]!r}' for k in changed), flush=True)
        if a.show: return 0
        for nb in notebooks(a.paths):
            code, failed = failures(nb, env, f'{tmp}/report.jsonl', a.timeout)
            checked = checked_cells(nb)
            rel = nb.resolve().relative_to(ROOT) if nb.resolve().is_relative_to(ROOT) else nb
            print(f'{rel}: {len(failed)} of {len(checked)} code cells fail'
                  + ('' if code in (0, 1) else f' (pytest exit {code})'), flush=True)
            bad += len(failed) + (code not in (0, 1, 5))
            for nodeid, text in failed:
                cell = nodeid.partition('::')[2]
                kind = 'raised'
                if 'Cell outputs differ' in text: kind = 'checked output differs'
                elif 'Timeout of' in text: kind = 'timed out'
                tail = '\n'.join('    ' + line for line in text.splitlines()[-25:])
                print(f'  {rel}::{cell}: {kind}\n{tail}', flush=True)
    print(f"\n{bad} failing item{'s' * (bad != 1)} on the other machine")
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
