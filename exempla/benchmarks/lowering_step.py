"""The Shakespeare GPT training step three ways, measured in one run: gradus's numpy backend, the
same step lowered to JAX under `jax.jit` on one CPU device, and the lowered step sharded over 8
simulated CPU devices (jit + NamedSharding, batch split, parameters replicated).

Model of `gradus shakespeare` (block 64, 4 layers, 4 heads, width 128, vocabulary 65) and its step
(value_and_grad, global-norm clipping at 1.0, AdamW with the decay mask). Batch 16, not 12, so that
it splits over 8 devices. The three sides alternate within each round; medians over the rounds
after 3 warm-up rounds (XLA's compile is timed separately). Also counts the graph's equations (one
numpy call each) against the kernels XLA compiled them into.

Run: python exempla/benchmarks/lowering_step.py [--rounds 20] [--batch 16] [--threads N]
"""
import os
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'   # before jax is imported
import argparse, platform, re, subprocess, time
import numpy as np


def build(batch, seed=0):
    "The numpy step (a closure over its state), the lowered step, and the arguments to start from."
    import gradus as gd
    from gradus.transformer import gpt
    from gradus.scale import lowering as LW
    from gradus.learn import optim, random as R, loss as L
    cfg = gpt.GPTConfig(65, 64, 4, 4, 128)
    params = gpt.init(R.key(seed), cfg)
    loss_fn = lambda p, x, y: L.cross_entropy(gpt.apply(p, x, cfg), y)
    opt = LW.AdamW(1e-3, (0.9, 0.99), 1e-8, 0.1, optim.decay_mask, clip_norm=1.0)
    np_opt = optim.adamw(opt.lr, opt.betas, opt.eps, opt.weight_decay, mask=opt.mask)
    vg = gd.value_and_grad(loss_fn)
    st = {'p': params, 's': np_opt.init(params)}
    def numpy_step(x, y, t):
        loss, g = vg(st['p'], x, y)
        g, _ = optim.clip_by_global_norm(g, opt.clip_norm)
        st['p'], st['s'] = np_opt.update(g, st['s'], st['p'])
        return float(loss)
    moments = {'mu': gd.tree_map(np.zeros_like, params), 'nu': gd.tree_map(np.zeros_like, params)}
    r = np.random.default_rng(1)
    x0, y0 = r.integers(0, 65, (batch, 64)), r.integers(0, 65, (batch, 64))   # (B, T)
    step = LW.train_step(loss_fn, opt)
    lowered = LW.to_jax(step, params, moments, LW.adamw_hyper(opt, 0), x0, y0)
    return numpy_step, lowered, params, moments, opt, (x0, y0)


def jax_side(step_fn, params, moments, opt):
    "A JAX step with its own state; waits for the result so that the time is the step's."
    import jax
    from gradus.scale import lowering as LW
    st = {'p': params, 'm': moments}
    def step(x, y, t):
        loss, st['p'], st['m'], _ = step_fn(st['p'], st['m'], LW.adamw_hyper(opt, t), x, y)
        return float(jax.block_until_ready(loss))
    return step


def uptime(): return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


def count_kernels(compiled):
    "Fusions, and all kernels (fusions, dots, custom calls), in the optimised HLO of `compiled`."
    hlo = compiled.as_text()
    op = r'^\s*(?:ROOT )?\S+ = \S+ (?:{})\('
    return (len(re.findall(op.format('fusion'), hlo, re.M)),
            len(re.findall(op.format('fusion|dot|custom-call|convolution'), hlo, re.M)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=20)
    ap.add_argument('--batch', type=int, default=16)
    ap.add_argument('--threads', type=int, default=None, help="numpy's BLAS threads")
    a = ap.parse_args()
    if a.threads:
        from threadpoolctl import threadpool_limits
        threadpool_limits(a.threads)
    import jax
    from gradus.scale import lowering as LW
    numpy_step, lowered, params, moments, opt, (x0, y0) = build(a.batch)
    single = jax.jit(lowered)
    sharded = LW.data_parallel(lowered, LW.data_mesh(8), batch_argnums=(3, 4))
    t0 = time.perf_counter()
    compiled = single.lower(params, moments, LW.adamw_hyper(opt, 0), x0, y0).compile()
    compile_s = time.perf_counter() - t0
    fusions, kernels = count_kernels(compiled)
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} numpy={np.__version__} "
          f"jax={jax.__version__} devices={len(jax.devices())} (simulated CPU) "
          f"BLAS threads={a.threads or 'default'}")
    print(f"load before: {uptime()}")
    print(f"graph: {len(lowered.graph.eqns)} gradus equations (one numpy call each) -> XLA: "
          f"{fusions} fusions, {kernels} kernels in all; one-device compile {compile_s:.1f} s")
    sides = {'numpy (gradus codegen)': numpy_step,
             'JAX jit, 1 device': jax_side(single, params, moments, opt),
             'JAX jit, 8 devices sharded': jax_side(sharded, params, moments, opt)}
    r = np.random.default_rng(2)
    batches = [(r.integers(0, 65, (a.batch, 64)), r.integers(0, 65, (a.batch, 64)))
               for _ in range(a.rounds + 3)]
    times = {k: [] for k in sides}
    for i, (x, y) in enumerate(batches):
        for name, fn in sides.items():
            t0 = time.perf_counter(); fn(x, y, i); dt = time.perf_counter() - t0
            if i >= 3: times[name].append(dt)   # rounds 0-2: warm-up (the first JAX calls compile)
    base = np.median(times['numpy (gradus codegen)'])
    for name, ts in times.items():
        m, q1, q3 = (1000 * np.percentile(ts, q) for q in (50, 25, 75))
        print(f"{name:27s} median {m:7.1f} ms/step  numpy/this {1000 * base / m:5.2f}x  "
              f"(IQR {q1:.1f}-{q3:.1f} ms, {len(ts)} rounds)")
    print(f"load after: {uptime()}")


if __name__ == '__main__':
    main()
