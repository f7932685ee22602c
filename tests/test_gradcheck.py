"""Every differentiable primitive and composite op against central differences in float64, through
the full trace -> VJP transform -> codegen path (`check_grads`), plus the documented conventions and
dtype contracts."""
import numpy as np
import pytest
import ml_dtypes
import gradus as gd
from gradus.core import tensor as T
from gradus.core import ops
from gradus.errors import DTypeError
from gradus.errors import ShapeError

rng = np.random.default_rng(0)
r = lambda *s: rng.standard_normal(s)
pos = lambda *s: rng.uniform(0.5, 2.0, s)

CASES = {
    # elementwise binary, with broadcasting: a (1, out) and an (out,) bias on (batch, out)
    'add_bias_row': (lambda b, x: T.add(x, b), (r(1, 3), r(5, 3))),
    'add_bias_vec': (lambda b, x: x + b, (r(3), r(5, 3))),
    'subtract_bcast': (lambda a, b: a - b, (r(4, 1), r(1, 5))),
    'multiply': (lambda a, b: a * b, (r(2, 3), r(3))),
    'divide': (lambda a, b: a / b, (r(2, 3), pos(2, 1))),
    'power_both': (lambda a, b: a ** b, (pos(3, 2), r(2))),
    'power_const': (lambda a: a ** 3, (r(4),)),
    'rpow': (lambda a: 2.0 ** a, (r(4),)),
    'maximum': (lambda a, b: T.maximum(a, b), (r(5), r(5))),
    'minimum_bcast': (lambda a, b: T.minimum(a, b), (r(3, 1), r(4))),
    # unary
    'negative': (lambda a: -a, (r(3),)), 'exp': (T.exp, (r(3, 2),)), 'log': (T.log, (pos(4),)),
    'log1p': (T.log1p, (pos(4),)), 'sin': (T.sin, (r(3),)), 'cos': (T.cos, (r(3),)),
    'tanh': (T.tanh, (r(3),)), 'sqrt': (T.sqrt, (pos(3),)), 'abs': (T.absolute, (r(4),)),
    'erf': (ops.erf, (r(5),)),
    'erfc': (ops.erfc, (r(5),)), 'erfc_tail': (ops.erfc, (pos(4) * 4,)),
    # selection
    'where': (lambda x, y: T.where(x > 0, x * 2, y), (r(4, 3), r(3))),
    # matmul: plain, batched with broadcast batch axes, vectors, batch @ weight
    'matmul': (T.matmul, (r(4, 5), r(5, 2))),
    'matmul_batch_bcast': (T.matmul, (r(2, 1, 4, 5), r(3, 5, 6))),
    'matmul_vec_vec': (T.matmul, (r(5), r(5))),
    'matmul_mat_vec': (T.matmul, (r(3, 4, 5), r(5))),
    'matmul_vec_batch': (T.matmul, (r(5), r(2, 5, 3))),
    'matmul_batch_weight': (lambda a, b: a @ b, (r(2, 3, 4), r(4, 6))),
    # reductions, keepdims
    'sum_all': (T.sum, (r(3, 4),)),
    'sum_keepdims': (lambda a: T.sum(a, axis=(0, 2), keepdims=True), (r(3, 4, 5),)),
    'sum_neg_axis': (lambda a: a.sum(axis=-1), (r(3, 4),)),
    'max_axis': (lambda a: T.max(a, axis=1), (r(3, 4),)),
    'max_keepdims': (lambda a: T.max(a, axis=0, keepdims=True), (r(3, 4),)),
    # data movement
    'reshape': (lambda a: a.reshape(2, -1), (r(3, 4),)),
    'transpose': (lambda a: T.transpose(a, (2, 0, 1)), (r(2, 3, 4),)),
    'T': (lambda a: a.T, (r(2, 3),)),
    'broadcast_to': (lambda a: T.broadcast_to(a, (2, 3, 4)), (r(3, 1),)),
    'getitem_basic': (lambda a: a[1:4, None, -1], (r(5, 4),)),
    'getitem_int': (lambda a: a[2], (r(5, 4),)),
    'getitem_step': (lambda a: a[::-2, 1:], (r(5, 4),)),
    'take_repeated': (lambda a: ops.take(a, np.array([[0, 2], [2, 2]]), axis=0), (r(5, 3),)),
    'take_axis1': (lambda a: ops.take(a, np.array([1, 1, 0]), axis=1), (r(2, 3),)),
    'embedding_lookup': (lambda e: e[np.array([3, 1, 3, 3])], (r(5, 2),)),
    'concatenate': (lambda a, b: ops.concatenate([a, b], axis=0), (r(2, 3), r(4, 3))),
    'stack': (lambda a, b: ops.stack([a, b], axis=1), (r(2, 3), r(2, 3))),
    # composites
    'mean': (lambda a: ops.mean(a, axis=0), (r(3, 4),)),
    'var': (lambda a: ops.var(a, axis=1, keepdims=True), (r(3, 4),)),
    'softmax': (ops.softmax, (r(3, 4),)),
    'log_softmax': (ops.log_softmax, (r(3, 4),)),
    'logsumexp': (lambda a: ops.logsumexp(a, axis=0), (r(3, 4),)),
    'logsumexp_huge': (ops.logsumexp, (np.array([[1e4, 1e4 - 1.0, 0.0]]),)),
    'logsumexp_neg_inf': (ops.logsumexp, (np.array([[0.5, -np.inf, 1.0]]),)),
    'logsumexp_tiny_rest': (ops.logsumexp, (np.array([[0.0, -30.0, -25.0], [2.0, 2.0, -3.0]]),)),
    'log_softmax_ties': (ops.log_softmax, (np.array([[1.0, 1.0, -2.0], [0.0, -30.0, -1.0]]),)),
    'relu': (ops.relu, (r(6),)),
    'sigmoid': (ops.sigmoid, (r(6) * 5,)),
    'sigmoid_tails': (ops.sigmoid, (np.array([-30.0, -12.0, 12.0, 30.0]),)),
    'softplus': (ops.softplus, (r(6) * 5,)),
    'gelu_tanh': (ops.gelu, (r(6),)),
    'gelu_tanh_tail': (ops.gelu, (np.array([-8.0, -5.0, -3.5, 4.0]),)),
    'gelu_exact': (lambda a: ops.gelu(a, approximate=False), (r(6),)),
    'gelu_exact_tail': (lambda a: ops.gelu(a, approximate=False),
                        (np.array([-9.0, -6.0, -4.0, 5]),)),
    'gelu_tanh_composite': (ops.gelu_tanh_reference, (r(6) * 3,)),
    'silu': (ops.silu, (r(6) * 3,)),
    'silu_tails': (ops.silu, (np.array([-30.0, -12.0, 12.0, 30.0]),)),
}


@pytest.mark.parametrize('name', list(CASES))
def test_first_order(name):
    f, args = CASES[name]
    assert gd.check_grads(f, args) <= 1


SECOND = ['multiply', 'divide', 'power_both', 'exp', 'log', 'tanh', 'sqrt', 'erf', 'erfc', 'sin',
          'matmul_batch_bcast', 'max_axis', 'take_repeated', 'getitem_basic', 'softmax',
          'logsumexp', 'gelu_tanh', 'var', 'where', 'concatenate', 'broadcast_to', 'sigmoid',
          'log_softmax_ties', 'gelu_exact', 'gelu_tanh_tail', 'silu', 'silu_tails']


@pytest.mark.parametrize('name', SECOND)
def test_second_order(name):
    f, args = CASES[name]
    assert gd.check_grads(f, args, order=2) <= 1


def test_every_differentiable_primitive_is_swept():
    "A new primitive must join the sweep: compare the primitives reached by tracing the cases."
    seen = set()
    for f, args in CASES.values():
        g = gd.trace(gd.grad(lambda *a: T.sum(f(*a) * 1.0), argnums=tuple(range(len(args)))), *args)
        seen |= {e.prim.name for e in g.eqns}
    differentiable = {p.name for p in ops.PRIMITIVES if p.vjp}
    assert differentiable <= seen | {'index_put', 'scatter_add'} or differentiable - seen == set()
    assert differentiable - seen <= {'index_put', 'scatter_add'}, differentiable - seen


def test_cast_through_float32():
    "cast's VJP casts back; a float32 round trip is a step function at 1e-7: the step is 1e-2 here."
    f = lambda a: T.cast(T.cast(a, np.float32), np.float64) * a
    assert any(e.prim.name == 'cast' for e in gd.trace(f, r(3)).eqns)
    assert gd.check_grads(f, (r(3),), eps=1e-2, rtol=1e-3, atol=1e-4) <= 1


# --- conventions ---------------------------------------------------------------------------------

def test_max_ties_share_equally():
    g = gd.grad(lambda x: T.max(x))(np.array([3.0, 1.0, 3.0, 3.0]))
    assert np.allclose(g, [1 / 3, 0, 1 / 3, 1 / 3])
    gx, gy = gd.grad(lambda x, y: T.maximum(x, y), argnums=(0, 1))(np.array(2.0), np.array(2.0))
    assert gx == 0.5 and gy == 0.5


def test_softplus_slope_at_zero():
    "softplus'(0) = sigmoid(0) = 1/2: the kinks of maximum and abs at 0 must cancel."
    assert gd.grad(lambda x: ops.softplus(x))(np.array(0.0)) == 0.5


def test_abs_and_relu_at_zero():
    assert gd.grad(lambda x: T.absolute(x))(np.array(0.0)) == 0.0
    assert gd.grad(lambda x: T.sum(ops.relu(x)))(np.zeros(3)).tolist() == [0.0, 0.0, 0.0]


def test_where_untaken_nan_branch_and_safe_pattern():
    x = np.array([-1.0, 4.0])
    with np.errstate(invalid='ignore', divide='ignore'):
        unsafe = gd.grad(lambda x: T.sum(T.where(x > 0, T.sqrt(x), 0.0)))(x)
        safe = gd.grad(lambda x: T.sum(T.where(x > 0, T.sqrt(T.where(x > 0, x, 1.0)), 0.0)))(x)
    assert np.isnan(unsafe[0]) and unsafe[1] == 0.25
    assert safe.tolist() == [0.0, 0.25]


def test_logsumexp_stable_values():
    assert ops.logsumexp(np.array([1e4, 1e4])) == pytest.approx(1e4 + np.log(2))
    with np.errstate(divide='ignore'):
        assert ops.logsumexp(np.full(3, -np.inf)) == -np.inf
    g = gd.grad(lambda x: ops.logsumexp(x))(np.array([1e4, 0.0, -np.inf]))
    assert np.allclose(g, [1, 0, 0]) and np.isfinite(g).all()


# --- dtype contracts -----------------------------------------------------------------------------

@pytest.mark.parametrize('dt', [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_gradient_has_primal_shape_and_dtype(dt):
    p = {'w': np.ones((3, 2), dt), 'b': np.zeros(2, dt), 's': np.ones((), dt)}
    x = np.ones((4, 3), dt)
    g = gd.grad(lambda p, x: T.sum(T.tanh(x @ p['w'] + p['b']) * p['s']))(p, x)
    for k in p: assert g[k].shape == p[k].shape and g[k].dtype == p[k].dtype, k


def test_integer_input_gets_no_gradient_and_asking_raises():
    f = lambda w, idx: T.sum(ops.take(w, idx, axis=0))
    w, idx = np.ones((4, 2)), np.array([0, 0, 3])
    assert gd.grad(f)(w, idx).tolist() == [[2, 2], [0, 0], [0, 0], [1, 1]]
    with pytest.raises(DTypeError, match='argument 1'):
        gd.grad(f, argnums=1)(w, idx)
    with pytest.raises(DTypeError, match=r"\['step'\]"):
        gd.grad(lambda p: T.sum(p['w']) * p['step'])({'w': np.ones(2), 'step': np.array(3)})


def test_non_scalar_loss_is_refused():
    with pytest.raises(ShapeError, match='scalar'): gd.grad(lambda x: x * 2)(np.ones(3))
    with pytest.raises(DTypeError): gd.grad(lambda x: T.sum(x) > 0)(np.ones(3))


def test_check_grads_catches_a_wrong_rule():
    "The referee itself must be able to fail: a custom_vjp with a deliberately wrong backward."
    bad = gd.custom_vjp(lambda x: T.sin(x))
    bad.defvjp(lambda x: (T.sin(x), x), lambda x, ct: (ct * T.sin(x),))  # should be cos
    with pytest.raises(gd.GradCheckError, match=r'args\[0\]'):
        gd.check_grads(bad, (r(3),))


@pytest.mark.parametrize('op', [T.sqrt, ops.erf, ops.erfc, T.exp, T.tanh, ops.sigmoid, ops.gelu,
                                lambda x: ops.gelu(x, approximate=False),
                                ops.softplus, lambda x: T.maximum(x, x), ops.log_softmax, ops.silu,
                                ops.softmax])
def test_bfloat16_stays_bfloat16(op):
    "numpy with ml_dtypes turns bfloat16 * python float into float32; values and gradients may not."
    x = np.linspace(0.5, 1.0, 4).astype(ml_dtypes.bfloat16)
    assert op(x).dtype == x.dtype
    assert gd.grad(lambda x: T.sum(op(x)))(x).dtype == x.dtype


def test_power_zero_exponent_has_zero_gradient_at_zero():
    assert gd.grad(lambda x: T.sum(x ** 0.0))(np.zeros(2)).tolist() == [0.0, 0.0]


def test_logsumexp_all_minus_inf_row_gets_zero_gradient():
    x = np.array([[0.5, 1.0], [-np.inf, -np.inf]])
    with np.errstate(divide='ignore', invalid='ignore'):
        g = gd.grad(lambda x: ops.logsumexp(x, axis=-1)[0])(x)
    assert np.isfinite(g).all() and g[1].tolist() == [0.0, 0.0]
