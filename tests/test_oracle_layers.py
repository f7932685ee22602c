"""Gradients of gradus's own primitives and layers against an independent differentiator, the
`autograd` package (HIPS): each gradus function is called as it is (not re-written), and autograd
differentiates a formula written here from the op's definition or the layer's paper. Reductions and
softmax-like ops are checked on a non-last axis too."""
import math
import numpy as np
import pytest
autograd = pytest.importorskip('autograd')
import autograd.numpy as anp
import autograd.scipy.special as asp
import gradus as gd
from gradus.core import tensor as T
from gradus.learn import nn
from gradus.transformer import attention as A
from gradus.core import ops

rng = np.random.default_rng(5)
X = rng.standard_normal((3, 4, 5))
POS = np.abs(X) + 0.2


def check(gradus_f, autograd_f, x, rtol=1e-9):
    "Value and gradient of a scalar function of one array, gradus against autograd."
    v, g = gd.value_and_grad(gradus_f)(x)
    np.testing.assert_allclose(v, autograd_f(x), rtol=rtol)
    np.testing.assert_allclose(g, autograd.grad(autograd_f)(x), rtol=rtol, atol=1e-12)


W = rng.standard_normal((3, 4, 5))          # a fixed cotangent-shaping weight
UNARY = {  # name: (gradus op, autograd formula, input)
    'exp': (T.exp, anp.exp, X), 'log': (T.log, anp.log, POS), 'log1p': (T.log1p, anp.log1p, POS),
    'sin': (T.sin, anp.sin, X), 'cos': (T.cos, anp.cos, X), 'tanh': (T.tanh, anp.tanh, X),
    'sqrt': (T.sqrt, anp.sqrt, POS), 'absolute': (T.absolute, anp.abs, X),
    'negative': (T.negative, anp.negative, X), 'erf': (ops.erf, asp.erf, X),
    'erfc': (ops.erfc, lambda x: 1 - asp.erf(x), X),
    'sigmoid': (ops.sigmoid, lambda x: 1 / (1 + anp.exp(-x)), X),
    'softplus': (ops.softplus, lambda x: anp.log1p(anp.exp(x)), X),
    'relu': (ops.relu, lambda x: anp.where(x > 0, x, 0.0), X),
    'gelu': (ops.gelu, lambda x: 0.5 * x * (1 + anp.tanh(math.sqrt(2 / math.pi)
                                                        * (x + 0.044715 * x**3))), X),
    'gelu_exact': (lambda x: ops.gelu(x, approximate=False),
                   lambda x: 0.5 * x * (1 + asp.erf(x / math.sqrt(2))), X),
}


@pytest.mark.parametrize('name', list(UNARY))
def test_elementwise_primitives(name):
    op, ref, x = UNARY[name]
    check(lambda x: T.sum(op(x) * W), lambda x: anp.sum(ref(x) * W), x)


BINARY = {'add': (T.add, anp.add), 'subtract': (T.subtract, anp.subtract),
          'multiply': (T.multiply, anp.multiply), 'divide': (T.divide, anp.divide),
          'power': (T.power, anp.power), 'maximum': (T.maximum, anp.maximum),
          'minimum': (T.minimum, anp.minimum)}


@pytest.mark.parametrize('name', list(BINARY))
def test_binary_primitives_both_operands_broadcast(name):
    op, ref = BINARY[name]
    y = POS[0]                                   # (4, 5) broadcast against (3, 4, 5)
    check(lambda x: T.sum(op(x, y) * W), lambda x: anp.sum(ref(x, y) * W), POS)
    check(lambda y: T.sum(op(POS, y) * W), lambda y: anp.sum(ref(POS, y) * W), y)


@pytest.mark.parametrize('axis', [0, 1, (0, 2)], ids=str)
def test_reductions_on_non_last_axes(axis):
    w = np.sum(W, axis=axis)
    pairs = [(T.sum, anp.sum), (T.max, anp.max), (ops.mean, anp.mean), (ops.var, anp.var)]
    for g_op, a_op in pairs:
        check(lambda x: T.sum(g_op(x, axis) * w), lambda x: anp.sum(a_op(x, axis=axis) * w), X)
    check(lambda x: T.sum(ops.logsumexp(x, axis) * w),
          lambda x: anp.sum(asp.logsumexp(x, axis=axis) * w), X)


@pytest.mark.parametrize('axis', [0, 1, -1])
def test_softmax_family_on_every_axis(axis):
    sm = lambda x: anp.exp(x - asp.logsumexp(x, axis=axis, keepdims=True))
    check(lambda x: T.sum(ops.softmax(x, axis) * W), lambda x: anp.sum(sm(x) * W), X)
    check(lambda x: T.sum(ops.log_softmax(x, axis) * W),
          lambda x: anp.sum((x - asp.logsumexp(x, axis=axis, keepdims=True)) * W), X)


def test_shape_and_index_primitives():
    idx = np.array([2, 0, 2])
    check(lambda x: T.sum(T.transpose(x, (2, 0, 1)) * W.transpose(2, 0, 1)),
          lambda x: anp.sum(anp.transpose(x, (2, 0, 1)) * W.transpose(2, 0, 1)), X)
    check(lambda x: T.sum(T.reshape(x, (12, 5)) ** 2),
          lambda x: anp.sum(anp.reshape(x, (12, 5)) ** 2), X)
    check(lambda x: T.sum(ops.take(x, idx, axis=0) ** 3), lambda x: anp.sum(x[idx] ** 3), X)
    check(lambda x: T.sum(x[1:, ::2] ** 2), lambda x: anp.sum(x[1:, ::2] ** 2), X)
    check(lambda x: T.sum(ops.concatenate([x, 2 * x], axis=1) ** 2),
          lambda x: anp.sum(anp.concatenate([x, 2 * x], axis=1) ** 2), X)
    check(lambda x: T.sum(T.where(x > 0, x * x, -x)),
          lambda x: anp.sum(anp.where(x > 0, x * x, -x)), X)
    check(lambda x: T.sum(T.matmul(x, T.swapaxes(x, -1, -2)) ** 2),
          lambda x: anp.sum(anp.matmul(x, anp.swapaxes(x, -1, -2)) ** 2), X)


# ---------- layers, each against its paper's formula ----------
def test_linear():
    p = {'w': rng.standard_normal((5, 3)), 'b': rng.standard_normal(3)}
    check(lambda w: T.sum(nn.linear({'w': w, 'b': p['b']}, X) ** 2),
          lambda w: anp.sum((anp.einsum('bti,io->bto', X, w) + p['b']) ** 2), p['w'])


def ln_formula(x, g, b, eps=1e-5):
    "Ba et al. 2016: (x − mean) / √(var + eps) · g + b over the last axis."
    mu = anp.mean(x, axis=-1, keepdims=True)
    var = anp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) / anp.sqrt(var + eps) * g + b


def test_layer_norm_input_and_parameters():
    g, b = rng.standard_normal(5), rng.standard_normal(5)
    check(lambda x: T.sum(nn.layer_norm({'scale': g, 'bias': b}, x) * W),
          lambda x: anp.sum(ln_formula(x, g, b) * W), X * 3 + 1)
    check(lambda g: T.sum(nn.layer_norm({'scale': g, 'bias': b}, X) * W),
          lambda g: anp.sum(ln_formula(X, g, b) * W), g)


def test_rms_norm():
    g = rng.standard_normal(5)
    def rms(x):   # Zhang & Sennrich 2019
        return x / anp.sqrt(anp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g
    check(lambda x: T.sum(nn.rms_norm({'scale': g}, x) * W), lambda x: anp.sum(rms(x) * W), X + 2)


def test_embedding():
    ids = np.array([[4, 0, 4], [1, 2, 3]])
    check(lambda w: T.sum(nn.embedding({'w': w}, ids) ** 3), lambda w: anp.sum(w[ids] ** 3),
          rng.standard_normal((5, 4)))


def test_causal_attention_with_grouped_heads():
    "q (B, H, T, D) against k, v (B, H_kv, T, D), head h reading KV head h // (H / H_kv)."
    q, k = rng.standard_normal((1, 4, 5, 8)), rng.standard_normal((1, 2, 5, 8))
    v = rng.standard_normal((1, 2, 5, 8))
    mask = np.tril(np.ones((5, 5), bool))

    def formula(q):
        kk, vv = anp.repeat(k, 2, axis=1), anp.repeat(v, 2, axis=1)          # (1, 4, 5, 8)
        s = anp.matmul(q, anp.swapaxes(kk, -1, -2)) / math.sqrt(8)           # (1, 4, 5, 5)
        s = anp.where(mask, s, -1e30)
        w = anp.exp(s - asp.logsumexp(s, axis=-1, keepdims=True))
        return anp.sum(anp.matmul(w, vv) ** 2)

    def ours(q):
        qg = T.reshape(q, (1, 2, 2, 5, 8))                                   # (B, H_kv, G, T, D)
        out = A.scaled_dot_product_attention(qg, k[:, :, None], v[:, :, None], A.causal_mask(5))
        return T.sum(out ** 2)
    check(ours, formula, q)


def test_one_function_two_dtypes():
    "A cached gradient is per signature: float64 then float32 inputs each get their own dtype back."
    f = gd.grad(lambda x: T.sum(T.tanh(x) * x))
    want = autograd.grad(lambda x: anp.sum(anp.tanh(x) * x))(X)
    g64, g32 = f(X), f(X.astype(np.float32))
    assert g64.dtype == np.float64 and g32.dtype == np.float32
    np.testing.assert_allclose(g64, want, rtol=1e-12)
    np.testing.assert_allclose(g32, want, rtol=1e-5, atol=1e-6)
