"""Cost of a cached `gd.value_and_grad` call on a 2-layer MLP, against numpy in the same run.

Comparators, all measured here:
  forward   - the plain numpy forward of the same loss (no gradient)
  manual    - a hand-written numpy forward + backward (what a person would write without autodiff)
  matmuls   - the five matrix products of that forward + backward alone, on precomputed operands:
              a floor no forward + backward on numpy can go under
  gradus    - gd.value_and_grad(loss), cached (trace/compile excluded: one warm-up call), with the
              fusion pass of gradus.core.fuse (the default) and without it (fuse=False)
Prints median microseconds per call and the ratios gradus/forward and gradus/manual; the five sides
alternate within each round. The 1-minute load average is printed before and after.

Run: python exempla/benchmarks/mlp_overhead.py [--repeat 300] [--threads N]
"""
import argparse, platform, os, timeit
import numpy as np
import gradus as gd
from gradus.core import tensor as T
from gradus.core import ops


def loss(p, x, y):
    h = T.tanh(x @ p['w1'] + p['b1'])
    return ops.mean((h @ p['w2'] + p['b2'] - y) ** 2)


def forward_np(p, x, y):
    h = np.tanh(x @ p['w1'] + p['b1'])
    return np.mean((h @ p['w2'] + p['b2'] - y) ** 2)


def manual_np(p, x, y):
    h = np.tanh(x @ p['w1'] + p['b1'])
    d = h @ p['w2'] + p['b2'] - y
    value = np.mean(d ** 2)
    dd = 2 * d / d.size
    dh = (dd @ p['w2'].T) * (1 - h * h)
    return value, {'w1': x.T @ dh, 'b1': dh.sum(0), 'w2': h.T @ dd, 'b2': dd.sum(0)}


def matmuls_np(p, x, h, dd, dh):
    "The matrix products of `manual_np` alone: two forward, three backward."
    return x @ p['w1'], h @ p['w2'], dd @ p['w2'].T, h.T @ dd, x.T @ dh


def setup(batch, din, width, dout, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
    p = {'w1': f(din, width), 'b1': np.zeros(width, np.float32),
         'w2': f(width, dout), 'b2': np.zeros(dout, np.float32)}
    x = rng.standard_normal((batch, din)).astype(np.float32)
    return p, x, rng.standard_normal((batch, dout)).astype(np.float32)


def median_us(fns, repeat, rounds=10):
    "Median microseconds per call of each of `fns`, the sides alternating within each round."
    for fn in fns: fn()
    ts = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(ts, fns): t += timeit.repeat(fn, number=1, repeat=max(1, repeat // rounds))
    return [1e6 * float(np.median(t)) for t in ts]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--repeat', type=int, default=300)
    ap.add_argument('--threads', type=int, default=os.cpu_count())
    a = ap.parse_args()
    from threadpoolctl import threadpool_limits
    threadpool_limits(a.threads)
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"threads={a.threads} numpy={np.__version__} load(1 min)={os.getloadavg()[0]:.2f}")
    vg, vg_off = gd.value_and_grad(loss), gd.value_and_grad(loss, fuse=False)
    cases = [('small MLP 8x2-16-1', (8, 2, 16, 1)),
             ('MLP batch 64, 128-128-10', (64, 128, 128, 10))]
    for name, shape in cases:
        p, x, y = setup(*shape)
        mv, mg = manual_np(p, x, y)
        h = np.tanh(x @ p['w1'] + p['b1'])
        dd = 2 * (h @ p['w2'] + p['b2'] - y) / y.size
        dh = (dd @ p['w2'].T) * (1 - h * h)
        for f in (vg, vg_off):
            v, g = f(p, x, y)
            assert np.allclose(v, mv, rtol=1e-5)
            assert all(np.allclose(g[k], mg[k], rtol=1e-4, atol=1e-6) for k in g)
        t_fwd, t_man, t_mm, t_gd, t_off = median_us(
            [lambda: forward_np(p, x, y), lambda: manual_np(p, x, y),
             lambda: matmuls_np(p, x, h, dd, dh), lambda: vg(p, x, y), lambda: vg_off(p, x, y)],
            a.repeat)
        print(f"{name}: forward {t_fwd:.1f} us | manual fwd+bwd {t_man:.1f} us "
              f"| its 5 matmuls alone {t_mm:.1f} us ({t_mm / t_fwd:.2f}x forward)\n"
              f"  gradus value_and_grad {t_gd:.1f} us (fuse=False {t_off:.1f} us) "
              f"| gradus/forward {t_gd / t_fwd:.2f}x (fuse=False {t_off / t_fwd:.2f}x) "
              f"| gradus/manual {t_gd / t_man:.2f}x")
    print(f"load(1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == '__main__':
    main()
