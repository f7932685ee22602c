"""The memory estimate of `gradus generate` and `gradus chat` (`gradus.lm.chat.memory_estimate`,
`prefill_bytes`) against what runs allocate.

Two measurements: the arrays one prefill allocates (tracemalloc, in this process), and the peak of
the real command in a fresh process (its high-water resident memory after the run minus before it),
for two prompt lengths. The peak is read from `/proc/self/status` (`VmHWM`), the counter that
`ru_maxrss` reports but of this process image alone: `ru_maxrss` keeps across `fork` and `exec` the
figure of the parent (pytest, holding models), which would hide the child's own. The model is a GGUF
file written here, a Llama of random Q8_0 blocks with a byte-level tokenizer, shaped so that the
terms the estimate counts are large and cheap to run: 16 heads of 16 features make the prefill's
`(heads, T, T)` scores 0.1-0.5 GiB in a few seconds. SmolLM2's figures (2,000 and 5,000 tokens,
minutes of prefill) are stored in nbs/lm/27_chat.ipynb.
"""

import json
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import _gguf_build as B
from gradus.formats import gguf
from gradus.lm import chat, models

FACTOR = 1.25   # estimate / measured stays within [1 / FACTOR, FACTOR]


def _bytes_to_unicode():
    "GPT-2's reversible map of the 256 bytes to printable characters (Radford et al. 2019)."
    keep = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
            *range(ord('®'), ord('ÿ') + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _q8_0(rng, rows, cols, scale=0.02):
    "Random Q8_0 blocks `(rows, cols)`: an f16 scale then 32 int8 per block; |w| <= scale."
    nb = rows * cols // 32
    d = np.full(nb, scale / 127, np.float16).view(np.uint8).reshape(nb, 2)
    q = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, q], 1).tobytes()


def tiny_llama(path, dim=256, heads=16, kv=4, ffn=512, layers=2, ctx=8192, seed=0):
    "A Llama GGUF of random Q8_0 matrices and a byte-level BPE tokenizer (no merges), vocab 512."
    a, rng, hd, vocab = 'llama', np.random.default_rng(seed), dim // heads, 512
    tokens = _bytes_to_unicode() + [f'<x{i}>' for i in range(vocab - 256)]
    kvs = [B.kv_str('general.architecture', a), B.kv_u32(f'{a}.block_count', layers),
           B.kv_u32(f'{a}.embedding_length', dim), B.kv_u32(f'{a}.attention.head_count', heads),
           B.kv_u32(f'{a}.attention.head_count_kv', kv),
           B.kv_u32(f'{a}.feed_forward_length', ffn), B.kv_u32(f'{a}.context_length', ctx),
           B.s(f'{a}.attention.layer_norm_rms_epsilon') + struct.pack('<If', 6, 1e-5),
           B.kv_str('tokenizer.ggml.model', 'gpt2'), B.kv_str('tokenizer.ggml.pre', 'gpt2'),
           B.kv_str_array('tokenizer.ggml.tokens', tokens),
           B.kv_str_array('tokenizer.ggml.merges', [])]
    ones = np.ones(dim, np.float32).tobytes()
    t = [('token_embd.weight', [dim, vocab], 8, _q8_0(rng, vocab, dim)),
         ('output_norm.weight', [dim], 0, ones)]
    shapes = {'attn_q': (heads * hd, dim), 'attn_k': (kv * hd, dim), 'attn_v': (kv * hd, dim),
              'attn_output': (dim, heads * hd), 'ffn_gate': (ffn, dim), 'ffn_up': (ffn, dim),
              'ffn_down': (dim, ffn)}
    for i in range(layers):
        t += [(f'blk.{i}.{n}.weight', [c, r], 8, _q8_0(rng, r, c)) for n, (r, c) in shapes.items()]
        t += [(f'blk.{i}.attn_norm.weight', [dim], 0, ones),
              (f'blk.{i}.ffn_norm.weight', [dim], 0, ones)]
    path.write_bytes(B.build(kvs, t)[0])
    return path


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp('memory') / 'tiny.gguf')


def test_weight_bytes_are_what_loads(llama):
    g = gguf.open_gguf(llama)
    m = chat.load(llama)
    assert chat._loaded_bytes(m.params) == chat.weight_bytes(g) > 0
    assert m.tokenizer.encode('abab') == [ord('a'), ord('b')] * 2     # one byte, one token


@pytest.mark.parametrize('windows', [None, 64])
def test_prefill_bytes_against_tracemalloc(llama, windows):
    """One prefill of 768 tokens, global layers (`causal_softmax`) or sliding windows of 64 (the
    masked softmax): the arrays numpy allocates at their peak, traced, against `prefill_bytes`."""
    params, c = models.from_gguf(llama)
    if windows: c = c._replace(windows=(windows,) * c.n_layers)
    n, ids = 768, np.arange(768) % c.vocab_size
    for size in (8, n):                                  # the first call compiles the kernels
        cache = models.new_cache(c, size)
        step = models.stepper(params, c, cache, fused=False)
        tracemalloc.start()
        step(ids[:size], 0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    est = chat.prefill_bytes(c, n)
    assert 1 / FACTOR < est / peak < FACTOR, (windows, est, peak)
    assert chat.prefill_bytes(c, 2 * n) > 3.5 * est     # the scores: quadratic in the prompt


CHILD = """
import json, re, sys
from gradus.jobs.cli import main
peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024
before, rows = peak(), []
for n in map(int, sys.argv[2:]):
    status = main(['generate', 'ab' * (n // 2), '--gguf', sys.argv[1], '--max-new-tokens', '1',
                   '--temperature', '0', '--ignore-eos'])
    rows.append((n, status, peak() - before))
print('PEAKS', json.dumps(rows))
"""


def test_estimate_beside_the_measured_peak_of_gradus_generate(llama):
    """`gradus generate` in a fresh process on prompts of 1,024 and then 2,048 tokens: the peak
    resident memory above what the process held before the first run (interpreter and libraries)
    against `memory_estimate` for the same run, within `FACTOR` either way. The second run's peak
    includes what the first left resident (compiled kernels), as the estimate of each run does."""
    lengths = (1024, 2048)
    r = subprocess.run([sys.executable, '-c', CHILD, str(llama), *map(str, lengths)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.split('PEAKS ')[-1])
    g = gguf.open_gguf(llama)
    c, w = models.read_config(g), chat.weight_bytes(g)
    seen = []
    for n, status, measured in rows:
        est = chat.memory_estimate(c, w, n, n + 1)
        seen.append((n, est.total / 2**20, measured / 2**20))
        assert status == 0
    print('tokens, estimate MiB, measured MiB:', seen)
    assert all(1 / FACTOR < e / m < FACTOR for _, e, m in seen), seen
    assert seen[1][2] - seen[0][2] > 200, seen          # the T² term, measured: not vacuous
