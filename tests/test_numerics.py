"""Numerical accuracy of the composite ops of `gradus.core.tensor` at extreme magnitudes, in their
tails
and with `-inf` entries (value and gradient, float32 and float64, against 50-digit mpmath
references), and the eager shape/dtype errors of every primitive (the same `ShapeError` and
`DTypeError` as under tracing). Issue 9, items 1 and 2 (the tensor side).

Errors are counted in units of the dtype's eps relative to the reference; a reference below the
smallest normal number is compared absolutely (against `tiny`). Elementwise ops are judged by the
error divided by `1 + κ`, κ the relative condition number of the function at the point (no
implementation can do better once an intermediate such as `x/√2` is rounded); the row ops get exact
inputs and are judged by the raw error, each gradient entry against the magnitude of the terms it is
the sum of."""
import math
import numpy as np
import pytest
import gradus as gd
from gradus.core import tensor as T
from gradus.core import ops
from gradus.errors import DTypeError
from gradus.errors import ShapeError

mpmath = pytest.importorskip('mpmath', reason='mpmath (dev extra) gives the 50-digit references')
mpmath.mp.dps = 50
mpf = mpmath.mpf
C, A = math.sqrt(2 / math.pi), 0.044715      # the tanh-GELU's constants (Hendrycks & Gimpel 2016)
DTYPES = [np.float32, np.float64]


# --- references, in 50-digit arithmetic ---------------------------------------------------------

def mp_sig(v): return 1 / (1 + mpmath.exp(-v))
def mp_v(v): return 2 * C * (v + A * v ** 3)     # tanh-GELU = x·sigmoid(v)


def mp_gelu_grad(v):
    s = mp_sig(mp_v(v))
    return s + v * s * mp_sig(-mp_v(v)) * 2 * C * (1 + 3 * A * v ** 2)


REF = {   # name -> (op, value, derivative)
    'sigmoid': (ops.sigmoid, mp_sig, lambda v: mp_sig(v) * mp_sig(-v)),
    'softplus': (ops.softplus, lambda v: mpmath.log1p(mpmath.exp(v)), mp_sig),
    'gelu': (ops.gelu, lambda v: v * mp_sig(mp_v(v)), mp_gelu_grad),
    'gelu_exact': (lambda x: ops.gelu(x, approximate=False),
                   lambda v: v / 2 * mpmath.erfc(-v / mpmath.sqrt(2)),
                   lambda v: mpmath.erfc(-v / mpmath.sqrt(2)) / 2 + v * mpmath.npdf(v)),
}


def kappa(f, v):
    "Relative condition number |v f'(v) / f(v)|, by a relative central difference in 50 digits."
    fv = f(v)
    if v == 0 or fv == 0 or not mpmath.isfinite(fv): return 0.0
    d = mpf('1e-20')
    return float(abs((f(v * (1 + d)) - f(v * (1 - d))) / (2 * d * fv)))


def err_eps(got, ref, dt, scale=None):
    "|got − ref| in units of eps·max(|ref|, tiny), or of eps·scale; 0 when equal (infinities too)"
    got = mpf(float(got))
    if got == ref: return 0.0
    if not mpmath.isfinite(got) or not mpmath.isfinite(ref): return math.inf
    fi = np.finfo(dt)
    scale = max(abs(ref) if scale is None else scale, mpf(float(fi.tiny)))
    return float(abs(got - ref) / scale / float(fi.eps))


# --- elementwise composites ---------------------------------------------------------------------

MAGNITUDES = [1.0, 1e4, 1e8, 1e30]
TAILS = {np.float32: [-5.0, -12.0, -20.0, -30.0, -60.0, -80.0, -87.0],    # results tiny but normal
         np.float64: [-12.0, -30.0, -40.0, -100.0, -300.0, -700.0]}
POINTS = {dt: sorted({s * m for m in MAGNITUDES for s in (-1, 1)} | set(TAILS[dt])
                     | {0.0, -0.5, 0.5, 2.0, 6.0, -3.0, 12.0}) for dt in DTYPES}


def elementwise(name, dt):
    "Per point: (x, value error / (1 + κ), gradient error / (1 + κ'))."
    op, ref_v, ref_g = REF[name]
    x = np.array(POINTS[dt], dt)
    val, g = op(x), gd.grad(lambda x: T.sum(op(x)))(x)
    assert val.dtype == dt and g.dtype == dt
    out = []
    for xi, a, b in zip(x.tolist(), val, g):
        v = mpf(xi)
        out.append((xi, err_eps(a, ref_v(v), dt) / (1 + kappa(ref_v, v)),
                    err_eps(b, ref_g(v), dt) / (1 + kappa(ref_g, v))))
    return out


@pytest.mark.parametrize('dt', DTYPES, ids=['float32', 'float64'])
@pytest.mark.parametrize('name', list(REF))
def test_elementwise_relative_accuracy(name, dt):
    bad = [(x, round(ev, 1), round(eg, 1)) for x, ev, eg in elementwise(name, dt)
           if ev > 4 or eg > 8]
    assert not bad, f"{name} {np.dtype(dt).name}: (x, value err, grad err) in eps/(1 + κ): {bad}"


def test_sigmoid_tails_issue_cases():
    "Issue 9: ½(1 + tanh(x/2)) gave 0 at x = −40 (float64), a 8e-4 relative error at −12 (float32)."
    exact40 = float(mp_sig(mpf(-40)))
    assert abs(float(ops.sigmoid(np.float64(-40.0))) / exact40 - 1) < 4 * np.finfo(np.float64).eps
    exact12 = float(mp_sig(mpf(-12)))
    assert abs(float(ops.sigmoid(np.float32(-12.0))) / exact12 - 1) < 2 * np.finfo(np.float32).eps
    assert np.isfinite(T.log(ops.sigmoid(np.float64(-700.0))))         # log(sigmoid) no longer -inf
    g = gd.grad(lambda x: ops.sigmoid(x))(np.float64(-40.0))
    assert abs(g / exact40 - 1) < 8 * np.finfo(np.float64).eps


def test_gelu_negative_tail_is_not_zero():
    "GELU(−10) is about −7.6e-23 (exact), −1.2e-37 (tanh form); `1 + erf`, `1 + tanh` returned 0."
    x = np.array([-10.0])
    exact = float(REF['gelu_exact'][1](mpf(-10)))
    assert ops.gelu(x, approximate=False)[0] == pytest.approx(exact, rel=1e-13)
    assert ops.gelu(x)[0] == pytest.approx(float(REF['gelu'][1](mpf(-10))), rel=1e-13)
    assert ops.gelu(x.astype(np.float32))[0] < 0 and ops.gelu_tanh_reference(x)[0] < 0


@pytest.mark.parametrize('dt', DTYPES + [np.float16], ids=['float32', 'float64', 'float16'])
def test_infinities_and_saturation(dt):
    "±inf and huge inputs give the limits, never NaN or a warning, in value and gradient."
    big = 6e4 if dt == np.float16 else 1e30
    x = np.array([-np.inf, -big, 0.0, big, np.inf], dt)
    limits = {'sigmoid': ([0, 0, 0.5, 1, 1], [0, 0, 0.25, 0, 0]),
              'softplus': ([0, 0, math.log(2), float(x[3]), np.inf], [0, 0, 0.5, 1, 1]),
              'gelu': ([0, 0, 0, float(x[3]), np.inf], [0, 0, 0.5, 1, 1]),
              'gelu_exact': ([0, 0, 0, float(x[3]), np.inf], [0, 0, 0.5, 1, 1])}
    with np.errstate(all='raise', under='ignore'):
        for name, (val, der) in limits.items():
            op = REF[name][0]
            got_v, got_g = op(x), gd.grad(lambda x: T.sum(op(x)))(x)
            np.testing.assert_allclose(got_v.astype(np.float64), val, rtol=1e-3, err_msg=name)
            np.testing.assert_allclose(got_g.astype(np.float64), der, rtol=1e-3, err_msg=name)


# --- row composites: logsumexp, softmax, log_softmax --------------------------------------------

def rows(dt):
    tail = -80.0 if dt == np.float32 else -700.0
    out = [[m, m] for m in MAGNITUDES] + [[-m, -m] for m in MAGNITUDES[1:]]
    out += [[m, m / 2, -m] for m in MAGNITUDES] + [[m, m * (1 - 2 ** -10), 0.0] for m in MAGNITUDES]
    out += [[m, -np.inf, m / 4] for m in MAGNITUDES] + [[-np.inf, m, -np.inf] for m in MAGNITUDES]
    out += [[0.0, tail, -1.0], [tail, 0.0, tail / 2]]
    return out


def mp_row(name, row, w):
    """Value and gradient of Σ w·f(row) in 50 digits, and the magnitude of the terms each gradient
    entry is made of (the accuracy a VJP forming Jᵀw can have: `p(w − Σwp)` cancels if p ≈ 1)."""
    row = [mpf(float(v)) for v in row]
    with mpmath.workdps(400):               # log(1 + 1e-304) needs ~350 digits to come out right
        m = max(row)
        lse = m + mpmath.log(sum(mpmath.exp(v - m) for v in row if v != -mpmath.inf))
    p = [mpmath.exp(v - lse) for v in row]
    aw = [abs(a) for a in w]
    if name == 'logsumexp': return [lse], p, p
    if name == 'log_softmax':
        return ([v - lse for v in row], [a - b * sum(w) for a, b in zip(w, p)],
                [a + b * sum(aw) for a, b in zip(aw, p)])
    pw, paw = sum(a * b for a, b in zip(w, p)), sum(a * b for a, b in zip(aw, p))
    return p, [b * (a - pw) for a, b in zip(w, p)], [b * (a + paw) for a, b in zip(aw, p)]


ROW_OPS = {'logsumexp': ops.logsumexp, 'softmax': ops.softmax, 'log_softmax': ops.log_softmax}


@pytest.mark.parametrize('dt', DTYPES, ids=['float32', 'float64'])
@pytest.mark.parametrize('name', list(ROW_OPS))
def test_row_ops_relative_accuracy(name, dt):
    f = ROW_OPS[name]
    g_of = gd.grad(lambda x, w: T.sum(T.reshape(f(x), (-1,)) * w))
    bad = []
    for row in rows(dt):
        x = np.array(row, dt)
        w = [1.0, -0.5, 0.25][:len(row)] if name != 'logsumexp' else [1.0]
        rv, rg, terms = mp_row(name, x, [mpf(v) for v in [1.0, -0.5, 0.25][:len(row)]])
        got_v, got_g = np.atleast_1d(f(x)), g_of(x, np.array(w, dt))
        ev = max(err_eps(a, b, dt) for a, b in zip(got_v, rv))
        eg = max(err_eps(a, b, dt, t) for a, b, t in zip(got_g, rg, terms))
        if ev > 4 or eg > 8: bad.append((row, round(ev, 1), round(eg, 1)))
    assert not bad, f"{name} {np.dtype(dt).name}: (row, value err, grad err) in eps: {bad}"


@pytest.mark.parametrize('big', [1e4, 1e6, 1e8, 1e30])
def test_log_softmax_two_equal_float32_logits(big):
    "Issue 9: z − logsumexp(z) gave a cross-entropy of 0.693359 at 1e4, 0.6875 at 1e6, 0 at 1e8."
    z = np.full((1, 2), big, np.float32)
    assert ops.log_softmax(z)[0, 0] == np.float32(-math.log(2))
    ce = gd.value_and_grad(lambda z: -ops.log_softmax(z)[0, 0])(z)
    assert ce[0] == np.float32(math.log(2)) and np.allclose(ce[1], [[-0.5, 0.5]])


def test_row_ops_all_minus_inf_row():
    "A fully masked row: logsumexp −inf; softmax and log_softmax have no distribution (NaN)."
    x = np.array([[0.5, 1.0], [-np.inf, -np.inf]])
    with np.errstate(divide='ignore', invalid='ignore'):
        assert ops.logsumexp(x)[1] == -np.inf           # its zero gradient: tests/test_gradcheck.py
        assert np.isnan(ops.log_softmax(x)[1]).all() and np.isnan(ops.softmax(x)[1]).all()
        assert np.allclose(np.exp(ops.log_softmax(x)[0]), ops.softmax(x)[0])


# --- eager shape and dtype errors (issue 9, item 2) ---------------------------------------------

o = np.ones
BAD = {   # primitive name -> (a call that reaches it, operands its rule refuses)
    'add': (T.add, o((2, 3)), o(4)), 'subtract': (T.subtract, o((2, 3)), o(2)),
    'multiply': (T.multiply, o((2, 3)), o((3, 2))), 'divide': (T.divide, o((2, 3)), o(2)),
    'power': (T.power, o((2, 3)), o((3, 1))), 'maximum': (T.maximum, o((2, 3)), o(2)),
    'minimum': (T.minimum, o((2, 3)), o(2)), 'less': (T.less, o((2, 3)), o(2)),
    'less_equal': (T.less_equal, o(3), o(2)), 'greater': (T.greater, o(3), o(2)),
    'greater_equal': (T.greater_equal, o(3), o(2)), 'equal': (T.equal, o(3), o(2)),
    'not_equal': (T.not_equal, o(3), o(2)), 'where': (T.where, o((2, 3), bool), o(2), o(3)),
    'matmul': (T.matmul, o((2, 3)), o((4, 5))),
    'concatenate': (lambda a, b: ops.concatenate([a, b]), o((2, 3)), o((2, 4))),
    'reshape': (lambda a: T.reshape(a, (4,)), o((2, 3))),
    'transpose': (lambda a: T.transpose(a, (0, 0)), o((2, 3))),
    'broadcast_to': (lambda a: T.broadcast_to(a, (3,)), o(2)),
    'sum': (lambda a: T.sum(a, 2), o((2, 3))), 'max': (lambda a: T.max(a, 0), o((0, 3))),
    'take': (lambda a, i: ops.take(a, i), o((2, 3)), o(2, np.float32)),
    'getitem': (lambda a: ops.getitem(a, np.array([True, False])), o((2, 3))),
    'cast': (lambda a: T.cast(a, np.complex64), o(2)),
}
# the rules themselves, bound directly with operands the ops never pass (two dtypes, float cond)
BAD_BIND = {
    'add': (T.add_p.bind, o(3, np.float32), o(3)),
    'less': (T.less_p.bind, o(3, np.float32), o(3)),
    'matmul': (T.matmul_p.bind, o((2, 3), np.float32), o((3, 2))),
    'where': (T.where_p.bind, o(3), o(3), o(3)),
    'concatenate': (lambda a, b: ops.concatenate_p.bind(a, b, axis=0), o(3, np.float32), o(3)),
    'take': (lambda a, i: ops.take_p.bind(a, i, axis=0), o(3), o(2)),
}
# no operands of a single dtype and shape can be refused: one operand, any shape (elementwise, or a
# reduction/movement whose parameters the op validates before binding: covered by BAD above)
NOTHING_TO_REFUSE = {'negative', 'exp', 'log', 'log1p', 'sin', 'cos', 'tanh', 'sqrt', 'absolute',
                     'erf', 'erfc', 'sign', 'isfinite', 'stop_gradient', 'index_put', 'scatter_add',
                     'gelu_tanh', 'gelu_grad', 'silu', 'silu_grad'}


def error_of(f, *args):
    try: f(*args)
    except Exception as e: return type(e).__name__, str(e)
    return 'ok', ''


def traced_error(f, *args):
    return error_of(lambda *a: gd.trace(f, *a), *args)


def test_every_primitive_is_in_the_error_sweep():
    names = {p.name for p in ops.PRIMITIVES}
    assert names == set(BAD) | NOTHING_TO_REFUSE, names ^ (set(BAD) | NOTHING_TO_REFUSE)


@pytest.mark.parametrize('name', list(BAD))
def test_eager_error_is_the_traced_error(name):
    f, *args = BAD[name]
    eager, traced = error_of(f, *args), traced_error(f, *args)
    assert eager[0] in ('ShapeError', 'DTypeError', 'TypeError'), eager
    assert eager == traced


@pytest.mark.parametrize('name', list(BAD_BIND))
def test_eager_bind_applies_the_rule(name):
    f, *args = BAD_BIND[name]
    eager, traced = error_of(f, *args), traced_error(f, *args)
    assert eager[0] in ('ShapeError', 'DTypeError') and eager == traced, (eager, traced)


def test_issue_matmul_example():
    "Issue 9's call: numpy's ValueError about gufunc signatures before; now ShapeError, 2 shapes."
    with pytest.raises(ShapeError, match=r"matmul: incompatible shapes \(2, 3\) and \(4, 5\)"):
        T.matmul(np.ones((2, 3)), np.ones((4, 5)))
    with pytest.raises(ShapeError, match=r"\(2, 3, 4\) and \(3, 4, 5\)"):
        T.matmul(np.ones((2, 3, 4)), np.ones((3, 4, 5)))
    with pytest.raises(ShapeError, match=r"add: incompatible shapes \(64, 10\) and \(64,\)"):
        T.add(np.ones((64, 10)), np.ones(64))
    with pytest.raises(DTypeError, match='float32 and float64'):
        T.add_p.bind(np.ones(2, np.float32), np.ones(2))


def _valid_cases():
    "One valid call per primitive (the notebook's dot-product cases plus the rest)."
    r = np.random.default_rng(0).standard_normal
    return [(T.add_p, (r((4, 3)), r(3)), {}), (T.subtract_p, (r((4, 1)), r((1, 5))), {}),
            (T.multiply_p, (r(3), r(3)), {}), (T.divide_p, (r(3), r((2, 3))), {}),
            (T.power_p, (np.abs(r(3)), r(3)), {}), (T.maximum_p, (r(2), r(2)), {}),
            (T.minimum_p, (r(2), r((3, 1))), {}), (T.where_p, (r(3) > 0, r(3), r((2, 1))), {}),
            (T.matmul_p, (r((2, 1, 4, 5)), r((3, 5, 6))), {}),
            (T.matmul_p, (r(5), r((2, 5, 3))), {}),
            (T.matmul_p, (r((2, 3, 4)), r((4, 6))), {}),
            (T.sum_p, (r((3, 4)),), dict(axis=(1,), keepdims=False)),
            (T.max_p, (r((3, 4)),), dict(axis=(0, 1), keepdims=True)),
            (T.reshape_p, (r((3, 4)),), dict(shape=(2, 6))),
            (T.transpose_p, (r((2, 3, 4)),), dict(axes=(2, 0, 1))),
            (T.broadcast_to_p, (r((3, 1)),), dict(shape=(2, 3, 4))),
            (T.cast_p, (r(3),), dict(dtype=np.dtype(np.float32))),
            (ops.getitem_p, (r((5, 4)),), dict(idx=(slice(1, 4), None, -1))),
            (ops.index_put_p, (r((3, 4)),), dict(idx=(slice(1, 4),), shape=(6, 4))),
            (ops.take_p, (r((5, 3)), np.array([[0, 2], [2, 2]])), dict(axis=0)),
            (ops.scatter_add_p, (r((2, 2, 3)), np.array([[0, 4], [4, 4]])),
             dict(axis=0, shape=(5, 3))),
            (ops.concatenate_p, (r((2, 3)), r((4, 3))), dict(axis=0))] + \
           [(p, (r((2, 3)), r(3)), {}) for p in (T.less_p, T.less_equal_p, T.greater_p,
                                                 T.greater_equal_p, T.equal_p,
                                                 T.not_equal_p)] + \
           [(p, (np.abs(r((2, 3))) + 0.5,), {})
             for p in ops.PRIMITIVES if p.name in NOTHING_TO_REFUSE
            and p.name not in ('index_put', 'scatter_add')]


def test_rule_agrees_with_the_eager_result_for_every_primitive():
    "On valid operands the rule's (shape, dtype) is exactly what the implementation returns."
    cases = _valid_cases()
    assert {p.name for p, _, _ in cases} == {p.name for p in ops.PRIMITIVES}
    for prim, args, params in cases:
        out = prim.bind(*args, **params)
        assert prim.abstract(*args, **params) == (out.shape, out.dtype), prim


def test_compiled_code_never_binds(monkeypatch):
    """The eager rule check lives in `Primitive.bind`; a cached `value_and_grad` runs generated
    numpy code and must not reach `bind` (or any rule) at all, so the check costs it nothing."""
    calls = []
    bind = T.Primitive.bind
    def counting_bind(self, *args, **params):
        calls.append(self)
        return bind(self, *args, **params)
    monkeypatch.setattr(T.Primitive, 'bind', counting_bind)
    vg = gd.value_and_grad(lambda w, x: ops.mean(T.tanh(x @ w) ** 2))
    w, x = np.ones((3, 2), np.float32), np.ones((4, 3), np.float32)
    vg(w, x)                                   # trace and compile: binds every primitive
    assert calls
    calls.clear()
    vg(w, x)
    assert calls == []


# ---------- layer norm and RMS norm at extreme magnitudes (issue 9, item 1) ----------
def _ln64(x, eps):
    "float64 LayerNorm written out: (x − mean) / √(var + eps), unit scale, no bias."
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + eps)


def _ln64_vjp(x, eps, g):
    "Its cotangent: (g − mean(g) − ŷ·mean(g·ŷ)) / σ, from differentiating the formula by hand."
    d = x - x.mean(-1, keepdims=True)
    sigma = np.sqrt((d * d).mean(-1, keepdims=True) + eps)
    y = d / sigma
    return (g - g.mean(-1, keepdims=True) - y * (g * y).mean(-1, keepdims=True)) / sigma


def _rms64(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rms64_vjp(x, eps, g):
    "(g − ŷ·mean(g·x)/r) / r with r = √(mean(x²) + eps), by hand."
    r = np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return (g - x * (g * x).mean(-1, keepdims=True) / r**2) / r


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('mag', [1.0, 1e4, 1e8, 1e30])
@pytest.mark.parametrize('which', ['layer_norm', 'rms_norm'])
def test_norms_keep_relative_accuracy_at_every_magnitude(which, mag, dtype):
    "norm(m·x, eps) = norm(x, eps/m²), and its gradient is (1/m)·∇norm(x, eps/m²): no m² needed."
    from gradus.learn import nn
    import gradus as gd
    base = np.random.default_rng(3).standard_normal((3, 16)) + 0.5
    fn, ref, vjp, eps = ((nn.layer_norm, _ln64, _ln64_vjp, 1e-5) if which == 'layer_norm'
                         else (nn.rms_norm, _rms64, _rms64_vjp, 1e-6))
    p = {'scale': np.ones(16, dtype)}
    if which == 'layer_norm': p['bias'] = np.zeros(16, dtype)
    x = (base * mag).astype(dtype)
    g = np.random.default_rng(4).standard_normal((3, 16))
    y, pull = gd.vjp(lambda x: fn(p, x, eps=eps), x)
    want_y, want_dx = ref(base, eps / mag**2), vjp(base, eps / mag**2, g) / mag
    tol = 2e-6 if dtype == np.float32 else 1e-13
    assert np.max(np.abs(y - want_y)) <= tol * np.abs(want_y).max()
    dx = pull(g.astype(dtype))[0]
    assert np.max(np.abs(dx - want_dx)) <= tol * np.abs(want_dx).max() * 10
