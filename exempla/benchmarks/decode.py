"""SmolLM2-135M (Q4_1) prefill and decode speed: gradus.lm.models against llama.cpp, in the same
run.

Prefill: tokens/s over a 512-token prompt (logits of the last position only, as llama.cpp
computes). Decode: tokens/s over 128 greedy tokens after a short prompt (end-of-generation ignored).
Both sides run 2 threads, alternate round by round, and report the median of the rounds. llama.cpp
is the `llama_cpp` package (llama-cpp-python) where importable; it is never a test dependency. Also
printed: the machine's memory read bandwidth (`qkernels.read_bandwidth`, a STREAM-style read of
256 MiB on the same 2 threads, best of 5), bytes of weights one decode token reads and the
bandwidth each side's rate implies, as a fraction of the measured one, the agreement of
the two sides' logits (max |Δ| and greedy tokens), and the peak resident memory of
`gradus generate` over 128 tokens (a separate process).
`--decode-only` alternates only the decode runs (`--tokens` each) and adds each side's best round,
the closest a shared machine gets to a quiet measurement.
Gemma 3 270M (Q4_K_M, the `gemma` extra) follows when installed (`--gemma-only`: only it): the same
rates through `models.stepper` (one-token steps on the fused engine; the general path,
models.forward, `fused=False`, beside it), llama.cpp on the same file, and the share of a decode
token that is the 262,144 x 640 output head (bytes, and time: the engine with no layers, which
the SmolLM2 section also prints), and the peak RSS of `gradus generate` for it (no chat template:
plain text). Prefill runs its products on numpy's BLAS, whose kernel set is printed (OpenBLAS
chooses it by CPU; `OPENBLAS_CORETYPE` overrides it, and is printed where the environment sets
it). numba's threading layer is the commands' (`gradus.lm.chat`): 'workqueue' unless
NUMBA_THREADING_LAYER names another.
`--contexts` alternates only decode rounds of 32 tokens after 128 and after 1,024 tokens of
context (prefilled first, not timed), where the attention over the KV cache grows.
Usage: python exempla/benchmarks/decode.py [--rounds 3] [--decode-only --tokens 32]
                                            [--gemma-only] [--contexts]
"""

import os

os.environ.setdefault('OPENBLAS_NUM_THREADS', '2')
os.environ.setdefault('NUMBA_NUM_THREADS', '2')
os.environ.setdefault('NUMBA_THREADING_LAYER', 'workqueue')   # as `gradus generate` chooses
import argparse, platform, subprocess, sys, time
import numpy as np
import numba
from gradus.lm import models, qkernels
from gradus.formats import gguf as G, tokenizer as TK

THREADS, N_PROMPT, N_DECODE = 2, 512, 128
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair. "
)


def blas_kernels():
    "The BLAS numpy calls and the kernel set it chose for this CPU (threadpoolctl's report)."
    from threadpoolctl import threadpool_info
    seen = dict.fromkeys(f"{i['internal_api']} {i.get('architecture', '?')} kernels"
                         for i in threadpool_info() if i['user_api'] == 'blas')
    pinned = os.environ.get('OPENBLAS_CORETYPE')      # a machine's environment may pin the set
    return (', '.join(seen) or 'BLAS: ?') + (f" (OPENBLAS_CORETYPE={pinned} in the environment)"
                                             if pinned else '')


def load():
    return open('/proc/loadavg').read().split()[:3] if os.path.exists('/proc/loadavg') else '?'


def gradus_prefill(params, config, ids):
    cache = models.new_cache(config, len(ids) + 1)
    t0 = time.perf_counter()
    z = models.forward(params, ids, config, cache, 0, last_only=True)[0]
    return time.perf_counter() - t0, z


def gradus_decode(params, config, ids, exact=False):
    cache = models.new_cache(config, len(ids) + N_DECODE + 1)
    step = models.stepper(params, config, cache, exact, fused=True)
    z, out = step(ids, 0), []
    t0 = time.perf_counter()
    for i in range(N_DECODE):
        out.append(int(np.argmax(z)))
        z = step([out[-1]], len(ids) + i)
    return time.perf_counter() - t0, out


def llama_logits(llm):
    "The last evaluated position's logits (llama-cpp-python keeps `scores` only with logits_all)."
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


def llama_prefill(llm, ids):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(list(map(int, ids)))
    dt = time.perf_counter() - t0
    return dt, llama_logits(llm)


def llama_decode(llm, ids):
    llm.reset()
    llm.eval(list(map(int, ids)))
    z, out = llama_logits(llm), []
    t0 = time.perf_counter()
    for _ in range(N_DECODE):
        out.append(int(np.argmax(z)))
        llm.eval([out[-1]])
        z = llama_logits(llm)
    return time.perf_counter() - t0, out


def weight_bytes(params):
    "Bytes of weights one decode token reads: every layer matrix, the norms and the output head."
    layer = sum(
        w.blocks.nbytes if isinstance(w, models.QTensor) else w.nbytes
        for lp in params['layers']
        for w in lp.values()
    )
    return layer + params['norm'].nbytes + params['output'].blocks.nbytes


def head_ms(params, config, n=16):
    """Milliseconds a token of the fused engine with no layers (the embedding row, the final norm
    and the output head), the median of `n` steps: the head's time inside the engine."""
    from gradus.lm import engine
    p, c = {**params, 'layers': []}, config._replace(n_layers=0, windows=(), rope_bases=())
    ws, cache, ts = engine.workspace(p, c, n + 1), models.new_cache(c, n + 1), []
    engine.decode_step(p, c, cache, 1, 0, ws)
    for pos in range(1, n + 1):
        t0 = time.perf_counter()
        engine.decode_step(p, c, cache, 100 + pos, pos, ws)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def peak_rss_generate(path, chat=True):
    """Peak RSS (MiB) and last line of `python -m gradus generate` over 128 greedy tokens, in a
    child under GNU time (`%M`): the child's own peak, not this process's pages copied at fork.
    `chat=False` for a GGUF without a chat template (Gemma 3 270M): the prompt as plain text."""
    cmd = ['/usr/bin/time', '-f', 'maxrss_kib %M', 
        sys.executable,
        '-m',
        'gradus',
        'generate',
        'Tell me a story about a lighthouse.',
        *(['--chat'] if chat else []),
        '--gguf',
        str(path),
        '--max-new-tokens',
        str(N_DECODE),
        '--temperature',
        '0',
        '--ignore-eos',
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, 'NUMBA_NUM_THREADS': '2'}
    )
    tail = r.stderr.rsplit('maxrss_kib', 1)
    peak = float(tail[1].split()[0]) / 1024 if len(tail) == 2 else float('nan')
    return peak, (r.stdout.strip().splitlines() or ['?'])[-1], r.returncode


BW = None  # GB/s, measured once in main


def of_bw(gbs):
    "A rate in GB/s as a fraction of the measured read bandwidth."
    return f"{gbs:.2f} GB/s ({gbs / BW:.0%} of the read bandwidth)" if BW else f"{gbs:.2f} GB/s"


def gemma(rounds):
    "Gemma 3 270M beside SmolLM2: prefill and decode rates, llama.cpp on the same file, the head."
    try:
        path = G.gemma3_path()
    except FileNotFoundError as e:
        return print(f"Gemma 3: skipped ({e})")
    params, config = models.from_gguf(path)
    tok = TK.from_gguf(G.open_gguf(path))
    ids = np.array(tok.encode(TEXT * 8)[:N_PROMPT])
    short = np.array(tok.encode("Tell me a story about a lighthouse."))

    def g_prefill():
        cache = models.new_cache(config, len(ids) + 1)
        t0 = time.perf_counter()
        models.forward(params, ids, config, cache, 0, last_only=True)
        return time.perf_counter() - t0

    def g_decode(fused=True):
        step = models.stepper(params, config, models.new_cache(config, len(short) + N_DECODE + 1),
                              fused=fused)
        z, t0 = step(short, 0), time.perf_counter()
        for i in range(N_DECODE):
            z = step([int(np.argmax(z))], len(short) + i)
        return time.perf_counter() - t0

    try:
        import llama_cpp
        llm = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_threads=THREADS,
                              n_threads_batch=THREADS, verbose=False)
    except ImportError:
        llm = None
    g_decode()                                                     # warm the kernels
    res = {k: [] for k in ('g_pre', 'l_pre', 'g_dec', 'g_gen', 'l_dec')}
    for _ in range(rounds):
        res['g_pre'].append(g_prefill())
        res['g_dec'].append(g_decode())
        res['g_gen'].append(g_decode(fused=False))
        if llm:
            res['l_pre'].append(llama_prefill(llm, ids)[0])
            res['l_dec'].append(llama_decode(llm, short)[0])
    med = {k: float(np.median(v)) for k, v in res.items() if v}
    pre, dec = N_PROMPT / med['g_pre'], N_DECODE / med['g_dec']
    line = f"Gemma 3 270M: prefill {N_PROMPT} tokens gradus {pre:7.1f} tok/s"
    if llm:
        line += (f" | llama.cpp {N_PROMPT / med['l_pre']:7.1f} tok/s"
                 f" | ratio {pre * med['l_pre'] / N_PROMPT:.2f}x")
    print(line)
    line = (f"Gemma 3 270M: decode {N_DECODE} tokens gradus {dec:7.1f} tok/s (fused engine; "
            f"models.forward {N_DECODE / med['g_gen']:.1f} tok/s)")
    if llm:
        line += (f" | llama.cpp {N_DECODE / med['l_dec']:7.1f} tok/s"
                 f" | ratio {dec * med['l_dec'] / N_DECODE:.2f}x")
    print(line)
    head = params['output']
    th = [head_ms(params, config) for _ in range(3)]
    wb = weight_bytes(params)
    line = f"Gemma 3 270M: the bandwidth a decode token implies: gradus {of_bw(wb * dec / 1e9)}"
    if llm:
        line += f", llama.cpp {of_bw(wb * N_DECODE / med['l_dec'] / 1e9)}"
    print(line)
    print(f"Gemma 3 270M: weights read per decode token {wb / 2**20:.1f} MiB, of which the output "
          f"head {head.blocks.nbytes / 2**20:.1f} MiB ({head.blocks.nbytes / wb:.0%}); the head "
          f"alone (the engine with no layers) "
          f"{np.median(th):.1f} ms ({head.blocks.nbytes / np.median(th) / 1e6:.1f} GB/s) of a "
          f"{med['g_dec'] / N_DECODE * 1e3:.1f} ms token "
          f"({np.median(th) / 1e3 / (med['g_dec'] / N_DECODE):.0%}); load after: {load()}")
    peak, last, rc = peak_rss_generate(path, chat=False)
    print(f"Gemma 3 270M: gradus generate, {N_DECODE} tokens: peak RSS {peak:.0f} MiB (exit {rc}); "
          f"its last line: {last}")


def decode_only(params, config, llm, short, rounds):
    "Alternate decode rounds only; medians and best rounds of both sides."
    g, l = [], []
    for _ in range(rounds):
        g.append(N_DECODE / gradus_decode(params, config, short)[0])
        if llm:
            l.append(N_DECODE / llama_decode(llm, short)[0])
    for name, v in (('gradus', g), ('llama.cpp', l)):
        if v:
            print(f"decode {N_DECODE} tokens, {rounds} rounds: {name:9s} median "
                  f"{np.median(v):6.1f} tok/s, best round {max(v):6.1f} tok/s")
    if l:
        print(f"ratio of medians {np.median(g) / np.median(l):.2f}, of best rounds "
              f"{max(g) / max(l):.2f}; load after: {load()}")


def decode_after(step_fn, prompt, n):
    "Seconds for `n` greedy tokens after `prompt` (prefilled first, not timed), `step_fn` a side."
    z = step_fn(prompt, 0)
    t0 = time.perf_counter()
    for i in range(n):
        z = step_fn([int(np.argmax(z))], len(prompt) + i)
    return time.perf_counter() - t0


def contexts(params, config, llm, tok, rounds, n=32):
    """Decode rates after 128 and after 1,024 tokens of context (the attention over the KV cache
    grows with it), both sides alternating, medians of `rounds`."""
    long = np.array((tok.encode(TEXT) * 16)[:1024])

    def gradus_side(prompt):
        cache = models.new_cache(config, len(prompt) + n + 1)
        step = models.stepper(params, config, cache, False, fused=True)
        return decode_after(lambda t, pos: step(np.asarray(t), pos), prompt, n)

    def llama_side(prompt):
        llm.reset()

        def step(t, pos):
            llm.eval(list(map(int, t)))
            return llama_logits(llm)
        return decode_after(step, prompt, n)

    for ctx in (128, 1024):
        g, l = [], []
        for _ in range(rounds):
            g.append(n / gradus_side(long[:ctx]))
            if llm:
                l.append(n / llama_side(long[:ctx]))
        line = (f"decode {n} tokens after {ctx:4d} tokens of context: gradus "
                f"{np.median(g):6.1f} tok/s")
        if l:
            line += (f" | llama.cpp {np.median(l):6.1f} tok/s | ratio "
                     f"{np.median(g) / np.median(l):.2f}x")
        print(f"{line} ({rounds} rounds, medians; load {load()})")


def main():
    global N_DECODE, BW
    ap = argparse.ArgumentParser()
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--decode-only', action='store_true')
    ap.add_argument('--tokens', type=int, default=N_DECODE, help='decode tokens a round')
    ap.add_argument('--gemma-only', action='store_true', help='only the Gemma 3 270M section')
    ap.add_argument('--contexts', action='store_true',
                    help='only SmolLM2 decode after 128 and 1,024 tokens of context')
    args = ap.parse_args()
    N_DECODE = args.tokens
    numba.set_num_threads(THREADS)
    BW = qkernels.read_bandwidth()
    print(f"memory read bandwidth (STREAM-style, 256 MiB, {THREADS} threads, best of 5): "
          f"{BW:.1f} GB/s; prefill's products: {blas_kernels()}")
    if args.gemma_only:
        print(f"load (1/5/15 min) before: {load()}")
        return gemma(args.rounds)
    path = G.smollm2_path()
    params, config = models.from_gguf(path)
    tok = TK.from_gguf(G.open_gguf(path))
    ids = np.array((tok.encode(TEXT) * 8)[:N_PROMPT])
    short = np.array(
        tok.encode(
            tok.apply_chat_template([{'role': 'user', 'content': 'Tell me a story.'}]),
            parse_special=True,
        )
    )
    try:
        import llama_cpp

        llm = llama_cpp.Llama(
            str(path),
            n_ctx=2048 if args.contexts else 1024,
            n_batch=512,
            n_threads=THREADS,
            n_threads_batch=THREADS,
            verbose=False,
        )
        llama_name = f"llama.cpp via llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        llm, llama_name = None, 'llama.cpp: not importable (pip install llama-cpp-python)'
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
        f"numba threads={numba.get_num_threads()} numpy={np.__version__} ({blas_kernels()}) | "
        f"{llama_name}"
    )
    print(f"load (1/5/15 min) before: {load()}")
    gradus_prefill(params, config, ids[:16])
    gradus_decode(params, config, short[:4])  # compile / warm
    print(f"numba threading layer: {numba.threading_layer()} (one parallel region per token)")
    if args.decode_only:
        return decode_only(params, config, llm, short, args.rounds)
    if args.contexts:
        return contexts(params, config, llm, tok, args.rounds)
    res = {k: [] for k in ('g_pre', 'l_pre', 'g_dec', 'g_dec_exact', 'l_dec')}
    for r in range(args.rounds):
        res['g_pre'].append(gradus_prefill(params, config, ids)[0])
        if llm:
            res['l_pre'].append(llama_prefill(llm, ids)[0])
        res['g_dec'].append(gradus_decode(params, config, short)[0])
        if llm:
            res['l_dec'].append(llama_decode(llm, short)[0])
        if r == 0:
            res['g_dec_exact'].append(gradus_decode(params, config, short, exact=True)[0])
    med = {k: float(np.median(v)) for k, v in res.items() if v}
    pre, dec = N_PROMPT / med['g_pre'], N_DECODE / med['g_dec']
    print(f"prefill {N_PROMPT} tokens: gradus {pre:8.1f} tok/s", end='')
    if llm:
        print(
            f" | llama.cpp {N_PROMPT / med['l_pre']:8.1f} tok/s"
            f" | ratio {pre / (N_PROMPT / med['l_pre']):.2f}x",
            end='',
        )
    print(
        f"\ndecode {N_DECODE} tokens:  gradus {dec:8.1f} tok/s (int8 activations; exact float mode "
        f"{N_DECODE / med['g_dec_exact']:.1f} tok/s)",
        end='',
    )
    if llm:
        print(
            f" | llama.cpp {N_DECODE / med['l_dec']:8.1f} tok/s"
            f" | ratio {dec / (N_DECODE / med['l_dec']):.2f}x",
            end='',
        )
    wb = weight_bytes(params)
    print(
        f"\nweights read per decode token: {wb / 2**20:.1f} MiB -> gradus "
        f"{of_bw(wb * dec / 1e9)}",
        end='',
    )
    if llm:
        print(f", llama.cpp {of_bw(wb * N_DECODE / med['l_dec'] / 1e9)}", end='')
    hm = float(np.median([head_ms(params, config) for _ in range(3)]))
    print(f"\nthe output head ({params['output'].blocks.nbytes / 2**20:.1f} MiB) in the engine: "
          f"{hm:.2f} ms a token ({of_bw(params['output'].blocks.nbytes / hm / 1e6)}) of "
          f"{med['g_dec'] / N_DECODE * 1e3:.2f} ms", end='')
    print(f"\nrounds: {args.rounds} (median); load after: {load()}")
    if llm:
        zg, zl = gradus_prefill(params, config, ids)[1], llama_prefill(llm, ids)[1]
        tg, tl = gradus_decode(params, config, short)[1], llama_decode(llm, short)[1]
        same = next((i for i, (a, b) in enumerate(zip(tg, tl)) if a != b), len(tg))
        print(
            f"agreement: last-position logits max |Δ| {np.abs(zg - zl).max():.3f} (top token "
            f"{'same' if zg.argmax() == zl.argmax() else 'differs'}); greedy tokens identical "
            f"for the "
            f"first {same} of {N_DECODE}"
        )
    peak, last, rc = peak_rss_generate(path)
    print(
        f"gradus generate, {N_DECODE} tokens: peak RSS {peak:.0f} MiB (exit {rc}); "
        f"its last line: {last}"
    )
    gemma(args.rounds)


if __name__ == '__main__':
    main()
