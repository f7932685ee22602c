"""Forward values against references outside gradus: every elementwise primitive and composite
against numpy/scipy in float32 and float64, reductions and softmax composites on every axis, and
the nn layers against formulas written here from their papers. Finite differences prove gradients
match the forward; these prove the forward is right (a wrong forward passes any finite-difference
check)."""
import math
import numpy as np
import pytest
import scipy.special as sp
from gradus.core import tensor as T
from gradus.learn import nn, random
from gradus.core import ops

RNG = np.random.default_rng(7)
X = RNG.standard_normal((3, 4, 5))
POS = np.abs(X) + 0.1

UNARY = [  # (gradus op, reference, input)
    (T.exp, np.exp, X), (T.log, np.log, POS), (T.log1p, np.log1p, POS), (T.sin, np.sin, X),
    (T.cos, np.cos, X), (T.tanh, np.tanh, X), (T.sqrt, np.sqrt, POS), (T.absolute, np.abs, X),
    (ops.erf, sp.erf, X), (T.sign, np.sign, X), (T.negative, np.negative, X),
    (ops.sigmoid, sp.expit, X), (ops.softplus, lambda x: np.logaddexp(0, x), X),
    (ops.relu, lambda x: np.maximum(x, 0), X),
    (lambda x: ops.gelu(x, approximate=False),
     lambda x: 0.5 * x * (1 + sp.erf(x / math.sqrt(2))), X),
    (ops.gelu,
     lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))), X),
]
BINARY = [(T.add, np.add), (T.subtract, np.subtract), (T.multiply, np.multiply),
          (T.divide, np.divide), (T.maximum, np.maximum), (T.minimum, np.minimum),
          (T.power, np.power)]


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
@pytest.mark.parametrize('i', range(len(UNARY)))
def test_unary_matches_reference(i, dtype):
    op, ref, x = UNARY[i]
    got = op(x.astype(dtype))
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=tol, atol=tol)


@pytest.mark.parametrize('i', range(len(BINARY)))
def test_binary_broadcasts_like_numpy(i):
    op, ref = BINARY[i]
    a, b = POS[:, :1, :], POS[0]          # (3, 1, 5) with (4, 5) -> (3, 4, 5)
    np.testing.assert_allclose(op(a, b), ref(a, b), rtol=1e-13)


AXES = [0, 1, 2, -1, (0, 2), None]


@pytest.mark.parametrize('axis', AXES, ids=str)
def test_reductions_on_every_axis(axis):
    pairs = [(T.sum, np.sum), (T.max, np.max), (ops.mean, np.mean), (ops.var, np.var),
             (ops.logsumexp, sp.logsumexp)]
    for keepdims in (False, True):
        for op, ref in pairs:
            got, want = op(X, axis, keepdims=keepdims), ref(X, axis, keepdims=keepdims)
            np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=op.__name__)


@pytest.mark.parametrize('axis', [0, 1, 2, -1, -2])
def test_softmax_and_log_softmax_on_every_axis(axis):
    np.testing.assert_allclose(ops.softmax(X, axis), sp.softmax(X, axis), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(ops.log_softmax(X, axis), sp.log_softmax(X, axis), rtol=1e-13,
                               atol=1e-14)
    np.testing.assert_allclose(np.sum(ops.softmax(X, axis), axis), 1.0, rtol=1e-14)


def test_shape_ops_match_numpy():
    np.testing.assert_array_equal(T.transpose(X, (2, 0, 1)), np.transpose(X, (2, 0, 1)))
    np.testing.assert_array_equal(T.swapaxes(X, 0, 2), np.swapaxes(X, 0, 2))
    np.testing.assert_array_equal(T.reshape(X, (12, 5)), X.reshape(12, 5))
    col = X[:, :1]                          # (3, 1, 5)
    np.testing.assert_array_equal(T.broadcast_to(col, (3, 4, 5)), np.broadcast_to(col, (3, 4, 5)))
    both = [X, X[:1]]
    np.testing.assert_array_equal(ops.concatenate(both, axis=0), np.concatenate(both, axis=0))
    np.testing.assert_array_equal(ops.stack([X, 2 * X], axis=1), np.stack([X, 2 * X], axis=1))
    idx = np.array([[0, 2], [1, 1]])
    np.testing.assert_array_equal(ops.take(X, idx, axis=1), np.take(X, idx, axis=1))
    np.testing.assert_array_equal(T.where(X > 0, X, -X), np.where(X > 0, X, -X))
    np.testing.assert_allclose(T.matmul(X, X.swapaxes(-1, -2)), X @ X.swapaxes(-1, -2), rtol=1e-13)


# ---------- layers, from their papers ----------
def test_linear_is_x_w_plus_b():
    p = nn.linear_init(random.key(0), 5, 3, dtype=np.float64)
    p['b'] = RNG.standard_normal(3)
    x = RNG.standard_normal((2, 4, 5))
    want = np.einsum('bti,io->bto', x, p['w']) + p['b']
    np.testing.assert_allclose(nn.linear(p, x), want, rtol=1e-13)


def test_layer_norm_matches_ba_et_al():
    "(x - mean) / sqrt(var + eps) * g + b over the last axis; biased variance, eps inside the root."
    x = RNG.standard_normal((4, 6)) * 3 + 1
    g, b = RNG.standard_normal(6), RNG.standard_normal(6)
    for eps in (1e-5, 0.5):
        rows = [(r - r.mean()) / math.sqrt(((r - r.mean()) ** 2).mean() + eps) for r in x]
        want = np.stack(rows) * g + b
        got = nn.layer_norm({'scale': g, 'bias': b}, x, eps=eps)
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_rms_norm_matches_zhang_sennrich():
    "y = x / sqrt(mean(x^2) + eps) * g, no centring."
    x = RNG.standard_normal((4, 6)) + 2
    g = RNG.standard_normal(6)
    for eps in (1e-6, 0.5):
        want = np.stack([r / math.sqrt((r * r).mean() + eps) for r in x]) * g
        np.testing.assert_allclose(nn.rms_norm({'scale': g}, x, eps=eps), want, rtol=1e-12)


def test_embedding_is_row_lookup():
    p = nn.embedding_init(random.key(1), 7, 3, dtype=np.float64)
    ids = np.array([[6, 0, 6], [2, 3, 1]])
    want = np.array([[p['w'][i] for i in row] for row in ids])
    np.testing.assert_array_equal(nn.embedding(p, ids), want)


def test_dropout_keeps_expectation_and_rescales_survivors():
    "Inverted dropout: survivors are scaled by 1/(1-rate), so E[y] = x; the rest are exactly 0."
    x = np.ones((400, 500))
    y = nn.dropout(random.key(2), x, 0.25, True)
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-15)
    assert abs(kept.mean() - 0.75) < 0.005 and abs(y.mean() - 1) < 0.01


def test_mlp_matches_hand_composition():
    p = nn.mlp_init(random.key(3), [4, 6, 2], dtype=np.float64)
    x = RNG.standard_normal((5, 4))
    h = np.tanh(x @ p[0]['w'] + p[0]['b'])
    np.testing.assert_allclose(nn.mlp(p, x, T.tanh), h @ p[1]['w'] + p[1]['b'], rtol=1e-13)
