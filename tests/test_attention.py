"""Attention against references written separately from gradus: masks and attention as plain loops,
RoPE in both pairing conventions from their textbook formulas, grouped-query attention with the head
mapping spelled out, and the transformer block as plain numpy. No reference shares code with
gradus.transformer.attention."""
import math
import numpy as np
import pytest
from gradus.transformer import attention as A
from gradus.learn import random
from gradus.errors import ShapeError

RNG = np.random.default_rng(1234)


# ---------- masks ----------
def mask_loop(t_q, t_k, window=None):
    "Query i sits at absolute position (t_k - t_q) + i (the queries are the last t_q positions)."
    m = np.zeros((t_q, t_k), bool)
    for i in range(t_q):
        p = t_k - t_q + i
        for j in range(t_k):
            m[i, j] = j <= p and (window is None or p - j < window)
    return m


@pytest.mark.parametrize('t_q,t_k,window', [(5, 5, None), (1, 7, None), (3, 8, None), (6, 6, 2),
                                            (2, 9, 3), (4, 4, 1), (1, 1, None)])
def test_causal_mask_matches_loop(t_q, t_k, window):
    assert np.array_equal(A.causal_mask(t_q, t_k, window=window), mask_loop(t_q, t_k, window))


def test_last_query_of_a_cache_sees_every_key():
    "Decoding one token after 6 cached ones: its row must see all 7 keys (bottom-right alignment)."
    assert A.causal_mask(1, 7).all()


# ---------- scaled dot-product attention ----------
def sdpa_loop(q, k, v, mask=None):
    "(t_q, d), (t_k, d), (t_k, d_v) -> (t_q, d_v), one query at a time, float64."
    out = np.zeros((q.shape[0], v.shape[1]))
    for i in range(q.shape[0]):
        s = np.array([q[i] @ k[j] for j in range(k.shape[0])]) / math.sqrt(q.shape[1])
        if mask is not None: s = np.where(mask[i], s, -np.inf)
        w = np.exp(s - s.max()); w /= w.sum()
        out[i] = sum(w[j] * v[j] for j in range(k.shape[0]))
    return out


@pytest.mark.parametrize('t_q,t_k', [(4, 4), (2, 6), (1, 5)])
def test_sdpa_matches_loop(t_q, t_k):
    q, k, v = (RNG.standard_normal(s) for s in ((t_q, 8), (t_k, 8), (t_k, 3)))
    for mask in (None, mask_loop(t_q, t_k), mask_loop(t_q, t_k, window=2)):
        got = A.scaled_dot_product_attention(q, k, v, mask)
        np.testing.assert_allclose(got, sdpa_loop(q, k, v, mask), rtol=1e-12, atol=1e-13)


def test_sdpa_batch_axes_are_independent():
    q, k, v = (RNG.standard_normal(s) for s in ((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)))
    got = A.scaled_dot_product_attention(q, k, v, mask_loop(4, 6))
    for a in range(2):
        for b in range(3):
            want = sdpa_loop(q[a, b], k[a, b], v[a, b], mask_loop(4, 6))
            np.testing.assert_allclose(got[a, b], want, rtol=1e-12, atol=1e-13)


# ---------- RoPE in both pairings ----------
def theta(t, d, offset=0, base=10000.0):
    "Angle of pair i at position p: p * base^(-2i/d) (Su et al. 2021, eq. 15)."
    p = np.arange(offset, offset + t)[:, None]
    return p * base ** (-2.0 * np.arange(d // 2)[None, :] / d)


def rope_rotate_half(x, offset=0, base=10000.0):
    """The half-split pairing (GPT-NeoX, Hugging Face Llama): x*cos + rotate_half(x)*sin, pair i is
    (i, i + d/2)."""
    d = x.shape[-1]
    ang = np.concatenate([theta(x.shape[-2], d, offset, base)] * 2, axis=-1)
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def rope_adjacent_complex(x, offset=0, base=10000.0):
    """The adjacent pairing (the RoFormer paper, Meta's Llama code): pairs (2i, 2i+1) as complex
    numbers times e^(iθ)."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * theta(x.shape[-2], x.shape[-1], offset, base))
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize('offset', [0, 5])
def test_rope_half_split_matches_rotate_half_reference(offset):
    x = RNG.standard_normal((2, 6, 8))
    got = A.apply_rope(x, offset, interleaved=False)
    np.testing.assert_allclose(got, rope_rotate_half(x, offset), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize('offset', [0, 3])
def test_rope_interleaved_matches_complex_reference(offset):
    x = RNG.standard_normal((2, 6, 8))
    got = A.apply_rope(x, offset, interleaved=True)
    np.testing.assert_allclose(got, rope_adjacent_complex(x, offset), rtol=1e-12, atol=1e-13)


def test_rope_default_pairing_is_half_split():
    "The default pairing is the half-split one; the two conventions differ on the same input."
    x = RNG.standard_normal((5, 8))
    np.testing.assert_allclose(A.apply_rope(x, 2), rope_rotate_half(x, 2), rtol=1e-12, atol=1e-13)
    assert np.abs(rope_rotate_half(x, 2) - rope_adjacent_complex(x, 2)).max() > 1e-2


def test_rope_base_is_used():
    x = RNG.standard_normal((4, 8))
    np.testing.assert_allclose(A.apply_rope(x, 1, base=100.0), rope_rotate_half(x, 1, base=100.0),
                               rtol=1e-12, atol=1e-13)


# ---------- multi-head and grouped-query attention ----------
def mha_loop(p, x, n_heads, n_kv, mask, rope=False):
    """x (t, dim) -> (t, dim). Query head h reads key/value head h // (n_heads // n_kv): each KV
    head is repeated for a contiguous group of query heads, not tiled."""
    lin = lambda l, z: z @ l['w'] + l['b']
    q, k, v = lin(p['wq'], x), lin(p['wk'], x), lin(p['wv'], x)
    hd = q.shape[1] // n_heads
    outs = []
    for h in range(n_heads):
        g = h // (n_heads // n_kv)
        qh, kh, vh = q[:, h * hd:(h + 1) * hd], k[:, g * hd:(g + 1) * hd], v[:, g * hd:(g + 1) * hd]
        if rope: qh, kh = rope_rotate_half(qh), rope_rotate_half(kh)
        outs.append(sdpa_loop(qh, kh, vh, mask))
    return lin(p['wo'], np.concatenate(outs, axis=1))


def f64(tree):
    if isinstance(tree, dict): return {k: f64(v) for k, v in tree.items()}
    noise = 0.1 * RNG.standard_normal(np.shape(tree))   # no zero biases, no identical heads
    return np.asarray(tree, np.float64) + noise


@pytest.mark.parametrize('n_heads,n_kv,rope', [(4, 4, False), (4, 2, False), (4, 1, True),
                                               (6, 2, True)])
def test_multi_head_attention_matches_loop(n_heads, n_kv, rope):
    dim, t = 24, 5
    p = f64(A.attention_init(random.key(0), dim, n_heads, n_kv, dtype=np.float64))
    x = RNG.standard_normal((2, t, dim))
    got = A.multi_head_attention(p, x, n_heads, n_kv, mask=A.causal_mask(t), rope=rope)
    for b in range(2):
        np.testing.assert_allclose(got[b], mha_loop(p, x[b], n_heads, n_kv, mask_loop(t, t), rope),
                                   rtol=1e-10, atol=1e-12)



def test_kv_hook_gets_the_new_rows_and_its_keys_are_attended():
    """The hook receives the keys and values of the new positions only (after RoPE), and the
    queries attend to what it returns under its mask: a hook that prepends the rows of earlier
    positions gives the last rows of the whole sequence at once; a mask besides the hook is
    refused."""
    dim, n_heads, n_kv, t = 24, 4, 2, 6
    p = f64(A.attention_init(random.key(1), dim, n_heads, n_kv, dtype=np.float64))
    x = RNG.standard_normal((2, t, dim))
    whole = A.multi_head_attention(p, x, n_heads, n_kv, mask=A.causal_mask(t), rope=True)
    seen = []
    past = {}
    def kv(k, v):
        seen.append(k.shape)
        if past: k, v = np.concatenate([past['k'], k], -2), np.concatenate([past['v'], v], -2)
        past['k'], past['v'] = k, v
        return k, v, A.causal_mask(seen[-1][-2], k.shape[-2])
    A.multi_head_attention(p, x[:, :4], n_heads, n_kv, rope=True, kv=kv)
    last = A.multi_head_attention(p, x[:, 4:], n_heads, n_kv, rope=True, offset=4, kv=kv)
    assert seen == [(2, n_kv, 1, 4, dim // n_heads), (2, n_kv, 1, 2, dim // n_heads)]
    np.testing.assert_allclose(last, whole[:, 4:], rtol=1e-10, atol=1e-12)
    with pytest.raises(ShapeError, match='kv hook'):
        A.multi_head_attention(p, x, n_heads, n_kv, mask=A.causal_mask(t), kv=kv)

# ---------- the pre-LN transformer block ----------
def layer_norm_ref(x, scale, bias, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def gelu_tanh_ref(x):
    "Hendrycks & Gimpel 2016, the tanh approximation with its published constant 0.044715."
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def test_transformer_block_matches_reference():
    dim, n_heads, t = 16, 4, 6
    p = f64(A.block_init(random.key(3), dim, n_heads, dtype=np.float64))
    x = RNG.standard_normal((1, t, dim))
    got = A.transformer_block(p, x, n_heads, mask=A.causal_mask(t))[0]
    ln1, ln2, m = p['ln1'], p['ln2'], p['mlp']
    a = mha_loop(p['attn'], layer_norm_ref(x[0], ln1['scale'], ln1['bias']), n_heads, n_heads,
                 mask_loop(t, t))
    h = x[0] + a
    ff = gelu_tanh_ref(layer_norm_ref(h, ln2['scale'], ln2['bias']) @ m['fc']['w'] + m['fc']['b'])
    want = h + ff @ m['proj']['w'] + m['proj']['b']
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
