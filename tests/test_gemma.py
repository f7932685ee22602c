"""Gemma 3 270M run by `gradus.lm.models` against an independent float32 numpy Gemma 3
(`_gemma_reference.py`, which reads the GGUF with the `gguf` package and shares no code with
gradus); each decision the file does not state, pinned.

Token ids come from `gradus.formats.tokenizer` (SentencePiece from the file's vocabulary,
`add_bos=True`);
the comparison does not depend on them, since both sides run the same ids.
"""

import math
import struct

import numpy as np
import pytest

import _gguf_build as B

from gradus.lm import decode, models
from gradus.formats import gguf as G, tokenizer as TK
from gradus.errors import FormatError
import _models
from _models import find

gguf = pytest.importorskip('gguf', reason="the independent reference reads GGUF with `gguf`")
import _gemma_reference as R  # noqa: E402  (after the skip: it imports gguf)

MODEL, needs_model = find(G.gemma3_path, 'Gemma 3')
pytestmark = pytest.mark.usefixtures('one_blas_thread')  # tests/conftest.py: speed only

N_NEW = 32
TOL = 1e-3


def _long_text():
    "About 550 tokens of plain sentences: past Gemma 3's 512-position window."
    colours = ['red', 'green', 'blue', 'yellow', 'white', 'black', 'grey', 'brown']
    animals = ['fox', 'horse', 'sparrow', 'cat', 'dog', 'owl', 'goat', 'heron', 'mole']
    places = ['river', 'barn', 'old mill', 'garden', 'church', 'bridge', 'market']
    return ' '.join(
        f"Note {i}: the {colours[i % 8]} {animals[i % 9]} rested by the {places[i % 7]}."
        for i in range(42)
    ) + " The animal in note 3 was the"


PROMPTS = {
    'english': "The capital of France is",
    'shakespeare': "Shall I compare thee to a summer's day?\nThou art more lovely and more",
    'code': "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    'digits_dates': "On 14/07/1789 at 09:30, 1234567 + 7654321 = 8888888; next: 2024-02-29 and",
    'non_ascii': "Ça ne fait rien — naïve café, Straße, 東京, Ελλάδα, and 🙂 emoji:",
    'whitespace': "x\n\n\n    y\t\t z      \n\n  \t",
    'long': _long_text(),
}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope='module')
def tok():
    return TK.from_gguf(G.open_gguf(MODEL))


@pytest.fixture(scope='module')
def ids(tok):
    enc = lambda t: np.array(tok.encode(t, parse_special=True, add_bos=True))
    return {k: enc(t) for k, t in PROMPTS.items()}


@pytest.fixture(scope='module')
def ref():
    return R.Gemma3(MODEL, _models.reader(MODEL))


@pytest.fixture(scope='module')
def ref_runs(ref, ids):
    "name -> the reference's (last-position logits, N_NEW greedy tokens), all prompts together."
    return dict(zip(PROMPTS, ref.run([ids[k] for k in PROMPTS], N_NEW)))


@pytest.fixture(scope='module')
def model():
    return models.from_gguf(MODEL)


@pytest.fixture(scope='module')
def runs(model, ids, ref_runs):
    """name -> gradus's (last-position logits (vocab,), its greedy choice after each prefix of the
    reference's continuation): through a KV cache, the prompt in one step (`models.stepper`), the
    reference's first N_NEW - 1 tokens in a second (all rows' logits)."""
    params, c = model
    out = {}
    for k in PROMPTS:
        cache = models.new_cache(c, len(ids[k]) + N_NEW)
        z = models.stepper(params, c, cache)(ids[k], 0)
        more = models.stepper(params, c, cache, all_logits=True)(ref_runs[k][1][:-1], len(ids[k]))
        out[k] = z, [int(np.argmax(z))] + np.argmax(more, axis=1).tolist()
    return out


# ---------------------------------------------------------------- the file and the decisions
@needs_model
def test_config_from_metadata(model, ref):
    _, c = model
    f = lambda k: R._field(ref.reader, f'gemma3.{k}')
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (
        f('block_count'), f('embedding_length'), f('attention.head_count'),
        f('attention.head_count_kv'), f('attention.key_length'), f('feed_forward_length'),
    ) == (18, 640, 4, 1, 256, 2048)
    assert c.rope_base == f('rope.freq_base') == 1e6 and c.tied_embeddings
    assert c.vocab_size == 262144 and c.architecture == 'gemma3'


@needs_model
def test_decisions_are_the_sourced_ones(model):
    """The values the file does not state, as the sources give them (see the reference's
    docstring): written here, not computed by gradus."""
    _, c = model
    assert [i for i, w in enumerate(c.windows) if w is None] == [5, 11, 17]  # pattern 6
    assert {w for w in c.windows if w is not None} == {512}
    assert [c.rope_bases[i] for i in (0, 4, 5, 6, 17)] == [1e4, 1e4, 1e6, 1e4, 1e6]
    assert c.embed_scale == math.sqrt(640) and c.query_scale == 256**-0.5
    assert c.activation == 'gelu_tanh' and not c.rope_interleaved
    assert c.qk_norm and c.sandwich_norms


@needs_model
def test_weights_stay_in_blocks(model):
    params, c = model
    mats = [w for lp in params['layers'] for w in lp.values() if isinstance(w, models.QTensor)]
    assert len(mats) == 7 * c.n_layers and all(w.blocks.dtype == np.uint8 for w in mats)
    assert {w.type.name for w in mats + [params['embed']]} == {'Q5_0', 'Q4_K', 'Q6_K', 'Q8_0'}
    assert params['output'] is params['embed']  # tied
    total = sum(w.blocks.nbytes for w in mats) + params['embed'].blocks.nbytes
    assert total < 300 * 2**20, total  # float32 would be 1.07 GB


# ---------------------------------------------------------------- against the reference
@needs_model
@pytest.mark.parametrize('name', list(PROMPTS))
def test_last_logits_match_reference(name, ref_runs, runs, ids):
    if name == 'long':
        assert len(ids[name]) > 540  # the local layers' 512-position window cuts the prompt
    got, want = runs[name][0], ref_runs[name][0]
    assert got.shape == want.shape == (262144,) and got.dtype == np.float32
    gap = np.abs(got - want).max()
    print(f"{name}: {len(ids[name])} tokens, max |Δlogit| {gap:.2e}")
    assert gap < TOL, gap


@needs_model
def test_known_answer(runs, ref_runs, tok):
    for z in (runs['english'][0], ref_runs['english'][0]):
        assert ' Paris' in [tok.decode([int(i)]) for i in np.argsort(-z)[:5]]


@needs_model
@pytest.mark.parametrize('name', list(PROMPTS))
def test_greedy_continuation_matches_reference(name, ref_runs, runs):
    """After each prefix of the reference's 32 greedy tokens, gradus's own greedy choice is the
    reference's next token; so gradus's greedy loop, whose one-token steps equal its chunked
    forward (`test_tiny_gemma_cached_decoding_equals_full_forward`, and the loop below), writes
    the same 32 tokens."""
    assert runs[name][1] == ref_runs[name][1]


@needs_model
@pytest.mark.parametrize('name', ['english', 'long'])
def test_generate_loop_matches_reference(model, ids, ref_runs, name):
    """`decode.generate` over `models.stepper` and a windowed KV cache: 32 greedy one-token steps
    on the fused engine (exact mode, `fused=True`: it must run Gemma 3's options), the reference's
    tokens; 'long' is past the local layers' 512-position window."""
    params, c = model
    cache = models.new_cache(c, len(ids[name]) + N_NEW)
    cfg = decode.GenerationConfig(max_new_tokens=N_NEW, temperature=0, ignore_eos=True)
    step = models.stepper(params, c, cache, exact=True, fused=True)
    gen = decode.generate(step, ids[name], cfg, None, cache)
    assert [e.token for e in gen] == ref_runs[name][1]


@needs_model
def test_fused_decode_parity(model, ids):
    """Prefill n then k fused one-token steps equals the full forward, as SmolLM2's step does
    (`test_llama.test_decode_parity`): exact mode to TOL; int8 activations (llama.cpp's scheme)
    past TOL but within 3."""
    params, c = model
    t = ids['shakespeare'][:24]
    full = lambda x: models.apply(params, x, c)
    step = lambda exact: models.stepper(params, c, models.new_cache(c, 32), exact, True, fused=True)
    exact = decode.decode_parity(step(True), full, t, 10)
    assert exact.max() < TOL, exact
    int8 = decode.decode_parity(step(False), full, t, 10)
    assert int8[:10].max() < TOL and TOL < int8[10:].max() < 3, int8


ALTERNATIVES = {  # what each decision would otherwise be
    'global layers first of six': dict(
        windows=tuple(None if i % 6 == 0 else 512 for i in range(18)),
        rope_bases=tuple(1e6 if i % 6 == 0 else 1e4 for i in range(18)),
    ),
    'local RoPE base = global 1e6': dict(rope_bases=(1e6,) * 18),
    'no embedding scale': dict(embed_scale=1.0),
    'bfloat16-rounded embedding scale (HF)': dict(embed_scale=25.25),
    'exact erf GELU': dict(activation='gelu'),
    'query scale 1/sqrt(dim/heads)': dict(query_scale=160**-0.5),
    'RoPE on adjacent pairs': dict(rope_interleaved=True),
}


@needs_model
@pytest.mark.parametrize('alt', list(ALTERNATIVES))
def test_each_decision_matters(alt, model, ids, ref_runs):
    "Each alternative moves the logits past the tolerance: the agreement above pins the decision."
    params, c = model
    z = models.forward(params, ids['shakespeare'], c._replace(**ALTERNATIVES[alt]), last_only=True)
    assert np.abs(z[0] - ref_runs['shakespeare'][0]).max() > 10 * TOL


@needs_model
def test_norm_gains_are_stored_with_the_one(model, ids, ref_runs):
    "Adding Gemma's `1 +` again (as if the converter had not) ruins the logits."
    params, c = model
    plus = lambda lp: {k: v + 1 if k.endswith('norm') else v for k, v in lp.items()}
    p1 = {**params, 'norm': params['norm'] + 1, 'layers': [plus(lp) for lp in params['layers']]}
    z = models.forward(p1, ids['english'], c, last_only=True)
    assert np.abs(z[0] - ref_runs['english'][0]).max() > 1.0


@needs_model
def test_sliding_window_matters(model, ids, ref_runs):
    "On the long prompt, every layer attending globally misses the reference."
    params, c = model
    z = models.forward(params, ids['long'], c._replace(windows=()), last_only=True)
    assert np.abs(z[0] - ref_runs['long'][0]).max() > 10 * TOL


# ---------------------------------------------------------------- a tiny Gemma, fast
def _f32(k, v): return B.s(k) + struct.pack('<If', 6, v)


def _q8_0(rng, rows, cols):
    "Q8_0 blocks of small random weights: f16 scale 1/256, int8 quants."
    n = rows * cols // 32
    d = np.full((n, 1), 1 / 256, np.float16).view(np.uint8)
    q = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, q], 1).tobytes()


def _tiny_gemma(path, n_layers=6, window=4, extra=()):
    "A Gemma 3 GGUF: dim 32, 2 query heads and 1 KV head of 16, FFN 64, vocab 96, window 4."
    rng = np.random.default_rng(7)
    dim, hd, ffn, vocab = 32, 16, 64, 96
    kvs = [B.kv_str('general.architecture', 'gemma3')] + [
        B.kv_u32(f'gemma3.{k}', v) for k, v in [
            ('block_count', n_layers), ('embedding_length', dim), ('feed_forward_length', ffn),
            ('attention.head_count', 2), ('attention.head_count_kv', 1),
            ('attention.key_length', hd), ('attention.value_length', hd),
            ('attention.sliding_window', window), ('context_length', 64)]
    ] + [_f32('gemma3.attention.layer_norm_rms_epsilon', 1e-6),
         _f32('gemma3.rope.freq_base', 1e6), *extra]
    mat = lambda n, rows, cols: (n, [cols, rows], 8, _q8_0(rng, rows, cols))
    vec = lambda n, k: (n, [k], 0, (1 + 0.3 * rng.standard_normal(k)).astype(np.float32).tobytes())
    ts = [mat('token_embd.weight', vocab, dim), vec('output_norm.weight', dim)]
    for i in range(n_layers):
        b = f'blk.{i}.'
        ts += [mat(b + 'attn_q.weight', 2 * hd, dim), mat(b + 'attn_k.weight', hd, dim),
               mat(b + 'attn_v.weight', hd, dim), mat(b + 'attn_output.weight', dim, 2 * hd),
               mat(b + 'ffn_gate.weight', ffn, dim), mat(b + 'ffn_up.weight', ffn, dim),
               mat(b + 'ffn_down.weight', dim, ffn)]
        ts += [vec(b + n + '.weight', k) for n, k in [
            ('attn_norm', dim), ('attn_q_norm', hd), ('attn_k_norm', hd),
            ('post_attention_norm', dim), ('ffn_norm', dim), ('post_ffw_norm', dim)]]
    path.write_bytes(B.build(kvs, ts)[0])
    return path


def test_tiny_gemma_matches_reference_at_every_position(tmp_path):
    "Six layers (layer 5 global), window 4, 14 tokens: the window cuts most rows of local layers."
    p = _tiny_gemma(tmp_path / 'tiny.gguf')
    params, c = models.from_gguf(p)
    assert [i for i, w in enumerate(c.windows) if w is None] == [5]
    t = np.random.default_rng(1).integers(0, 96, 14)
    ref = R.Gemma3(p)
    want = ref.logits(ref.hidden([(t, ref.new_state(), 0)])[0])
    got = models.apply(params, t, c)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    unwindowed = models.apply(params, t, c._replace(windows=()))
    assert np.abs(unwindowed - want)[6:].max() > 1e-2 * np.abs(want).max()


def test_tiny_gemma_cached_decoding_equals_full_forward(tmp_path):
    """Prefill 3, then 11 single steps (the fused engine's, exact mode) through a windowed KV
    cache: the full forward's logits."""
    params, c = models.from_gguf(_tiny_gemma(tmp_path / 'tiny.gguf'))
    t = np.random.default_rng(2).integers(0, 96, 14)
    cache = models.new_cache(c, 16)
    assert cache.windows == [4] * 5 + [None]
    gaps = decode.decode_parity(models.stepper(params, c, cache, True, all_logits=True),
                                lambda x: models.apply(params, x, c), t, 3)
    assert gaps.shape == (14,) and gaps.max() < 1e-4, gaps


def test_stepper_refuses_a_cache_without_the_windows(tmp_path):
    params, c = models.from_gguf(_tiny_gemma(tmp_path / 'tiny.gguf'))
    bare = decode.KVCache(c.n_layers, 16, c.n_kv_heads, c.head_dim)
    with pytest.raises(ValueError, match='windows'):
        models.stepper(params, c, bare)


@pytest.mark.parametrize('key', ['final_logit_softcapping', 'attn_logit_softcapping'])
def test_refuses_soft_capping(tmp_path, key):
    "Gemma 3 has no soft-capping; a gemma3 file asking for it is refused, not run without it."
    p = _tiny_gemma(tmp_path / 'capped.gguf', extra=[_f32(f'gemma3.{key}', 30.0)])
    with pytest.raises(FormatError, match=f'gemma3.{key}'):
        models.from_gguf(p)


def test_refuses_a_gemma_without_its_window(tmp_path):
    p = _tiny_gemma(tmp_path / 't.gguf')
    p.write_bytes(p.read_bytes().replace(b'attention.sliding_window', b'attention.sliding_xindow'))
    with pytest.raises(FormatError, match='sliding_window'):
        models.from_gguf(p)


def test_refuses_other_architectures_by_name(tmp_path):
    p = _tiny_gemma(tmp_path / 't.gguf')
    p.write_bytes(p.read_bytes().replace(b'gemma3', b'gemma9'))
    with pytest.raises(FormatError, match="architecture 'gemma9' is not supported"):
        models.from_gguf(p)


def test_engine_runs_tiny_gemma3(tmp_path):
    """The fused engine implements every Gemma 3 option (NEOX RoPE, head norms, sandwich norms,
    GeGLU, the embedding and query scales, per-layer windows and RoPE bases): a tiny random Gemma 3
    runs on it, its one-token steps equal to the full forward in exact mode."""
    from gradus.lm import engine
    params, c = models.from_gguf(_tiny_gemma(tmp_path / 'tiny.gguf'))
    assert engine.unsupported(params, c) == []
    t = np.array([1, 2, 3, 4])
    step = models.stepper(params, c, models.new_cache(c, 8), exact=True, all_logits=True,
                          fused=True)
    z = np.concatenate([step(t[:1], 0)] + [step(t[i:i + 1], i) for i in range(1, 4)])
    assert np.abs(z - models.apply(params, t, c)).max() < 1e-4
