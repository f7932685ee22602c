"""The frozen quantized linear (nbs/lm/31_qlinear): `qmatmul` and its VJP `qmatmul_t` against
finite differences in float64 and the `autograd` package on the dequantized matrix, for every block
type; the weights a constant of the graph (typed errors); row blocks that bound what is decoded;
`linear`, `head` and `embed` equal bit for bit on arrays to Part II's eager code (written out
again here), which 24_models now calls through them; and `models.forward` itself under
`gd.value_and_grad` on tiny Llama and Gemma 3 GGUFs built byte by byte and on SmolLM2; the
activation-memory formula against the traced graph."""
import math, struct
from pathlib import Path

import numpy as np
import pytest

import _gguf_build as B
import gradus as gd
from gradus.core import tensor as T
from gradus.core.autograd import _VJPEntry
from gradus.core.graph import Lit, Var, avals_of
from gradus.errors import ConfigError, DTypeError, FormatError, ShapeError, TracerError
from gradus.formats import gguf
from gradus.formats.quants import BLOCK, GGMLType, dequantize_ref, quantize
from gradus.formats.quants import MATVEC_TYPES
from gradus.learn import loss, nn, random
from gradus.lm.qkernels import qmatvec
from gradus.lm import models, qlinear
from gradus.lm.qlinear import Adapted, QTensor, qlinear as qlin

from _models import find

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')
BLOCK_TYPES = models.MATRIX_TYPES   # the types models runs: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q6_K


def matrix(t, rows, cols, k=0, std=0.1):
    "A matrix of type `t`: `quants.quantize` of a float matrix for Q8_0 and Q4_0, else random."
    if t in (GGMLType.Q8_0, GGMLType.Q4_0):
        w = std * random.rng(random.key(k)).standard_normal((rows, cols)).astype(np.float32)
        return QTensor(quantize(w, t).reshape(rows, -1), t, (rows, cols))
    return qlinear.random_qtensor(random.key(k), t, rows, cols, std=std)


def cols_of(t): return 256 if BLOCK[t][0] == 256 else 64


# ------------------------------------------------------------------ the primitive, proved
@pytest.mark.parametrize('t', qlinear.FROZEN_TYPES, ids=lambda t: t.name)
def test_gradient_of_x_finite_differences_and_autograd(t):
    """Orders 1 and 2 against central differences in float64 (row blocks of 2: split products, a
    partial last block), and the gradient against the `autograd` package on `dequantize_ref`'s
    matrix of the same blocks, to 1e-12."""
    autograd = pytest.importorskip('autograd')
    import autograd.numpy as anp
    cols = cols_of(t)
    w = matrix(t, 5, cols, k=int(t))
    x = random.rng(random.key(1)).standard_normal((3, cols))
    P = random.rng(random.key(2)).standard_normal((3, 5))
    assert gd.check_grads(lambda x: T.tanh(qlin(w, x, rows=2)), (x,), order=2) <= 1
    dense64 = dequantize_ref(w.blocks, t).reshape(5, cols).astype(np.float64)
    ref = autograd.grad(lambda x: anp.sum(anp.tanh(x @ dense64.T) * P))(x)
    ours = gd.grad(lambda x: T.sum(T.tanh(qlin(w, x, rows=2)) * P))(x)
    assert np.abs(ours - ref).max() <= 1e-12 * np.abs(ref).max()
    assert ours.dtype == np.float64


@pytest.mark.parametrize('t', [GGMLType.Q4_1, GGMLType.Q6_K], ids=lambda t: t.name)
def test_values_against_the_numpy_decoder(t):
    "float32 and float64 `x`, 2-D and batched 3-D, any row block: `x @ Wᵀ` and `y @ W`."
    cols = cols_of(t)
    w = matrix(t, 9, cols, k=3)
    wd = dequantize_ref(w.blocks, t).reshape(9, cols).astype(np.float64)
    for dt, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = random.rng(random.key(4)).standard_normal((2, 3, cols)).astype(dt)
        for rows in (1, 4, 9, 100):
            y = qlin(w, x, rows=rows)
            assert y.shape == (2, 3, 9) and y.dtype == dt
            assert np.abs(y - x @ wd.T).max() <= tol * np.abs(x @ wd.T).max()
            back = qlinear.qmatmul_t_p.bind(y, w.blocks, qtype=t.name, shape=w.shape, rows=rows)
            assert back.shape == (2, 3, cols) and back.dtype == dt
            assert np.abs(back - y @ wd).max() <= tol * np.abs(y @ wd).max()


def test_the_backward_is_generated_code_without_a_float_copy_of_w():
    """`show_code` names `qmatmul_t`; the compiled graph's array constants are the blocks (uint8)
    and nothing of `W`'s size in float."""
    w = matrix(GGMLType.Q4_K, 64, 256, k=5)
    f = gd.value_and_grad(lambda x: T.sum(T.tanh(qlin(w, x))))
    x = np.ones((3, 256), np.float32)
    assert 'qmatmul_t(' in gd.show_code(f, x) and 'qmatmul(' in gd.show_code(f, x)
    entry, _ = f.lower(x)
    consts = [v.value for e in entry.graph.eqns for v in e.ins if isinstance(v, Lit)]
    assert any(c is w.blocks for c in consts)
    assert all(c.dtype == np.uint8 or c.size < 64 * 256 for c in consts)


def test_weights_are_a_constant_typed_errors():
    """A gradient asked of the matrix: `DTypeError` before tracing (its blocks are uint8); the
    matrix passed traced, not differentiated: `TracerError` from `qlinear`."""
    for cls in (QTensor, models.QTensor):
        w = cls(matrix(GGMLType.Q8_0, 4, 64).blocks, GGMLType.Q8_0, (4, 64))
        x = np.ones((2, 64), np.float32)
        with pytest.raises(DTypeError, match=r"argument 0\[0\].*uint8"):
            gd.grad(lambda w, x: T.sum(qlin(w, x)))(w, x)
        with pytest.raises(TracerError, match="constant of the graph"):
            gd.grad(lambda x, w: T.sum(qlin(w, x)))(x, w)


def test_refusals_name_the_value():
    w = matrix(GGMLType.Q8_0, 4, 64)
    with pytest.raises(FormatError, match="Q2_K"):
        qlin(QTensor(np.zeros((4, 84), np.uint8), GGMLType.Q2_K, (4, 256)), np.ones((1, 256)))
    with pytest.raises(ShapeError, match=r"uint8\[4, 68\] are not a Q8_0 matrix of shape "
                                         r"\(4, 96\)"):
        qlin(QTensor(w.blocks, GGMLType.Q8_0, (4, 96)), np.ones((1, 96)))
    with pytest.raises(ShapeError, match=r"x \(2, 32\) does not end in 64"):
        qlin(w, np.ones((2, 32), np.float32))
    with pytest.raises(DTypeError, match="float32 or float64, got int64"):
        qlin(w, np.ones((2, 64), np.int64))
    with pytest.raises(TypeError, match="expected a matrix in GGML blocks"):
        qlin(np.ones((4, 64), np.float32), np.ones((2, 64), np.float32))
    with pytest.raises(ShapeError, match="not whole Q4_K blocks"):
        qlinear.random_qtensor(random.key(0), 'Q4_K', 2, 64)


def test_row_blocks_bound_what_is_decoded(monkeypatch):
    """Every decode, forward and backward, holds at most a row block: 16, 16, 8 rows for 40 rows in
    blocks of 16; by default at most `ROW_BLOCK_BYTES` of float32 (a 4096 × 1024 matrix: 2048
    rows a block)."""
    seen, plain = [], qlinear.decode_rows
    def watched(blocks, qtype, cols, r0, r1, dtype=np.float32):
        seen.append((r1 - r0, cols))
        return plain(blocks, qtype, cols, r0, r1, dtype)
    monkeypatch.setattr(qlinear, 'decode_rows', watched)
    w = matrix(GGMLType.Q4_K, 40, 256, k=6)
    gd.grad(lambda x: T.sum(T.tanh(qlin(w, x, rows=16))))(np.ones((3, 256), np.float32))
    assert [r for r, _ in seen] == [16, 16, 8, 16, 16, 8]
    seen.clear()
    big = QTensor(np.broadcast_to(np.zeros(1, np.uint8), (4096, 1024 // 32 * 34)), GGMLType.Q8_0,
                  (4096, 1024))
    gd.grad(lambda x: T.sum(qlin(big, x)))(np.ones((1, 1024), np.float32))
    assert [r for r, _ in seen] == [2048, 2048] * 2
    assert max(4 * r * c for r, c in seen) <= qlinear.ROW_BLOCK_BYTES


# ------------------------------------------------------------------ Part II's code, bit for bit
def part_ii_linear(w, x):
    "24_models' eager linear layer before it called `qlinear.linear`, written out again."
    if x.shape[0] == 1 and w.type in MATVEC_TYPES: return qmatvec(w.blocks, w.type, x[0])[None]
    return nn.linear({'w': qlinear.dense(w).T}, x)


def part_ii_head(w, x, chunk):
    "24_models' eager output head before it called `qlinear.head` (of normed states `x`)."
    if x.shape[0] == 1 and w.type in MATVEC_TYPES: return qmatvec(w.blocks, w.type, x[0])[None]
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for r0 in range(0, w.shape[0], chunk):
        r1 = min(w.shape[0], r0 + chunk)
        out[:, r0:r1] = x @ qlinear.dense(w, (r0, r1)).T
    return out


@pytest.mark.parametrize('t', BLOCK_TYPES, ids=lambda t: t.name)
def test_linear_on_arrays_is_part_ii_bit_for_bit(t):
    "`qlinear.linear` and `models._linear` (which calls it) equal Part II's eager code."
    w = matrix(t, 96, 256, k=7)
    for n in (1, 2, 7):
        x = random.rng(random.key(n)).standard_normal((n, 256)).astype(np.float32)
        want = part_ii_linear(w, x)
        assert np.array_equal(qlinear.linear(w, x), want)
        assert np.array_equal(models._linear(w, x), want)
        assert qlinear.linear(w, x).dtype == np.float32


def test_head_and_embed_on_arrays_are_models_bit_for_bit(monkeypatch):
    """The head over several row chunks (decoded a chunk at a time) and one row, the embedding and
    its refusal."""
    e = matrix(GGMLType.Q8_0, 200, 64, k=8)
    seen, plain = [], qlinear.dense
    monkeypatch.setattr(qlinear, 'dense', lambda w, rows=None: seen.append(rows) or plain(w, rows))
    params = {'embed': e, 'output': e, 'norm': np.linspace(0.5, 1.5, 64).astype(np.float32)}
    c = models.DecoderConfig(200, 64, 0, 2, 2, 32, 64, 1e4, 1e-5, 16, True)
    x = random.rng(random.key(9)).standard_normal((5, 64)).astype(np.float32)
    for chunk in (64, 8192):
        for rows in (x, x[:1]):
            normed = models._rms(params['norm'], rows, c)
            want = part_ii_head(e, normed, chunk)
            seen.clear()
            got = qlinear.head(e, normed, chunk)
            assert np.array_equal(got, want) and got.dtype == np.float32
            if chunk == 64 and len(rows) > 1:
                assert seen == [(0, 64), (64, 128), (128, 192), (192, 200)]
            assert np.array_equal(models._head(params, rows, c, chunk=chunk), want)
    ids = np.array([0, 199, 17, 17])
    want = dequantize_ref(e.blocks[ids], GGMLType.Q8_0).reshape(4, 64)
    assert np.array_equal(qlinear.embed(e, ids), want)
    assert np.array_equal(models.embed(params, ids), want)
    for bad, first in ((np.array([3, 200]), 200), (np.array([-1]), -1)):
        for f in (lambda t: qlinear.embed(e, t), lambda t: models.embed(params, t)):
            with pytest.raises(IndexError, match=rf"token id {first} outside \[0, 200\)"): f(bad)


def test_adapted_with_zero_b_is_its_base_bit_for_bit():
    w = matrix(GGMLType.Q4_1, 32, 64, k=10)
    a = random.rng(random.key(11)).standard_normal((4, 64)).astype(np.float32)
    ad = Adapted(w, a, np.zeros((32, 4), np.float32), 2.0)
    for n in (1, 5):
        x = random.rng(random.key(n)).standard_normal((n, 64)).astype(np.float32)
        assert np.array_equal(qlinear.linear(ad, x), qlinear.linear(w, x))


def test_traced_embedding_checks_its_ids_when_it_runs():
    e = matrix(GGMLType.Q8_0, 10, 64, k=12)
    f = gd.jit(lambda ids: T.sum(qlinear.embed(e, ids)))
    assert np.isclose(float(f(np.array([1, 2]))),
                      float(np.sum(models.dense(e)[[1, 2]])), rtol=1e-5)
    with pytest.raises(IndexError, match=r"token id 10 outside \[0, 10\)"):
        f(np.array([1, 10]))
    with pytest.raises(DTypeError, match="int32 or int64"):
        gd.jit(lambda ids: T.sum(qlinear.embed(e, ids)))(np.array([1.0, 2.0]))


# ------------------------------------------------------------------ models.forward, traced
def tiny_gguf(path, arch='llama', layers=2, dim=256, heads=4, kv=2, ffn=256, vocab=64, seed=0):
    """A GGUF of a `layers`-block Llama or Gemma 3 written byte by byte (`_gguf_build`), its
    matrices cycling through the seven block types, weights of standard deviation 0.5/√cols."""
    a, hd = arch, dim // heads
    kvs = [B.kv_str('general.architecture', a)] + [B.kv_u32(f'{a}.{k}', v) for k, v in [
        ('block_count', layers), ('embedding_length', dim), ('attention.head_count', heads),
        ('attention.head_count_kv', kv), ('feed_forward_length', ffn), ('context_length', 64)]]
    kvs.append(B.s(f'{a}.attention.layer_norm_rms_epsilon') + struct.pack('<If', 6, 1e-5))
    if a == 'gemma3': kvs.append(B.kv_u32('gemma3.attention.sliding_window', 4))
    mats, vecs = [('token_embd.weight', vocab, dim)], [('output_norm.weight', dim)]
    for i in range(layers):
        b = f'blk.{i}.'
        mats += [(b + 'attn_q.weight', heads * hd, dim), (b + 'attn_k.weight', kv * hd, dim),
                 (b + 'attn_v.weight', kv * hd, dim), (b + 'attn_output.weight', dim, heads * hd),
                 (b + 'ffn_gate.weight', ffn, dim), (b + 'ffn_up.weight', ffn, dim),
                 (b + 'ffn_down.weight', dim, ffn)]
        vecs += [(b + 'attn_norm.weight', dim), (b + 'ffn_norm.weight', dim)]
        if a == 'gemma3':
            vecs += [(b + 'attn_q_norm.weight', hd), (b + 'attn_k_norm.weight', hd),
                     (b + 'post_attention_norm.weight', dim), (b + 'post_ffw_norm.weight', dim)]
    keys = random.split(random.key(seed), len(mats) + len(vecs))
    tensors = []
    for j, (n, rows, cols) in enumerate(mats):
        t = BLOCK_TYPES[j % len(BLOCK_TYPES)]
        w = qlinear.random_qtensor(keys[j], t, rows, cols, std=0.5 / math.sqrt(cols))
        tensors.append((n, [cols, rows], int(t), w.blocks.tobytes()))
    for j, (n, k) in enumerate(vecs):
        g = 1 + 0.1 * random.rng(keys[len(mats) + j]).standard_normal(k)
        tensors.append((n, [k], 0, g.astype(np.float32).tobytes()))
    path.write_bytes(B.build(kvs, tensors)[0])
    return path


def gains_of(p):
    "The float arrays of a `models` parameter tree: every norm's gain."
    keep = lambda lp: {k: v for k, v in lp.items() if isinstance(v, np.ndarray)}
    return {'norm': p['norm'], 'layers': [keep(lp) for lp in p['layers']]}


def with_gains(p, g):
    return dict(p, norm=g['norm'], layers=[dict(lp, **gl) for lp, gl in zip(p['layers'],
                                                                          g['layers'])])


IDS = np.array([3, 17, 42, 5, 9, 61, 0, 28])


@pytest.mark.parametrize('arch', ['llama', 'gemma3'])
def test_models_forward_traces_and_matches_finite_differences(arch, tmp_path):
    """A tiny GGUF of every block type through `models.forward` under `value_and_grad`: the loss is
    the eager forward's, and the gradient of every gain (all float64: the whole forward float64)
    matches central differences of the eager forward."""
    params, c = models.from_gguf(tiny_gguf(tmp_path / f'{arch}.gguf', arch))
    assert {params['layers'][0][k].type for k in ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up',
                                                  'w_down')} == set(BLOCK_TYPES)
    ce = lambda g, ids: loss.cross_entropy(models.forward(with_gains(params, g), ids[:-1], c),
                                           ids[1:])
    eager = float(loss.cross_entropy(models.forward(params, IDS[:-1], c), IDS[1:]))
    value, grads = gd.value_and_grad(ce)(gains_of(params), IDS)
    assert abs(float(value) - eager) <= 1e-5 * abs(eager)
    assert all(np.isfinite(g).all() and g.any() for g in gd.tree_leaves(grads))
    assert gd.check_grads(ce, (gains_of(params), IDS), max_elements=4) <= 1


def test_one_token_traced_forward_is_the_eager_one(tmp_path):
    "A traced one-token forward (qmatmul, not qmatvec) gives the eager logits within float32."
    params, c = models.from_gguf(tiny_gguf(tmp_path / 'l.gguf'))
    want = models.forward(params, IDS[:1], c)
    got = gd.jit(lambda ids: models.forward(params, ids, c))(IDS[:1])
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_smollm2
def test_smollm2_forward_under_value_and_grad():
    """SmolLM2: the loss over 8 tokens traced equals the eager loss; the gradient of all 61 gains
    (a backward through every block) along a random direction agrees with central differences of
    the eager forward in float64 to float32's accuracy."""
    params, c = models.from_gguf(SMOLLM2)
    ids = np.array([1, 9690, 28, 253, 3485, 282, 260, 4879])
    ce = lambda g, ids: loss.cross_entropy(models.forward(with_gains(params, g), ids[:-1], c),
                                           ids[1:])
    g32 = gains_of(params)
    value, grads = gd.value_and_grad(ce)(g32, ids)
    assert abs(float(value) - float(ce(g32, ids))) < 1e-5
    g64 = gd.tree_map(lambda g: g.astype(np.float64), g32)
    u = gd.tree_map(lambda g: random.rng(random.key(g.size)).standard_normal(g.shape), g64)
    shifted = lambda s: float(ce(gd.tree_map(lambda g, v: g + s * v, g64, u), ids))
    fd = (shifted(1e-4) - shifted(-1e-4)) / 2e-4
    along = sum(float(np.sum(g * v)) for g, v in zip(gd.tree_leaves(grads), gd.tree_leaves(u)))
    assert abs(along - fd) < 1e-3 * abs(fd)


# ------------------------------------------------------------------ activation memory
def residual_bytes(f, *args):
    "Bytes of the distinct buffers the backward of `f` reads (views resolved to their base)."
    leaves, td = gd.tree_flatten(args)
    e = _VJPEntry(f, td, avals_of(leaves))
    made = {q.out.n: q for q in e.fwd.eqns}
    def base(v):
        while v.n in made and made[v.n].prim.name in ('transpose', 'reshape', 'getitem') \
                and isinstance(made[v.n].ins[0], Var):
            v = made[v.n].ins[0]
        return v
    ins = {v.n for v in e.fwd.ins}
    bufs = {b.n: b for b in (base(v) for v in e.fwd.outs[e.n_out:] if isinstance(v, Var))
            if b.n not in ins}
    return sum(math.prod(b.shape) * b.dtype.itemsize for b in bufs.values())


KEYS = ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down')


def shaped_like(c):
    "Parameters of config `c`'s shapes, every matrix Q4_1 blocks of zeros taking no memory."
    def mat(rows, cols):
        z = np.broadcast_to(np.zeros(1, np.uint8), (rows, cols // 32 * 20))
        return QTensor(z, GGMLType.Q4_1, (rows, cols))
    q, kv, g = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, np.ones(c.dim, np.float32)
    layer = lambda: {'attn_norm': g, 'ffn_norm': g, 'wq': mat(q, c.dim), 'wk': mat(kv, c.dim),
                     'wv': mat(kv, c.dim), 'wo': mat(c.dim, q), 'w_gate': mat(c.ffn_dim, c.dim),
                     'w_up': mat(c.ffn_dim, c.dim), 'w_down': mat(c.dim, c.ffn_dim)}
    e = mat(c.vocab_size, c.dim)
    return {'embed': e, 'output': e, 'norm': g, 'layers': [layer() for _ in range(c.n_layers)]}


SMOLLM2_CONFIG = models.DecoderConfig(49152, 576, 30, 9, 3, 64, 1536, 1e5, 1e-5, 8192, True)


@pytest.mark.parametrize('seq,rank', [(32, 8), (64, 4)])
def test_activation_bytes_is_what_the_graph_keeps(seq, rank):
    """SmolLM2's shapes (no weights: blocks of zeros), adapters on all seven matrices, one and two
    blocks: the residuals of the traced graph are `activation_bytes` to the byte."""
    for n in (1, 2):
        c = SMOLLM2_CONFIG._replace(n_layers=n)
        base = shaped_like(c)
        z = lambda *s: np.zeros(s, np.float32)
        ad = [{k: (z(rank, lp[k].shape[1]), z(lp[k].shape[0], rank)) for k in KEYS}
              for lp in base['layers']]
        def f(ad, ids):
            layers = [dict(lp, **{k: Adapted(lp[k], a[k][0], a[k][1], 2.0) for k in KEYS})
                      for lp, a in zip(base['layers'], ad)]
            p = dict(base, layers=layers)
            return loss.cross_entropy(models.forward(p, ids[:-1], c), ids[1:])
        got = residual_bytes(f, ad, np.zeros(seq + 1, np.int64))
        assert got == qlinear.activation_bytes(c, seq, rank=rank)
    assert qlinear.activation_bytes(SMOLLM2_CONFIG, 128, 4, rank=8) == 4 * (
        30 * (4 * 128 * (4 * 576 + 2 * 576 + 2 * 192 + 4 * 1536 + 56)
              + 4 * 9 * 128 ** 2) + 4 * 128 * 49152)


def test_activation_bytes_refuses_other_families():
    with pytest.raises(ConfigError, match="qk_norm"):
        qlinear.activation_bytes(SMOLLM2_CONFIG._replace(qk_norm=True), 8)
