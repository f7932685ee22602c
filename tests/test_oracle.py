"""Gradients agree with an independent library, the `autograd` package (HIPS), on composite
functions.

Each function is written once against a namespace `m` that is either `gradus.core.tensor` or
`autograd.numpy` (plus the few scipy functions autograd keeps elsewhere), so both libraries
differentiate the same formula."""
import types
import numpy as np
import pytest
autograd = pytest.importorskip('autograd')
import autograd.numpy as anp
import autograd.scipy.special as asp
import gradus as gd
from gradus.core import tensor as T
from gradus.core import ops

A = types.SimpleNamespace(**{k: getattr(anp, k) for k in dir(anp) if not k.startswith('_')})
A.erf = asp.erf
A.logsumexp = lambda x, axis=-1, keepdims=False: asp.logsumexp(x, axis=axis, keepdims=keepdims)
A.softmax = lambda x, axis=-1: anp.exp(x - asp.logsumexp(x, axis=axis, keepdims=True))
A.log_softmax = lambda x, axis=-1: x - asp.logsumexp(x, axis=axis, keepdims=True)
A.relu = lambda x: anp.where(x > 0, x, 0.0)
A.sigmoid = lambda x: 0.5 * (anp.tanh(0.5 * x) + 1)
A.softplus = lambda x: anp.maximum(x, 0) + anp.log1p(anp.exp(-anp.abs(x)))
A.gelu = lambda x: 0.5 * x * (1 + anp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
A.gelu_exact = lambda x: 0.5 * x * (1 + asp.erf(x / np.sqrt(2)))
A.take = lambda x, i, axis=0: x[i]  # autograd has no VJP for take; indexing is its gather
# gradus's side: the ops of tensor and ops in one namespace (a copy: the modules stay untouched)
G = types.SimpleNamespace(**{k: getattr(m, k) for m in (T, ops) for k in m.__all__})
G.gelu_exact = lambda x: ops.gelu(x, approximate=False)

rng = np.random.default_rng(42)
X, W1 = rng.standard_normal((6, 4)), rng.standard_normal((4, 5))
W2, B = rng.standard_normal((5, 3)), rng.standard_normal(5)
Y = rng.integers(0, 3, 6)
P = rng.uniform(0.5, 2.0, (6, 4))

FUNCS = {
    'mlp_tanh_mse': lambda m, w: m.mean((m.tanh(X @ w + 0.1) @ W2 - 1.0) ** 2),
    'mlp_relu_bias': lambda m, b: m.sum(m.relu(X @ W1 + b) @ W2),
    'gelu_mlp': lambda m, w: m.sum(m.gelu(X @ w) ** 2),
    'gelu_exact_mlp': lambda m, w: m.sum(m.gelu_exact(X @ w) * 0.3),
    'cross_entropy': lambda m, v: -m.mean(m.sum(m.log_softmax(m.tanh(X @ W1) @ v) * np.eye(3)[Y],
                                                axis=-1)),
    'softmax_entropy': lambda m, x: -m.sum(m.softmax(x) * m.log_softmax(x)),
    'logsumexp_axis0': lambda m, x: m.sum(m.logsumexp(x * 3, axis=0) ** 2),
    'layer_norm': lambda m, x: m.sum(((x - m.mean(x, axis=-1, keepdims=True)) /
                                       m.sqrt(m.var(x, axis=-1, keepdims=True) + 1e-5))
                                      * np.arange(4.0)),
    'rms_norm': lambda m, x: m.sum(x / m.sqrt(m.mean(x * x, axis=-1, keepdims=True) + 1e-6)
                                   * np.arange(4.0)),
    'sigmoid_bce': lambda m, x: m.mean(m.softplus(x) - x * (P > 1)),
    'sigmoid_chain': lambda m, x: m.sum(m.sigmoid(m.sin(x) * 3) * m.cos(x)),
    'exp_log': lambda m, p: m.sum(m.log(p) * m.exp(-p) + m.sqrt(p)),
    'power_div': lambda m, p: m.sum(p ** 1.7 / (1 + p ** 2)),
    'abs_max': lambda m, x: m.sum(m.abs(x) * m.max(x, axis=1, keepdims=True)),
    'maximum_minimum': lambda m, x: m.sum(m.maximum(x, 0.3) - m.minimum(x * x, 0.5)),
    'where_branches': lambda m, x: m.sum(m.where(x > 0, m.tanh(x), x * x)),
    'gather_repeat': lambda m, e: m.sum(m.take(e, np.array([0, 3, 3, 1, 0, 0]), axis=0) ** 2 * X),
    'attention_like': lambda m, x: m.sum(m.softmax((x @ x.T) / 2.0) @ x),
    'batched_matmul': lambda m, x: m.sum(m.tanh(m.reshape(x, (2, 3, 4)) @ W1) ** 2),
    # (24,) viewed as (3, 2, 4), transposed to (4, 3, 2)
    'transpose_reshape': lambda m, x: m.sum(m.transpose(m.reshape(x, (3, 2, 4)), (2, 0, 1))
                                            * np.arange(24.0).reshape(4, 3, 2)),
    'concatenate': lambda m, x: m.sum(m.concatenate([x, x * x], axis=1) @ np.ones((8, 2))),
    'erf_sum': lambda m, x: m.sum(m.erf(x) * x),
    'log1p_chain': lambda m, p: m.sum(m.log1p(p * p) / p),
    'var_keepdims': lambda m, x: m.sum(m.var(x, axis=0) * m.mean(x, axis=0)),
    'slicing': lambda m, x: m.sum(x[1:5, ::2] ** 2) - m.sum(x[0] * x[-1]),
}
ARGS = {'v': W2, 'w': W1, 'b': B, 'x': X, 'p': P, 'e': rng.standard_normal((4, 4))}


def arg_for(f):
    import inspect
    return ARGS[list(inspect.signature(f).parameters)[1]]


def test_at_least_twenty():
    assert len(FUNCS) >= 20


@pytest.mark.parametrize('name', list(FUNCS))
def test_matches_autograd(name):
    f = FUNCS[name]
    a = arg_for(f)
    ours = gd.grad(lambda v: f(G, v))(a)
    theirs = autograd.grad(lambda v: f(A, v))(a)
    assert ours.shape == a.shape and ours.dtype == a.dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)
    # and the values themselves
    np.testing.assert_allclose(f(G, a), f(A, a), rtol=1e-12)


@pytest.mark.parametrize('name', ['mlp_tanh_mse', 'softmax_entropy', 'layer_norm', 'exp_log',
                                  'attention_like'])
def test_hessian_vector_products_match_autograd(name):
    f = FUNCS[name]
    a = arg_for(f)
    v = rng.standard_normal(a.shape)
    ours = gd.grad(lambda x: T.sum(gd.grad(lambda y: f(G, y))(x) * v))(a)
    theirs = autograd.grad(lambda x: anp.sum(autograd.grad(lambda y: f(A, y))(x) * v))(a)
    np.testing.assert_allclose(ours, theirs, rtol=1e-8, atol=1e-10)


# ---- every loss of `gradus.learn.loss` against a formula written for autograd (issue 15) ----
from gradus.learn import loss as L


def _ag_log_softmax(z, axis):
    return z - asp.logsumexp(z, axis=axis, keepdims=True)


def _ag_cross_entropy(z, y, axis=-1, ignore_index=None):
    "Mean of −log softmax(z)[y] along the class `axis`, over labels that are not `ignore_index`."
    C = z.shape[axis]
    keep = np.ones(y.shape) if ignore_index is None else (y != ignore_index).astype(float)
    onehot = np.moveaxis(np.eye(C)[np.where(keep > 0, y, 0)], -1, axis % z.ndim)
    picked = anp.sum(_ag_log_softmax(z, axis) * onehot, axis=axis)
    return -anp.sum(picked * keep) / max(keep.sum(), 1.0)


ZL = rng.standard_normal((2, 3, 5)) * 3                       # logits (B, T, C)
YL = rng.integers(0, 5, (2, 3))
YI = YL.copy(); YI[0, 1] = YI[1, 2] = -100
ZT = rng.standard_normal((5, 4)) * 3                          # class axis first: (C, N)
YT = rng.integers(0, 5, 4)
XB, TB = rng.standard_normal((3, 4)) * 4, rng.uniform(size=(3, 4))
PM, TM = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))

# name: (gradus loss of the differentiated argument, the same loss written for autograd, argument)
LOSSES = {
    'mse_pred': (lambda p: L.mse(p, TM), lambda p: anp.mean((p - TM) ** 2), PM),
    'mse_target': (lambda t: L.mse(PM, t), lambda t: anp.mean((PM - t) ** 2), TM),
    'cross_entropy_3d': (lambda z: L.cross_entropy(z, YL), lambda z: _ag_cross_entropy(z, YL), ZL),
    'cross_entropy_ignore_index': (lambda z: L.cross_entropy(z, YI, ignore_index=-100),
                                   lambda z: _ag_cross_entropy(z, YI, ignore_index=-100), ZL),
    'cross_entropy_class_axis_0': (lambda z: L.cross_entropy(T.transpose(z), YT),  # (N, C)
                                   lambda z: _ag_cross_entropy(z, YT, axis=0), ZT),
    # logits (B, T, C) swapped to (T, B, C): labels follow
    'cross_entropy_swapped_leading_axes': (lambda z: L.cross_entropy(T.swapaxes(z, 0, 1), YL.T),
                                           lambda z: _ag_cross_entropy(anp.swapaxes(z, 0, 1), YL.T),
                                           ZL),
    'bce_logits': (lambda x: L.binary_cross_entropy_with_logits(x, TB),
                   lambda x: anp.mean(anp.logaddexp(0, x) - x * TB), XB),
    'bce_targets': (lambda t: L.binary_cross_entropy_with_logits(XB, t),
                    lambda t: anp.mean(anp.logaddexp(0, XB) - XB * t), TB),
    'bce_transposed': (lambda x: L.binary_cross_entropy_with_logits(T.transpose(x), TB.T),
                       lambda x: anp.mean(anp.logaddexp(0, x.T) - x.T * TB.T), XB),
}


def test_every_loss_is_covered():
    prefix = {'mse': 'mse_', 'cross_entropy': 'cross_entropy_',
              'binary_cross_entropy_with_logits': 'bce_'}
    assert set(L.__all__) == set(prefix), "a new loss in gradus.learn.loss: add it to LOSSES"
    for name, p in prefix.items(): assert any(k.startswith(p) for k in LOSSES), name


@pytest.mark.parametrize('name', list(LOSSES))
def test_loss_matches_autograd(name):
    ours_f, theirs_f, a = LOSSES[name]
    v, g = gd.value_and_grad(ours_f)(a)
    np.testing.assert_allclose(v, theirs_f(a), rtol=1e-13)
    np.testing.assert_allclose(g, autograd.grad(theirs_f)(a), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize('name', ['cross_entropy_3d', 'cross_entropy_ignore_index',
                                  'cross_entropy_class_axis_0',
                                  'bce_logits', 'mse_pred'])
def test_loss_hessian_vector_products_match_autograd(name):
    ours_f, theirs_f, a = LOSSES[name]
    v = rng.standard_normal(a.shape)
    ours = gd.grad(lambda x: T.sum(gd.grad(ours_f)(x) * v))(a)
    theirs = autograd.grad(lambda x: anp.sum(autograd.grad(theirs_f)(x) * v))(a)
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)
