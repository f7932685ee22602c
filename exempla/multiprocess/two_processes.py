"""The lowered GPT training step across 2 processes on this machine (jax.distributed on
localhost, CPU collectives over gloo), checked against gradus's single-process numpy step.

    python exempla/multiprocess/two_processes.py                # starts the 2 workers, compares
    python exempla/multiprocess/two_processes.py --steps 5 --local-devices 2

Each worker owns `--local-devices` CPU devices; the mesh spans the devices of both processes, so
the batch is split over 2 x local-devices devices and the gradient reduction crosses the process
boundary. Every process builds the same global batch from the same seed and contributes only its
own rows (`jax.make_array_from_process_local_data`), as each host of a real multi-host run would
read only its part of the data.
"""
import argparse, json, os, socket, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np

CFG = dict(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64)


def setup(batch, seed=0):
    "The model, the optimizer settings and a batch source, identical in every process."
    import gradus as gd
    from gradus.transformer import gpt
    from gradus.scale import lowering as LW
    from gradus.learn import optim, random as R, loss as L
    cfg = gpt.GPTConfig(**CFG)
    params = gpt.init(R.key(seed), cfg)
    loss_fn = lambda p, x, y: L.cross_entropy(gpt.apply(p, x, cfg), y)
    sched = optim.warmup_cosine(1e-3, 2, 100)
    opt = LW.AdamW(sched, (0.9, 0.99), 1e-8, 0.1, optim.decay_mask, clip_norm=1.0)
    r = np.random.default_rng(seed + 1)
    shape = (batch, cfg.block_size)                                       # (B, T)
    data = lambda: (r.integers(0, cfg.vocab_size, shape), r.integers(0, cfg.vocab_size, shape))
    moments = {'mu': gd.tree_map(np.zeros_like, params), 'nu': gd.tree_map(np.zeros_like, params)}
    return params, moments, loss_fn, opt, data


def worker(a):
    "One process: join the group, build the global mesh, run the data-parallel lowered step."
    import jax
    jax.config.update('jax_num_cpu_devices', a.local_devices)
    jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=a.num_processes,
                               process_id=a.process_id)
    import gradus as gd
    from gradus.scale import lowering as LW
    from jax.sharding import NamedSharding, PartitionSpec as P
    params, moments, loss_fn, opt, data = setup(a.batch)
    mesh = LW.data_mesh()                                   # every device of every process
    me = jax.process_index()
    rows = slice(me * a.batch // a.num_processes, (me + 1) * a.batch // a.num_processes)
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
    glob = lambda s, local: gd.tree_map(
        lambda v: jax.make_array_from_process_local_data(s, np.asarray(v)), local)
    x0, y0 = data()
    step = LW.train_step(loss_fn, opt)
    lowered = LW.to_jax(step, params, moments, LW.adamw_hyper(opt, 0), x0, y0)
    step = LW.data_parallel(lowered, mesh, batch_argnums=(3, 4))
    p, m = glob(rep, params), glob(rep, moments)
    losses, t0 = [], time.perf_counter()
    for t in range(a.steps):
        x, y = (x0, y0) if t == 0 else data()
        hyper = glob(rep, LW.adamw_hyper(opt, t))
        loss, p, m, norm = step(p, m, hyper, glob(shard, x[rows]), glob(shard, y[rows]))
        losses.append(float(np.asarray(loss.addressable_data(0))))
    ms = 1000 * (time.perf_counter() - t0) / a.steps
    if me == 0:
        flat = {gd.keystr(k): np.asarray(v.addressable_data(0))
                for k, v in gd.tree_flatten_with_path(p)}
        np.savez(a.out, **flat)
    print(json.dumps({'process': me, 'processes': jax.process_count(),
                      'devices': len(jax.devices()),
                      'local_devices': len(jax.local_devices()), 'rows': [rows.start, rows.stop],
                      'losses': losses, 'ms_per_step': round(ms, 1)}), flush=True)


def reference(a):
    "The same steps with gradus's numpy route: value_and_grad, clip_by_global_norm, adamw."
    import gradus as gd
    from gradus.learn import optim
    params, _, loss_fn, opt, data = setup(a.batch)
    np_opt = optim.adamw(opt.lr, opt.betas, opt.eps, opt.weight_decay, mask=opt.mask)
    vg, state, losses = gd.value_and_grad(loss_fn), np_opt.init(params), []
    for t in range(a.steps):
        loss, g = vg(params, *data())
        g, _ = optim.clip_by_global_norm(g, opt.clip_norm)
        params, state = np_opt.update(g, state, params)
        losses.append(float(loss))
    return {gd.keystr(k): v for k, v in gd.tree_flatten_with_path(params)}, losses


def launch(a):
    "Start both workers on a free local port, wait, and compare with the numpy reference."
    with socket.socket() as s:
        s.bind(('localhost', 0)); port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp())
    cmd = lambda i: [sys.executable, __file__, '--worker', '--process-id', str(i),
                     '--num-processes', '2', '--coordinator', f'localhost:{port}',
                     '--steps', str(a.steps), '--batch', str(a.batch),
                     '--local-devices', str(a.local_devices), '--out', str(tmp / 'params.npz')]
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    env['PYTHONPATH'] = str(Path(__file__).resolve().parents[2])
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    wall = time.perf_counter() - t0
    for p, (_, err) in zip(procs, outs):
        if p.returncode: sys.exit(f"worker failed ({p.returncode}):\n{err[-4000:]}")
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    want, ref_losses = reference(a)
    got = dict(np.load(tmp / 'params.npz'))
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    for r in res:
        print(f"process {r['process']} of {r['processes']}: {r['local_devices']} local of "
              f"{r['devices']} devices, batch rows {r['rows'][0]}:{r['rows'][1]}, "
              f"{r['ms_per_step']} ms/step (the first step compiles)")
    print(f"loss per step, 2 processes : {[round(x, 5) for x in res[0]['losses']]}")
    print(f"loss per step, numpy gradus: {[round(x, 5) for x in ref_losses]}")
    same = res[0]['losses'] == res[1]['losses']
    ldiff = max(abs(x - y) for x, y in zip(res[0]['losses'], ref_losses))
    ok = same and diff < 1e-4 and ldiff < 1e-4
    print(f"both processes report the same losses: {same}; max |loss diff| vs numpy {ldiff:.1e}; "
          f"max |param diff| after {a.steps} steps {diff:.1e} (float32 tolerance 1e-4: {ok})")
    print(f"wall time {wall:.1f} s for both workers (start-up, compile and {a.steps} steps)")
    return 0 if ok else 1


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    ap.add_argument('--process-id', type=int, default=0)
    ap.add_argument('--num-processes', type=int, default=2)
    ap.add_argument('--coordinator', default='localhost:12355')
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--local-devices', type=int, default=2)
    ap.add_argument('--out', default=None)
    a = ap.parse_args()
    if a.worker: worker(a)
    else: sys.exit(launch(a))
