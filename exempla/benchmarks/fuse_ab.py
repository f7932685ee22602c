"""The fusion pass on and off, alternating in one process: the Shakespeare GPT training step.

The step is gpt_step.py's (value_and_grad + global-norm clipping + AdamW, block 64, batch 12,
4 layers, 4 heads, width 128, vocabulary 65). Two copies are compiled, one with the fusion pass of
gradus.core.fuse and one without (GRADUS_FUSE read when each compiles); every round runs both at
each
thread count, so that a change of machine load falls on both. Prints the medians, their ratio, the
first-call (compile) time of each, the 1-minute load before and after, and a profile by primitive
of the compiled value_and_grad at one thread, fused and not.

Run: python exempla/benchmarks/fuse_ab.py [--threads 1 2] [--rounds 20]
"""
import argparse, os, sys, time
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_step import gradus_step_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--threads', type=int, nargs='+', default=[1, 2])
    ap.add_argument('--rounds', type=int, default=20)
    a = ap.parse_args()
    from threadpoolctl import threadpool_limits
    import gradus as gd
    from gradus.transformer import gpt
    from gradus.learn import random, loss as L
    from gradus.core import fuse as F
    cfg = dict(vocab=65, block=64, batch=12, layers=4, heads=4, width=128)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 65, (12, 64)), rng.integers(0, 65, (12, 64)))
               for _ in range(a.rounds + 3)]
    print(f"load(1 min) before: {os.getloadavg()[0]:.2f}; numpy {np.__version__}, cpus "
          f"{os.cpu_count()}, kernel cache {F.cache_dir()}")
    steps, first = {}, {}
    for name, flag in (('fused', '1'), ('unfused', '0')):
        os.environ['GRADUS_FUSE'] = flag
        steps[name] = gradus_step_fn(cfg)
        t0 = time.perf_counter(); steps[name](*batches[0]); first[name] = time.perf_counter() - t0
    print("first step (trace, transform, compile or load kernels): " +
          ", ".join(f"{k} {v:.2f} s" for k, v in first.items()))
    times = {(k, n): [] for k in steps for n in a.threads}
    for r, (x, y) in enumerate(batches):
        for n in a.threads:
            threadpool_limits(n)
            for k, step in steps.items():
                t0 = time.perf_counter(); step(x, y); dt = time.perf_counter() - t0
                if r >= 3: times[k, n].append(dt)
    for n in a.threads:
        on, off = (1e3 * float(np.median(times[k, n])) for k in ('fused', 'unfused'))
        print(f"threads={n}: fused {on:7.1f} ms/step | unfused {off:7.1f} ms/step | "
              f"fused/unfused {on / off:.2f}x")
    threadpool_limits(1)
    mcfg = gpt.GPTConfig(65, 64, 4, 4, 128)
    params = gpt.init(random.key(0), mcfg)
    def loss(p, x, y): return L.cross_entropy(gpt.apply(p, x, mcfg), y)
    for fz in (False, True):
        p = F.profile(gd.value_and_grad(loss, fuse=fz), params, *batches[0], repeat=10)
        rows = ', '.join(f"{k} {1e3 * t:.1f}" for k, _, t in p.by_label()[:7])
        print(f"profile fuse={fz} (1 thread, ms/call): total {1e3 * p.seconds.sum():.1f} | {rows}")
    print(f"load(1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == '__main__':
    main()
