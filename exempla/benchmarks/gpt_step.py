"""One training step (forward, backward, AdamW) of the Shakespeare GPT: gradus vs PyTorch eager.

Same model (nanoGPT's CPU Shakespeare-char configuration: block 64, batch 12, 4 layers, 4 heads,
width 128, vocabulary 65, tied head), same optimizer settings, same thread count, measured in one
run. PyTorch is used only when it is importable (it is not a gradus dependency). Both sides run in
alternation at each thread count n (`gradus.core.kernels.set_threads(n)`: gradus splits the batch
over
n threads, `train.data_parallel`; `torch.set_num_threads(n)`: PyTorch splits each operation);
prints the CPU (model name, the CPU numba compiles for, each BLAS loaded with its kernel), the
medians and their ratios, the machine load before and after, and gradus under
`kernels.ThreadTuner`, which picks the count as it goes. `--busy K` starts K spinning processes
first (a neighbour holding a core); `--plain` adds gradus without its hand-written
kernels
(`gradus.core.kernels.disabled()`); `--blas` adds gradus on one thread with n BLAS threads (how it
ran
before data parallelism); `--no-kernels` runs gradus without the kernels only. The process keeps
freed arrays on glibc's heap (`kernels.keep_arrays_on_the_heap`), as `gradus shakespeare` does; both
libraries allocate through that `malloc` (`--malloc-default` leaves it as it is).

Run: python exempla/benchmarks/gpt_step.py [--threads 1 2] [--rounds 8] [--block 4] [--busy K]
     [--plain] [--blas] [--no-kernels] [--malloc-default]
"""
import argparse, contextlib, os, platform, time
import numpy as np


def gradus_step_fn(cfg, seed=0, parallel=True):
    """gradus's step; `parallel`: the batch split over `kernels.threads()` threads
    (`train.data_parallel`), else one thread with BLAS splitting each product."""
    import gradus as gd
    from gradus.transformer import gpt
    from gradus.learn import random, optim, train, loss as L
    mcfg = gpt.GPTConfig(cfg['vocab'], cfg['block'], cfg['layers'], cfg['heads'], cfg['width'])
    params = gpt.init(random.key(seed), mcfg)
    opt = optim.adamw(1e-3, betas=(0.9, 0.99), weight_decay=0.1, mask=optim.decay_mask)
    state = {'params': params, 'opt': opt.init(params)}
    vg = gd.value_and_grad(lambda p, x, y: L.cross_entropy(gpt.apply(p, x, mcfg), y))
    if parallel: vg = train.data_parallel(vg, (None, 0, 0))
    def step(x, y):
        loss, g = vg(state['params'], x, y)
        g, _ = optim.clip_by_global_norm(g, 1.0)
        state['params'], state['opt'] = opt.update(g, state['opt'], state['params'])
        return float(loss)
    return step


def torch_step_fn(cfg, seed=0):
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F
    torch.manual_seed(seed)
    C, H, V, Tb = cfg['width'], cfg['heads'], cfg['vocab'], cfg['block']

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(C), tnn.LayerNorm(C)
            self.qkv, self.proj = tnn.Linear(C, 3 * C), tnn.Linear(C, C)
            self.fc, self.fc2 = tnn.Linear(C, 4 * C), tnn.Linear(4 * C, C)
        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
            future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            att = att.masked_fill(future, float('-inf')).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate='tanh'))

    class GPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = tnn.Embedding(V, C), tnn.Embedding(Tb, C)
            self.blocks = tnn.ModuleList(Block() for _ in range(cfg['layers']))
            self.ln_f = tnn.LayerNorm(C)
        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks: x = b(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{'params': decay, 'weight_decay': 0.1}, {'params': rest, 'weight_decay': 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), foreach=True)
    def step(x, y):
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())
    return step


def busy_loops(n):
    "Start `n` processes that spin forever (a neighbour holding a core); the caller ends them."
    import subprocess, sys
    return [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(n)]


def alternate(sides, batches, threads, block=4, warmup=1):
    """Median ms of each `(name, step)` in `sides` at each count in `threads`. Every round runs
    each side for `block` steps in a row at each count, in turn, so that a change of machine load
    falls on all of them; the first step of a block is not timed (a library's threads left
    spinning by the side before, PyTorch's OpenMP pool or OpenBLAS's, slow it), and the order
    rotates every round. The first `warmup` rounds are not timed."""
    from gradus.core import kernels
    times = {(name, n): [] for name, _ in sides for n in threads}
    rounds = len(batches) // block
    for r in range(rounds):
        for n in threads:
            k = r % len(sides)
            for name, step in sides[k:] + sides[:k]:
                kernels.set_threads(n)
                if name == 'torch':
                    import torch
                    torch.set_num_threads(n)
                for j, (x, y) in enumerate(batches[r * block:(r + 1) * block]):
                    t0, c0 = time.perf_counter(), time.process_time()
                    step(x, y)
                    if r >= warmup and j > 0:
                        times[name, n].append((time.perf_counter() - t0,
                                               time.process_time() - c0))
    return {k: 1000 * np.median(v, axis=0) for k, v in times.items()}   # (wall, cpu) ms


def tuned(step, batches, max_threads, warmup=3):
    "Median ms of `step` run by `kernels.ThreadTuner`, and how many steps ran at each count."
    from gradus.core import kernels
    tuner = kernels.ThreadTuner(max_threads, period=10)
    for x, y in batches: tuner(step, x, y)
    ts = [dt for _, dt in tuner.history[warmup:]]
    counts = {n: sum(1 for k, _ in tuner.history if k == n) for n in range(1, max_threads + 1)}
    return 1000 * float(np.median(ts)), counts


def machine_line():
    """Which CPU this is: its model name (`/proc/cpuinfo`), the CPU numba compiles for (LLVM's
    host name) and whether it may emit AVX-512, and each BLAS loaded (whose: numpy's, scipy's) with
    its version and kernel (threadpoolctl's report)."""
    model = next((ln.split(':', 1)[1].strip() for ln in open('/proc/cpuinfo')
                  if ln.startswith('model name')), platform.processor() or '?') \
        if os.path.exists('/proc/cpuinfo') else platform.processor() or '?'
    try:
        import llvmlite.binding as llvm
        feats = llvm.get_host_cpu_features()
        isa = f"{llvm.get_host_cpu_name()}{' avx512f' if feats.get('avx512f') else ''}"
    except Exception as e: isa = f'? ({type(e).__name__})'
    from threadpoolctl import threadpool_info
    def owner(i): return os.path.basename(os.path.dirname(i['filepath'])).split('.')[0]  # numpy
    blas = ', '.join(f"{owner(i)}'s {i['internal_api']} {i['version']} {i.get('architecture', '?')}"
                     for i in threadpool_info() if i['user_api'] == 'blas') or 'none found'
    return f"cpu: {model} | numba target: {isa} | blas: {blas}"


def positive(text):
    "argparse type: an int >= 1."
    n = int(text)
    if n < 1: raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--threads', type=positive, nargs='+', default=[1, 2])
    ap.add_argument('--rounds', type=positive, default=8)
    ap.add_argument('--block', type=positive, default=4, help='steps in a row per side and round')
    ap.add_argument('--busy', type=int, default=0, help='background busy-loop processes')
    ap.add_argument('--no-kernels', action='store_true', help='trace without gradus.core.kernels')
    ap.add_argument('--plain', action='store_true',
                    help='also run the step without the kernels, alternating with the others')
    ap.add_argument('--malloc-default', action='store_true',
                    help="leave glibc's malloc thresholds as they are")
    ap.add_argument('--blas', action='store_true',
                    help='also run gradus on one thread with n BLAS threads (no data parallel)')
    a = ap.parse_args()
    if a.block < 2:
        ap.error(f"--block must be >= 2 (a block's first step is not timed), got {a.block}")
    from gradus.core import kernels
    if not a.malloc_default: kernels.keep_arrays_on_the_heap()   # as `gradus shakespeare` runs
    cfg = dict(vocab=65, block=64, batch=12, layers=4, heads=4, width=128)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 65, (12, 64)), rng.integers(0, 65, (12, 64)))
               for _ in range((a.rounds + 1) * a.block)]
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} numpy={np.__version__} "
          f"kernels={'off' if a.no_kernels else 'on'} busy loops={a.busy}")
    print(machine_line())
    procs = busy_loops(a.busy)
    try:
        time.sleep(1 if a.busy else 0)
        print("load before:", os.popen('uptime').read().strip())
        sides = [('gradus', gradus_step_fn(cfg))]
        if a.plain:                                  # the same step traced and run without kernels
            plain = gradus_step_fn(cfg)
            def plain_step(x, y):
                with kernels.disabled(): return plain(x, y)
            sides.append(('gradus-plain', plain_step))
        if a.blas: sides.append(('gradus-blas', gradus_step_fn(cfg, parallel=False)))
        try:
            import torch
            sides.append(('torch', torch_step_fn(cfg)))
        except ImportError:
            print("torch not importable: no comparator this run")
        with kernels.disabled() if a.no_kernels else contextlib.nullcontext():
            med = alternate(sides, batches, a.threads, a.block)
            tune = tuned(sides[0][1], batches, max(a.threads)) if len(a.threads) > 1 else None
        print("medians of wall time and of this process's CPU time per step (the CPU time of"
              " one thread is the steadier figure on a shared machine)")
        for n in a.threads:
            if ('torch', n) in med:
                w, c = med['torch', n]
                print(f"threads={n}  torch         {w:7.1f} ms wall {c:7.1f} ms cpu (PyTorch "
                      f"{torch.__version__} eager)")
            for name in ('gradus', 'gradus-plain', 'gradus-blas'):
                if (name, n) not in med: continue
                (w, c), vs = med[name, n], ''
                if ('torch', n) in med:
                    tw, tc = med['torch', n]
                    vs = f"  gradus/torch {w / tw:.2f}x wall {c / tc:.2f}x cpu"
                split = 'data parallel' if n > 1 else 'one thread'
                what = {'gradus': split, 'gradus-plain': f'{split}, no kernels',
                        'gradus-blas': 'one thread, BLAS threads'}[name]
                print(f"threads={n}  {name:13s} {w:7.1f} ms wall {c:7.1f} ms cpu ({what}){vs}")
        if tune:
            ms, counts = tune
            print(f"ThreadTuner(max {max(a.threads)})  gradus {ms:7.1f} ms/step, steps per "
                  f"thread count: {counts}")
        print("load after: ", os.popen('uptime').read().strip())
    finally:
        for p in procs: p.kill()


if __name__ == '__main__':
    main()
