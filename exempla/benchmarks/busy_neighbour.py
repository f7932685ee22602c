"""Each command path of gradus quiet and beside a busy neighbour: how much slower a step gets when
another process holds a core.

The neighbour is one child process spinning on one core (`while True: pass`). Paths, all on the
library calls the commands make: `gradus generate` on SmolLM2-135M (prefill of a 5-token and of a
46-token prompt, then 16 greedy decode tokens: `models.stepper` driven by `decode.generate`), one
`gradus chat` turn (`chat.Chat.turn`, 8 tokens), the sample after `gradus shakespeare` (500
characters from a freshly initialised GPT of 2 layers, width 64: `shakespeare.sample_text`) and a
training step of the default Shakespeare GPT as `gradus shakespeare` runs it (`train.fit`, the
batch split over `kernels.threads()` shards). `generate` gets the model's widths, as
`gradus generate` passes them. Each path runs quiet and busy in alternation (the order swaps every
round), medians over the rounds; the table gives each path's busy/quiet ratio (the aim: none
above ~2x). The whole set runs in a fresh process per value of the environment's
`OPENBLAS_NUM_THREADS` (default: unset and 2), to show that it no longer decides; `--before` runs
it as gradus did before `kernels.blas_threads_for` (BLAS left at the environment's count), for
comparison.

`--products` measures instead where two BLAS threads stop losing to one: float32 products
`(m, k) @ (k, n)` from 0.9 M to 450 M multiply-adds, each at 1 and 2 threads in blocks (the first
call of a block untimed), quiet and busy alternating; medians of `--rounds`. The threshold
`kernels.SMALL_PRODUCT` comes from it (`nbs/core/08_kernels.ipynb`).

Run: python exempla/benchmarks/busy_neighbour.py [--rounds 3] [--envs unset 2] [--before]
     [--small-product N]
     python exempla/benchmarks/busy_neighbour.py --products [--rounds 5]
"""
import argparse, contextlib, json, os, platform, subprocess, sys, time
import numpy as np


def uptime():
    return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def neighbour(busy):
    "A child process spinning on one core while the block runs (nothing when not `busy`)."
    if not busy:
        yield
        return
    spin = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    time.sleep(0.3)                                 # let it start and take its core
    try: yield
    finally:
        spin.kill()
        spin.wait()


# ---------------------------------------------------------------- where 2 threads stop losing
SHAPES = [(m, 576, 1536) for m in (1, 4, 16, 46, 128, 256, 512)] + \
         [(m, 128, 512) for m in (64, 768, 3072)]


def product_time(ctl, a, b, threads, budget=0.03):
    "Median seconds of `a @ b` at `threads` BLAS threads over a block of ~`budget` seconds."
    with ctl.limit(limits=threads):
        t0 = time.perf_counter(); a @ b; first = time.perf_counter() - t0   # untimed, sizes reps
        reps = int(min(200, max(3, budget / max(first, 1e-6))))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def products(rounds):
    from threadpoolctl import ThreadpoolController
    ctl = ThreadpoolController().select(user_api='blas')
    rng = np.random.default_rng(0)
    ops = [(s, rng.standard_normal(s[:2]).astype(np.float32),
            rng.standard_normal(s[1:]).astype(np.float32)) for s in SHAPES]
    times = {(s, busy, n): [] for s, _, _ in ops for busy in (False, True) for n in (1, 2)}
    for r in range(rounds):
        for busy in ((False, True) if r % 2 == 0 else (True, False)):
            with neighbour(busy):
                for s, a, b in ops:
                    for n in ((1, 2) if r % 2 == 0 else (2, 1)):
                        times[s, busy, n].append(product_time(ctl, a, b, n))
    print(f"{'product (m, k) @ (k, n)':>24s} {'multiply-adds':>14s} | quiet: 1 thread  2 threads "
          f" 2/1 | busy: 1 thread  2 threads   2/1")
    for s, _, _ in ops:
        m = {(busy, n): 1e3 * float(np.median(times[s, busy, n])) for busy in (False, True)
             for n in (1, 2)}
        print(f"{str(s):>24s} {s[0] * s[1] * s[2]:>14,d} | {m[False, 1]:9.3f} ms "
              f"{m[False, 2]:7.3f} ms {m[False, 2] / m[False, 1]:5.2f} | {m[True, 1]:9.3f} ms "
              f"{m[True, 2]:7.3f} ms {m[True, 2] / m[True, 1]:5.2f}")


# ---------------------------------------------------------------- the command paths
def worker(rounds, before, small_product=None):
    "Runs in a child process: every path quiet and busy, `rounds` times; prints one JSON line."
    from gradus.core import kernels
    from gradus.learn import random, train
    from gradus.lm import chat, decode, models
    from gradus.lm.sampling import GenerationConfig
    from gradus.jobs import shakespeare as S
    from gradus.transformer import gpt
    if before:                   # generate before this change: BLAS as the environment left it
        decode._blas_threads = lambda widths, n: contextlib.nullcontext()
    if small_product is not None: kernels.SMALL_PRODUCT = small_product   # another threshold
    m = chat.load(chat.model_path('smollm2'))
    text = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
            "was the age of foolishness, it was the epoch of belief, it was the epoch of "
            "incredulity, it was the season of Light, it was the season of Darkness")
    ids = np.array(m.tokenizer.encode(text, add_bos=m.tokenizer.add_bos), np.int64)
    assert ids.size >= 46, ids.size
    greedy = GenerationConfig(temperature=0, max_new_tokens=16, ignore_eos=True)
    widths = (m.config.dim, m.config.ffn_dim)

    def generate(n):
        cache = models.new_cache(m.config, n + 16)
        step = models.stepper(m.params, m.config, cache)
        gen = decode.generate(step, ids[:n], greedy, m.tokenizer, cache, widths=widths)
        for _ in gen: pass
        return {f'generate {n:2d}-token prompt: prefill': gen.prefill_s,
                f'generate {n:2d}-token prompt: decode / token': gen.decode_s / gen.n_steps}

    talk = chat.Chat(m, GenerationConfig(temperature=0, max_new_tokens=8, ignore_eos=True), 256)
    def chat_turn():
        talk.reset()
        t0 = time.perf_counter()
        for _ in talk.turn('Name three colours.'): pass
        return {'chat turn (8 tokens)': time.perf_counter() - t0}

    vocab = sorted(set(text))
    tiny = S.RunConfig(sample_len=500, n_layer=2, n_head=2, n_embd=64)
    tiny_state = train.init_state(gpt.init(random.key(0), S.model_config(tiny, len(vocab))),
                                  S.make_optimizer(tiny), random.key(1))
    def sample():
        t0 = time.perf_counter(); S.sample_text(tiny_state, tiny, vocab)
        return {'shakespeare sample (500 chars)': time.perf_counter() - t0}

    cfg = S.RunConfig()                                       # the default model, for training
    mcfg, opt = S.model_config(cfg, len(vocab)), S.make_optimizer(cfg)
    state = train.init_state(gpt.init(random.key(0), mcfg), opt, random.key(1))

    train_ids = np.random.default_rng(0).integers(0, len(vocab), 20_000)
    loss_fn, get_batch = S.make_loss_and_batches(cfg, mcfg, train_ids)
    steps = [state]
    def train_step():
        s = steps[0]
        t0 = time.perf_counter()
        s, _ = train.fit(loss_fn, s, opt, get_batch, s.step + 3, clip_norm=cfg.grad_clip,
                         progress=False, in_axes=(0, 0, None))
        steps[0] = s
        return {'training step': (time.perf_counter() - t0) / 3}

    paths = [lambda: generate(5), lambda: generate(46), chat_turn, sample, train_step]
    for p in paths: p()                                        # warm up: compile, trace, cache
    times = {}
    for r in range(rounds):
        for busy in ((False, True) if r % 2 == 0 else (True, False)):
            with neighbour(busy):
                for p in paths:
                    for name, t in p().items():
                        times.setdefault(name, {0: [], 1: []})[busy].append(t)
    print(json.dumps({name: [float(np.median(v[0])), float(np.median(v[1]))]
                      for name, v in times.items()}))


def run_worker(env_value, rounds, before, small_product=None):
    env = dict(os.environ)
    env.pop('OPENBLAS_NUM_THREADS', None)
    if env_value != 'unset': env['OPENBLAS_NUM_THREADS'] = env_value
    cmd = [sys.executable, __file__, '--worker', '--rounds', str(rounds)] + \
          (['--before'] if before else []) + \
          ([] if small_product is None else ['--small-product', str(small_product)])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0: raise SystemExit(f"worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def fmt(seconds):
    return f"{seconds * 1e3:9.1f} ms" if seconds < 10 else f"{seconds:9.2f} s "


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--envs', nargs='+', default=['unset', '2'],
                    help="values of OPENBLAS_NUM_THREADS, one process each ('unset': none)")
    ap.add_argument('--before', action='store_true',
                    help='BLAS threads as the environment leaves them (gradus before this change)')
    ap.add_argument('--small-product', type=int, default=None,
                    help='run with this kernels.SMALL_PRODUCT (multiply-adds) instead')
    ap.add_argument('--products', action='store_true', help='the product sweep instead')
    ap.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker: return worker(a.rounds, a.before, a.small_product)
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} numpy={np.__version__} "
          f"| neighbour: one process spinning on one core")
    print("load before:", uptime())
    if a.products:
        products(a.rounds)
    else:
        label = ' (as before blas_threads_for)' if a.before else \
            f' (SMALL_PRODUCT {a.small_product:,})' if a.small_product is not None else ''
        print(f"{'path':44s} {'OPENBLAS_NUM_THREADS':>20s} {'quiet':>12s} {'busy':>12s} "
              f"{'busy/quiet':>10s}{label}")
        results = {e: run_worker(e, a.rounds, a.before, a.small_product) for e in a.envs}
        for name in results[a.envs[0]]:
            for e in a.envs:
                quiet, busy = results[e][name]
                print(f"{name:44s} {e:>20s} {fmt(quiet)} {fmt(busy)} {busy / quiet:9.2f}x")
        worst = max(b / q for r in results.values() for q, b in r.values())
        print(f"largest busy/quiet ratio: {worst:.2f}x (aim: none above ~2x); rounds: {a.rounds}")
    print("load after: ", uptime())


if __name__ == '__main__':
    main()
