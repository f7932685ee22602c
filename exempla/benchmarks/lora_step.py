"""One LoRA training step on SmolLM2-135M (frozen GGUF weights): gradus vs PyTorch + PEFT.

The step, on each side: the mean cross-entropy of a batch of token sequences under the model with
LoRA adapters (rank 8, alpha 16, on all seven linear layers of every block: q, k, v, o, gate, up,
down), its gradient with respect to the adapters only, and one AdamW update of the adapters
(lr 1e-4, betas (0.9, 0.999), weight decay 0.01 on both sides).

- gradus: `gd.value_and_grad` of the loss through `models.forward` of `lora.attach(params,
  adapters)` (the weights stay in their GGML blocks, decoded as each product needs them) on the
  whole batch `(B, T)` at once (each linear layer one product on the `B·T` rows), then
  `optim.adamw(...).update`; `kernels.set_threads(n)` (BLAS and numba).
- PyTorch: transformers' `LlamaForCausalLM` loaded from the same GGUF file (dequantized to float32
  once at load), PEFT's `get_peft_model` with the same LoRA settings, one batched forward,
  `backward`, `torch.optim.AdamW` over the adapter parameters; `torch.set_num_threads(n)`.

Each side runs in its own worker process (so that each one's peak resident memory, `VmHWM` in
`/proc/self/status`, is its own); the parent alternates them: each round runs `--block` steps of
one side, then of the other, the order swapping every round, so that a change of machine load
falls on both. The first round is a warm-up (gradus traces and compiles its step there) and is not
timed. Both sides get the same batches (random token ids from `--seed`); both start from `B = 0`,
so their first losses are the base model's and must agree (printed). Prints the CPU, the threads,
the machine load before and after, the medians of wall and CPU time per step, the ratio
gradus/PyTorch, and each side's resident memory after loading and at its peak.

Run: python exempla/benchmarks/lora_step.py [--threads 2] [--rounds 3] [--block 2] [--seq 128]
     [--batch 4] [--seed 0]
"""
import argparse, json, os, platform, subprocess, sys, tempfile, time
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_step import machine_line, positive   # noqa: E402  (the CPU line, an int >= 1)

RANK, ALPHA, LR, WD = 8, 16.0, 1e-4, 0.01
HF_TARGETS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
TAG = '@@ '                                   # the workers' protocol lines on stdout


def batch(seed, step, size, seq, vocab):
    "The token ids `(size, seq + 1)` int64 of step `step`: the same on both sides."
    return np.random.default_rng([seed, step]).integers(0, vocab, (size, seq + 1))


def vm(key):
    "This process's `key` (VmRSS, VmHWM) from /proc/self/status, in MiB."
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'): return int(line.split()[1]) / 1024
    return float('nan')


def gradus_step_fn(threads):
    "gradus's step `(ids) -> loss` on SmolLM2, adapters and optimizer state kept inside."
    import gradus as gd
    from gradus.core import kernels
    from gradus.formats import gguf
    from gradus.learn import loss, optim, random
    from gradus.lm import lora, models
    kernels.keep_arrays_on_the_heap()          # as `gradus shakespeare` runs
    kernels.set_threads(threads)
    params, c = models.from_gguf(gguf.smollm2_path())
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA)
    opt = optim.adamw(LR, weight_decay=WD)
    ad = lora.init(random.key(0), params, cfg)
    state = {'ad': ad, 'opt': opt.init(ad)}

    def mean_loss(ad, ids):                    # ids (B, T + 1): the mean over B·T positions
        m = lora.attach(params, ad, cfg)       # one batched forward: logits (B, T, vocab)
        return loss.cross_entropy(models.forward(m, ids[:, :-1], c), ids[:, 1:])
    vg = gd.value_and_grad(mean_loss)

    def step(ids):
        value, g = vg(state['ad'], ids)
        state['ad'], state['opt'] = opt.update(g, state['opt'], state['ad'])
        return float(value)
    return step, f"gradus (numpy {np.__version__})", c.vocab_size


def torch_step_fn(threads):
    "PyTorch + PEFT's step `(ids) -> loss` on transformers' model of the same GGUF file."
    import torch, transformers, peft
    from gradus.formats import gguf            # only to find the file
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    path = gguf.smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS, lora_dropout=0.0))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WD)

    def step(ids):
        x = torch.from_numpy(ids)
        logits = model(input_ids=x[:, :-1]).logits                 # (B, T, vocab)
        value = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                  x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        return float(value.detach())
    what = (f"PyTorch {torch.__version__} eager + transformers {transformers.__version__} + "
            f"PEFT {peft.__version__}")
    return step, what, model.config.vocab_size


def worker(a):
    """A side's process: load, say `ready`, then for each `run k` line on stdin run its next `k`
    steps and answer their times and losses; on `quit`, answer the peak resident memory."""
    step, what, vocab = (gradus_step_fn if a.worker == 'gradus' else torch_step_fn)(a.threads)
    say = lambda **kw: print(TAG + json.dumps(kw), flush=True)
    say(what=what, rss_loaded=vm('VmRSS'), hwm_loaded=vm('VmHWM'))
    done = 0
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == 'quit': break
        out = []
        for _ in range(int(cmd[1])):
            ids = batch(a.seed, done, a.batch, a.seq, vocab)
            t0, c0 = time.perf_counter(), time.process_time()
            value = step(ids)
            out.append((time.perf_counter() - t0, time.process_time() - c0, value))
            done += 1
        say(steps=out)
    say(hwm=vm('VmHWM'))


class Side:
    "A worker process of one side, driven a line at a time; its stderr goes to a temporary file."
    def __init__(self, name, a):
        self.name, self.err = name, tempfile.TemporaryFile('w+')
        argv = [sys.executable, os.path.abspath(__file__), '--worker', name, '--threads',
                str(a.threads), '--seq', str(a.seq), '--batch', str(a.batch), '--seed', str(a.seed)]
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, bufsize=1)

    def answer(self):
        for line in self.p.stdout:
            if line.startswith(TAG): return json.loads(line[len(TAG):])
        self.err.seek(0)
        sys.exit(f"the {self.name} worker ended (exit {self.p.wait()}):\n"
                 + ''.join(self.err.readlines()[-30:]))

    def ask(self, text):
        self.p.stdin.write(text + '\n')
        self.p.stdin.flush()
        return self.answer()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--threads', type=positive, default=2)
    ap.add_argument('--rounds', type=positive, default=3, help='timed rounds (after one warm-up)')
    ap.add_argument('--block', type=positive, default=2, help='steps in a row per side and round')
    ap.add_argument('--seq', type=positive, default=128, help='tokens per sequence')
    ap.add_argument('--batch', type=positive, default=4, help='sequences per step')
    ap.add_argument('--seed', type=int, default=0, help='of the batches of token ids')
    ap.add_argument('--worker', choices=['gradus', 'torch'], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker: return worker(a)
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} threads={a.threads} "
          f"numpy={np.__version__}")
    print(machine_line())
    print(f"step: SmolLM2-135M Q4_1, LoRA rank {RANK} alpha {ALPHA:g} on q,k,v,o,gate,up,down, "
          f"batch {a.batch} x seq {a.seq}, AdamW; {a.rounds} timed rounds of {a.block} steps "
          f"per side after one warm-up round")
    print("load before:", os.popen('uptime').read().strip(), flush=True)
    try: import torch, transformers, peft  # noqa: F401  (only whether they import)
    except ImportError as e:
        sys.exit(f"PyTorch, transformers and peft are the comparator (the `oracle` extra): {e}")
    sides = [Side('gradus', a), Side('torch', a)]
    try:
        loaded = {s.name: s.answer() for s in sides}     # both load at once, before any timing
        times = {s.name: [] for s in sides}
        first = {}
        for r in range(a.rounds + 1):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                steps = s.ask(f'run {1 if r == 0 else a.block}')['steps']
                if r == 0: first[s.name] = steps[0][2]
                else: times[s.name] += [st[:2] for st in steps]
        hwm = {s.name: s.ask('quit')['hwm'] for s in sides}
    finally:
        for s in sides:
            if s.p.poll() is None and s.p.stdin: s.p.kill()   # a worker left by a failure
            s.p.wait()
    g0, t0 = first['gradus'], first['torch']
    print(f"first loss (the base model, B = 0): gradus {g0:.5f} torch {t0:.5f} "
          f"(|difference| {abs(g0 - t0):.1e})")
    med = {k: 1000 * np.median(v, axis=0) for k, v in times.items()}   # (wall, cpu) ms
    print(f"medians of {a.rounds * a.block} steps per side: wall time, and the CPU time of the "
          f"side's process (all its threads)")
    for name in ('torch', 'gradus'):
        (w, c), vs = med[name], ''
        if name == 'gradus':
            tw, tc = med['torch']
            vs = f"  gradus/torch {w / tw:.2f}x wall {c / tc:.2f}x cpu"
        print(f"threads={a.threads}  {name:6s} {w:8.0f} ms wall {c:8.0f} ms cpu{vs}  "
              f"({loaded[name]['what']})")
    for name in ('torch', 'gradus'):
        print(f"resident memory {name:6s}: {loaded[name]['rss_loaded']:6.0f} MiB after loading, "
              f"peak (VmHWM) {hwm[name]:6.0f} MiB")
    print(f"peak memory gradus/torch {hwm['gradus'] / hwm['torch']:.2f}x")
    print("load after: ", os.popen('uptime').read().strip())


if __name__ == '__main__':
    main()
