"""What one numba parallel region costs under each threading layer, on the machine as it is and
beside a busy neighbour (one CPU-bound child process), and the decode rate of `gradus.lm.engine`
(one parallel region per token) under each.

Each case runs in a fresh child process (numba picks its threading layer once per process):
`NUMBA_THREADING_LAYER` = workqueue, omp, tbb (tbb where `pip install tbb` put libtbb in this
environment; skipped otherwise), 2 threads. Printed per case: the median time of an empty
`prange(2)` loop over 2000 calls, and SmolLM2-135M decode tokens/s with the process's CPU time per
token (CPU time above wall time x threads means spinning). The neighbour is killed after each case.
Usage: python exempla/benchmarks/launch.py [--tokens 32]
"""

import argparse, json, os, subprocess, sys
from pathlib import Path

CHILD = r'''
import json, sys, time
import numpy as np, numba
from numba import njit, prange

@njit(parallel=True)
def empty(n, out):
    for i in prange(n):
        out[i] += 1.0

numba.set_num_threads(2)
out = np.zeros(2)
empty(2, out)
ts = []
for _ in range(2000):
    t0 = time.perf_counter()
    empty(2, out)
    ts.append(time.perf_counter() - t0)
from gradus.lm import engine, models
from gradus.formats import gguf
n = int(sys.argv[1])
params, c = models.from_gguf(gguf.smollm2_path())
engine.decode_step(params, c, models.new_cache(c, 2), 1, 0, engine.workspace(params, c, 2))
cache, ws = models.new_cache(c, n + 1), engine.workspace(params, c, n + 1)
t0, c0 = time.perf_counter(), time.process_time()
for p in range(n):
    engine.decode_step(params, c, cache, 100 + p, p, ws)
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({'layer': numba.threading_layer(), 'launch_us': float(np.median(ts)) * 1e6,
                  'tok_s': n / dt, 'cpu_ms': cpu / n * 1e3}))
'''


def load():
    return ' '.join(open('/proc/loadavg').read().split()[:3])


def case(layer, busy, tokens):
    env = {**os.environ, 'NUMBA_THREADING_LAYER': layer, 'NUMBA_NUM_THREADS': '2',
           'OPENBLAS_NUM_THREADS': '2'}
    lib = Path(sys.prefix) / 'lib'
    if layer == 'tbb' and (lib / 'libtbb.so.12').exists():
        env['LD_LIBRARY_PATH'] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    hog = subprocess.Popen([sys.executable, '-c', 'while True: pass']) if busy else None
    try:
        r = subprocess.run([sys.executable, '-c', CHILD, str(tokens)], env=env,
                           capture_output=True, text=True)
    finally:
        if hog:
            hog.kill()
            hog.wait()
    if r.returncode:
        lines = r.stderr.strip().splitlines()
        return None, lines[-1] if lines else f'exit {r.returncode}'
    return json.loads(r.stdout.strip().splitlines()[-1]), ''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--tokens', type=int, default=32)
    args = ap.parse_args()
    print(f"cpus={os.cpu_count()} | load (1/5/15 min) before: {load()}")
    for busy in (False, True):
        for layer in ('workqueue', 'omp', 'tbb'):
            got, why = case(layer, busy, args.tokens)
            where = 'busy neighbour' if busy else 'as is        '
            if got is None:
                print(f"{layer:9s} {where} | not run: {why}")
                continue
            print(f"{got['layer']:9s} {where} | empty parallel region {got['launch_us']:7.1f} us"
                  f" | decode {got['tok_s']:5.1f} tok/s, CPU {got['cpu_ms']:5.1f} ms/token "
                  f"(wall {1e3 / got['tok_s']:5.1f} ms) | load {load()}")
    print(f"load after: {load()}")


if __name__ == '__main__':
    main()
