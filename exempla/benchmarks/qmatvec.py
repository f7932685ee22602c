"""Quantized mat-vec (gradus.Q.qmatvec) against dequantize-then-matmul, measured in the same run.

Comparators: (a) dequantize the blocks to float32 then `W @ x` (what a reader without a quantized
kernel does on every call), (b) `W @ x` with W already decoded to float32 (memory 4-8x larger;
BLAS). Prints times and ratios.
Usage: python exempla/benchmarks/qmatvec.py
(uses SmolLM2 tensors when the models extra is installed)
"""
import os, platform, time
import numpy as np
from gradus import gguf as G, quants as Q
from gradus.quants import GGMLType

def best(f, n=20):
    f(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return min(ts)

def bench(label, blocks, t, x):
    W = Q.dequantize(blocks, t).reshape(blocks.shape[0], -1)
    tq = best(lambda: Q.qmatvec(blocks, t, x))
    td = best(lambda: Q.dequantize(blocks, t).reshape(blocks.shape[0], -1) @ x)
    tm = best(lambda: W @ x)
    print(f"{label:34} {t.name:5} {str(W.shape):>13} | qmatvec {tq*1e3:7.3f} ms "
          f"| dequant+matmul {td*1e3:7.3f} ms ({td/tq:5.2f}x slower) "
          f"| f32 matmul {tm*1e3:7.3f} ms ({tm/tq:5.2f}x of qmatvec) "
          f"| bytes {blocks.nbytes/W.nbytes:.3f} of f32")

if __name__ == '__main__':
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} numpy={np.__version__}")
    rng = np.random.default_rng(0)
    for t in Q.MATVEC_TYPES:
        n_out, n_in = 4096, 1024
        kind = GGMLType.Q4_0 if t == GGMLType.Q4_0 else GGMLType.Q8_0
        blocks = Q.quantize(rng.standard_normal(n_out * n_in).astype(np.float32), kind)
        if t == GGMLType.Q4_1:   # no Q4_1 quantizer in gradus: random blocks with finite scales
            blocks = rng.integers(0, 256, (n_out * n_in // 32, 20), dtype=np.uint8)
            scales = (rng.standard_normal((len(blocks), 2)) * 0.01).astype(np.float16)
            blocks[:, 0:4] = scales.view(np.uint8)
        bench('random', blocks.reshape(n_out, -1), t, rng.standard_normal(n_in).astype(np.float32))
    try:
        g = G.open_gguf(G.smollm2_path())
        for name in ('token_embd.weight', 'blk.0.ffn_down.weight', 'blk.0.ffn_up.weight'):
            info = g.tensors[name]
            x = rng.standard_normal(info.shape[1]).astype(np.float32)
            bench(f"SmolLM2 {name}", g.raw(name), info.type, x)
    except FileNotFoundError as e: print('SmolLM2 skipped:', e)
