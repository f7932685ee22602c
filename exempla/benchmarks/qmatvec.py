"""Quantized mat-vec (gradus.lm.qkernels.qmatvec, exact=True: the formats wing's
quants.matvec_exact) against dequantize-then-matmul, in the same run.

For every type qmatvec supports (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) on a random 4096 x 1024
matrix, then on real tensors of Gemma 3 270M and SmolLM2 where their packages are installed.
Comparators, measured in the same rounds with the sides alternating: (a) dequantize the blocks to
float32 then `W @ x` (what a reader without a quantized kernel does on every call), (b) `W @ x` with
W already decoded to float32 (BLAS; 3.5-8x the memory). Prints medians, ratios and the bandwidth
each side reaches: GB/s of stored blocks read per second for qmatvec and dequantize, of float32
weights for the BLAS matmul. A last line times a batch of 16 vectors (x of shape (16, n_in)) against
16 single calls. The machine load (`uptime`) is printed before and after.
Usage: python exempla/benchmarks/qmatvec.py [--rounds 21] [--threads N] [--quick]
(on a busy machine, --threads 1: a parallel region waits for its slowest thread, so with the cores
taken by other processes two-thread timings measure the scheduler)
"""
import argparse, os, platform, subprocess, time
import numba
import numpy as np
from gradus.formats import gguf as G, quants as Q
from gradus.formats.quants import GGMLType, BLOCK
from gradus.lm.qkernels import qmatvec

def uptime():
    return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()

def medians(fns, rounds):
    "Median seconds of each function in `fns` (a dict), the sides alternating within each round."
    for f in fns.values(): f()                                       # warm-up (and numba compile)
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter(); f(); ts[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in ts.items()}

def bench(label, blocks, t, x, rounds):
    W = Q.dequantize(blocks, t).reshape(blocks.shape[0], -1)         # (n_out, n_in) float32
    once = time.perf_counter(); Q.dequantize(blocks, t); once = time.perf_counter() - once
    m = medians({'q': lambda: qmatvec(blocks, t, x),
                 'd': lambda: Q.dequantize(blocks, t).reshape(blocks.shape[0], -1) @ x,
                 'f': lambda: W @ x}, max(3, min(rounds, int(3 / (once + 1e-9)))))
    gb = lambda n, s: n / s / 1e9
    print(f"{label:32} {t.name:5} {str(W.shape):>14} | qmatvec {m['q']*1e3:8.3f} ms "
          f"{gb(blocks.nbytes, m['q']):5.2f} GB/s | dequant+matmul {m['d']*1e3:8.3f} ms "
          f"({m['d']/m['q']:5.2f}x qmatvec) | f32 matmul {m['f']*1e3:7.3f} ms "
          f"{gb(W.nbytes, m['f']):5.2f} GB/s ({m['f']/m['q']:4.2f}x) "
          f"| blocks {blocks.nbytes/W.nbytes:.3f} of f32")

def random_matrix(t, rng, n_out=4096, n_in=1024):
    "Random blocks of type t with finite float16 scale fields, (n_out, row bytes)."
    bs, ts = BLOCK[t]
    b = rng.integers(0, 256, (n_out * n_in // bs, ts), dtype=np.uint8)
    at = {GGMLType.Q4_1: [0, 2], GGMLType.Q5_1: [0, 2], GGMLType.Q4_K: [0, 2],
          GGMLType.Q6_K: [208]}.get(t, [0])
    for o in at:
        b[:, o:o + 2] = (rng.standard_normal(len(b)) * 0.01).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return b.reshape(n_out, -1)

def real(label, path_fn, names, rng, rounds):
    try: g = G.open_gguf(path_fn(), max_read=1 << 30)       # the 178 MB Gemma head in one read
    except FileNotFoundError as e: print(f"{label} skipped: {e}"); return None
    for name in names:
        info = g.tensors[name]
        x = rng.standard_normal(info.shape[1]).astype(np.float32)
        bench(f"{label} {name}", g.raw(name), info.type, x, rounds)
    return g

def batched(g, name, rng, rounds, n=16):
    info = g.tensors[name]; b = g.raw(name)
    X = rng.standard_normal((n, info.shape[1])).astype(np.float32)
    m = medians({'batch': lambda: qmatvec(b, info.type, X),
                 'loop': lambda: [qmatvec(b, info.type, x) for x in X]}, rounds)
    print(f"batch of {n} on {name} ({info.type.name}): one call {m['batch']*1e3:.3f} ms | "
          f"{n} calls {m['loop']*1e3:.3f} ms ({m['loop']/m['batch']:.2f}x the batch)")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=21)
    p.add_argument('--threads', type=int, default=None, help='numba threads (default: all)')
    p.add_argument('--quick', action='store_true', help='random matrices only')
    a = p.parse_args()
    if a.threads:                        # the same thread count for numba and for BLAS
        numba.set_num_threads(a.threads)
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(a.threads)
        except ImportError: print('threadpoolctl absent: BLAS keeps its default thread count')
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} threads={numba.get_num_threads()} "
          f"numpy={np.__version__} numba={numba.__version__}")
    print(f"load before: {uptime()}")
    rng = np.random.default_rng(0)
    for t in Q.MATVEC_TYPES:
        x = rng.standard_normal(1024).astype(np.float32)
        bench('random', random_matrix(t, rng), t, x, a.rounds)
    if not a.quick:
        g = real('Gemma3', G.gemma3_path, ['blk.0.attn_q.weight', 'blk.0.attn_v.weight',
                                           'blk.0.attn_output.weight', 'blk.0.ffn_up.weight',
                                           'blk.0.ffn_down.weight', 'token_embd.weight'],
                 rng, a.rounds)
        real('SmolLM2', G.smollm2_path, ['blk.0.ffn_down.weight', 'token_embd.weight'], rng,
             a.rounds)
        if g is not None: batched(g, 'blk.0.ffn_up.weight', rng, a.rounds)
    print(f"load after: {uptime()}")
