"""The transforms' contracts: caching, vjp/jvp consistency, aux and static arguments, tracer errors,
jit, show_code."""
from typing import NamedTuple
import numpy as np
import pytest
import gradus as gd
from gradus.core import tensor as T
from gradus.core import ops
from gradus.core import graph as GR
from gradus.errors import DTypeError
from gradus.errors import ShapeError

rng = np.random.default_rng(7)


def random_function(seed):
    "A random composition of differentiable ops from R^(3x4) x R^(4) to R^(3x2)."
    g = np.random.default_rng(seed)
    W = g.standard_normal((4, 2))
    unary = [T.tanh, T.sin, ops.sigmoid, lambda z: ops.gelu(z), lambda z: z * z, ops.softplus]
    fs = [unary[i] for i in g.integers(0, len(unary), 3)]
    def f(x, b):
        h = fs[0](x + b)
        h = fs[1](h) * T.exp(-0.1 * T.sum(x * x, axis=1, keepdims=True))
        return fs[2](h @ W)
    return f


@pytest.mark.parametrize('seed', range(12))
def test_jvp_vjp_dot_product(seed):
    """<u, J v> == <J^T u, v> for random functions, random u and v; and J v against central
    differences."""
    f = random_function(seed)
    x, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
    vx, vb = rng.standard_normal(x.shape), rng.standard_normal(b.shape)
    out, jv = gd.jvp(f, (x, b), (vx, vb))
    np.testing.assert_allclose(out, f(x, b))
    out2, f_vjp = gd.vjp(f, x, b)
    u = rng.standard_normal(out.shape)
    gx, gb = f_vjp(u)
    assert np.isclose(np.sum(u * jv), np.sum(gx * vx) + np.sum(gb * vb), rtol=1e-10)
    h = 1e-6
    fd = (f(x + h * vx, b + h * vb) - f(x - h * vx, b - h * vb)) / (2 * h)
    np.testing.assert_allclose(jv, fd, rtol=1e-6, atol=1e-8)


def test_cache_hits_and_misses():
    calls = []
    def f(w, x):
        calls.append(1)
        return T.sum(T.tanh(x @ w))
    vg = gd.value_and_grad(f)
    w, x = np.ones((3, 2), np.float32), np.ones((5, 3), np.float32)
    vg(w, x); vg(w, x * 2); vg(w + 1, x)
    assert len(calls) == 1 and len(vg.cache) == 1       # traced once, then cached
    vg(w, np.ones((7, 3), np.float32))                 # new shape: new entry
    vg(w.astype(np.float64), x.astype(np.float64))     # new dtype: new entry
    assert len(calls) == 3 and len(vg.cache) == 3


def test_cached_result_is_fresh_each_call():
    "Gradients that are constants (zeros) must not be shared buffers between calls."
    g = gd.grad(lambda w, v: T.sum(v * 2.0), argnums=(0, 1))
    a = g(np.ones(3), np.ones(3))[0]
    a += 5
    assert g(np.ones(3), np.ones(3))[0].tolist() == [0.0, 0.0, 0.0]


def test_has_aux_and_argnums_tuple():
    def f(a, b): return T.sum(a * b), {'prod': a * b}
    vg = gd.value_and_grad(f, argnums=(0, 1), has_aux=True)
    (v, aux), (ga, gb) = vg(np.full(2, 3.0), np.full(2, 4.0))
    assert v == 24 and aux['prod'].tolist() == [12, 12]
    assert ga.tolist() == [4, 4] and gb.tolist() == [3, 3]
    grads, aux = gd.grad(f, has_aux=True)(np.full(2, 3.0), np.full(2, 4.0))
    assert grads.tolist() == [4, 4]


def test_static_argnums():
    def f(x, n, training):
        y = x.reshape(n, -1)
        return T.sum(y * 2.0 if training else y)
    g = gd.grad(f, static_argnums=(1, 2))
    assert g(np.ones(6), 2, True).tolist() == [2.0] * 6
    assert g(np.ones(6), 3, False).tolist() == [1.0] * 6


def test_namedtuple_and_nested_params():
    class P(NamedTuple):
        w: np.ndarray
        layers: list
    p = P(np.ones(2), [{'a': np.ones(2)}, None])
    g = gd.grad(lambda p: T.sum(p.w * p.layers[0]['a'] * 3.0))(p)
    assert isinstance(g, P) and g.layers[1] is None and g.layers[0]['a'].tolist() == [3, 3]


def test_python_control_flow_on_tracer_is_a_clear_error():
    def f(x):
        if T.sum(x) > 0: return T.sum(x)
        return -T.sum(x)
    with pytest.raises(T.TracerError, match='where'):
        gd.grad(f)(np.ones(3))


def test_leaked_tracer_is_a_clear_error():
    leaked = []
    gd.grad(lambda x: (leaked.append(x), T.sum(x))[1])(np.ones(2))
    with pytest.raises(T.TracerError, match='leaked'):
        T.exp(leaked[0])


def test_vjp_checks_cotangent():
    out, f_vjp = gd.vjp(lambda x: x * 2.0, np.ones(3))
    with pytest.raises(ShapeError): f_vjp(np.ones(4))
    with pytest.raises(DTypeError): f_vjp(np.ones(3, np.float32))
    assert f_vjp(np.ones(3))[0].tolist() == [2, 2, 2]


def test_vjp_does_not_rerun_forward():
    calls = []
    def f(x):
        calls.append(1)
        return T.exp(x)
    out, f_vjp = gd.vjp(f, np.zeros(2))
    f_vjp(np.ones(2)); f_vjp(np.ones(2))
    assert len(calls) == 1


def test_closure_over_outer_tracer():
    """grad of a function whose inner grad closes over the outer variable: d/dx [d/dy (x*y^2)] at
    y=3 = 2y = 6."""
    def outer(x):
        inner = gd.grad(lambda y: x * y * y)
        return inner(np.array(3.0))
    assert gd.grad(outer)(np.array(2.0)) == pytest.approx(6.0)


def test_jit_matches_eager_and_caches():
    f = lambda p, x: ops.softmax(T.tanh(x @ p['w']), axis=-1)
    p, x = {'w': rng.standard_normal((3, 4))}, rng.standard_normal((5, 3))
    jf = gd.jit(f)
    np.testing.assert_allclose(jf(p, x), f(p, x), rtol=1e-12)
    jf(p, x)
    assert len(jf.cache) == 1


def test_show_code_is_what_runs():
    g = gd.grad(lambda x: T.sum(T.exp(x)))
    src = gd.show_code(g, np.ones(3))
    assert src.startswith('def value_and_grad(') and 'np.exp' in src
    entry, _ = g.lower(np.ones(3))
    assert entry.compiled.source == src
    plain = gd.show_code(lambda x: T.exp(x), np.ones(3))
    assert 'def vjp_fwd' in plain and 'def vjp_bwd' in plain


def test_dead_code_is_eliminated():
    "The gradient with respect to a constant exponent (out * log(x)) is never computed."
    src = gd.show_code(gd.grad(lambda x: T.sum(x ** 3.0)), -np.ones(3))
    assert 'np.log' not in src


def test_trace_prints_like_a_jaxpr():
    g = gd.trace(lambda x, w: T.tanh(x @ w), np.ones((2, 3), np.float32),
                 np.ones((3, 4), np.float32))
    text = repr(g)
    assert 'a:f32[2,3]' in text and 'matmul a b' in text and 'tanh' in text


def test_custom_vjp_runs_user_backward():
    seen = []
    @gd.custom_vjp
    def clip_grad(x): return x
    def fwd(x): return x, None
    def bwd(res, ct):
        seen.append(1)
        return (T.minimum(T.maximum(ct, -1.0), 1.0),)
    clip_grad.defvjp(fwd, bwd)
    g = gd.grad(lambda x: T.sum(clip_grad(x) * 5.0))(np.ones(3))
    assert g.tolist() == [1.0, 1.0, 1.0] and seen
    assert clip_grad(np.ones(2)).tolist() == [1.0, 1.0]


# --- contracts found by a newcomer's bug hunt ---

def test_argnums_forms():
    f = lambda a, b: T.sum(a * b * b)
    a, b = np.full(2, 3.0), np.full(2, 2.0)
    ga, gb = gd.grad(f, argnums=[0, 1])(a, b)                       # a list behaves as a tuple
    assert ga.tolist() == [4, 4] and gb.tolist() == [12, 12]
    assert gd.grad(f, argnums=-1)(a, b).tolist() == [12, 12]        # negative counts from the end
    with pytest.raises(ValueError, match='repeated'): gd.grad(f, argnums=(0, 0))
    with pytest.raises(ValueError, match='overlap'):
        gd.grad(lambda n, x: T.sum(x ** n), argnums=0, static_argnums=0)(2, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match='out of range'): gd.grad(f, argnums=2)(a, b)


def test_keyword_arguments_are_static():
    f = gd.value_and_grad(lambda x, scale=1.0: T.sum(x * x) * scale)
    v, g = f(np.ones(2), scale=3.0)
    assert v == 6 and g.tolist() == [6, 6]
    f(np.ones(2), scale=3.0); f(np.ones(2), scale=2.0)
    assert len(f.cache) == 2
    with pytest.raises(TypeError, match='hashable'): f(np.ones(2), scale={'a': 1})


def test_vjp_reads_closures_at_each_call():
    W = np.zeros(3)
    k = lambda x: x * W
    gd.vjp(k, np.ones(3))
    W = np.full(3, 4.0)
    out, f_vjp = gd.vjp(k, np.ones(3))
    assert out.tolist() == [4, 4, 4] and f_vjp(np.ones(3))[0].tolist() == [4, 4, 4]


def test_vjp_accepts_python_scalar_cotangent():
    out, f_vjp = gd.vjp(lambda x: T.sum(x * x), np.ones(2))
    assert f_vjp(1.0)[0].tolist() == [2, 2]


def test_custom_vjp_backward_shape_is_checked():
    f = gd.custom_vjp(lambda x: x * 2.0)
    f.defvjp(lambda x: (x * 2.0, None), lambda r, ct: (ct[:2],))
    with pytest.raises(ShapeError, match='bwd returned shape'):
        gd.grad(lambda x: T.sum(f(x)))(np.ones(3))


def test_numpy_functions_on_tracers():
    assert gd.grad(lambda x: np.sum(x * x))(np.ones(2)).tolist() == [2, 2]   # calls Tracer.sum
    with pytest.raises(T.TracerError, match='gradus.core.tensor'):
        gd.grad(lambda x: T.sum(np.asarray(x)))(np.ones(2))


def test_jit_output_never_aliases_an_input():
    x = np.zeros(3)
    y = gd.jit(lambda x: x)(x)
    y += 1
    assert x.tolist() == [0, 0, 0]


def test_check_grads_on_mixed_pytree():
    """A dict holding both float weights and integer ids: the ids are held constant, the weights
    checked."""
    f = lambda p: T.sum(ops.take(p['w'], p['ids'], axis=0) ** 2)
    assert gd.check_grads(f, ({'w': rng.standard_normal((4, 2)), 'ids': np.array([0, 3, 3])},)) <= 1


def test_graph_names_skip_keywords_and_np():
    "Short names run a..z, ba.. and are never a Python keyword or `np` (generated code uses them)."
    import keyword
    v = [GR.Var(i, (), 'float32') for i in range(800)]
    names = GR.Graph(v, [], []).names()
    vals = list(names.values())
    assert vals[:3] == ['a', 'b', 'c'] and 'ba' in vals and len(set(vals)) == 800
    assert not any(keyword.iskeyword(n) or n == 'np' for n in vals)
    assert 'in' not in vals and 'is' not in vals and 'np' not in vals


@pytest.mark.parametrize('f, args, ct, want', [
    # a gradient that does not depend on the cotangent (a zero constant), alone or beside others
    (lambda x: T.stop_gradient(x) * 2.0, (np.ones(3),), np.ones(3), (np.zeros(3),)),
    (lambda x: np.ones(3), (np.ones(3),), np.ones(3), (np.zeros(3),)),   # output ignores x
    (lambda x, y: y * 2.0, (np.ones(2), np.ones(3)), np.ones(3), (np.zeros(2), 2 * np.ones(3))),
    (lambda x, y: (T.stop_gradient(x) * 2.0, y), (np.ones(2), np.ones(3)),   # multiple outputs
     (np.ones(2), np.full(3, 4.0)), (np.zeros(2), np.full(3, 4.0))),
    (lambda x: (x * 2.0, T.stop_gradient(x)), (np.ones(3),), (np.ones(3), np.ones(3)),
     (2 * np.ones(3),)),
    (lambda x, y: (T.stop_gradient(x) * y, x), (np.full(3, 3.0), np.ones(3)),
     (np.ones(3), np.ones(3)), (np.ones(3), np.full(3, 3.0))),
    (lambda x: (x, x), (np.ones(3),), (np.full(3, 5.0), np.ones(3)), (np.full(3, 6.0),)),
])
def test_vjp_of_gradients_known_without_the_cotangent(f, args, ct, want):
    "The forward half returns the primal outputs only; a gradient known early stays the backward's."
    out, f_vjp = gd.vjp(f, *args)
    got = f_vjp(ct)
    assert len(got) == len(want)
    for g, w in zip(got, want): np.testing.assert_array_equal(g, w)
    _, jv = gd.jvp(f, args, tuple(np.ones_like(a) for a in args))   # double-VJP: the same split
    assert [np.shape(v) for v in gd.tree_leaves(jv)] == [np.shape(v) for v in gd.tree_leaves(out)]


def test_partial_eval_refuses_an_unknown_forward_output():
    from gradus.core.autograd import partial_eval
    g, *_ = GR.trace_flat(lambda x, c: x * c, gd.tree_flatten((1.0, 1.0))[1],
                          [((), np.float64, False)] * 2)
    with pytest.raises(ValueError, match="first 1 outputs"): partial_eval(g, [True, False], 1)


def test_python_scalar_argument_is_weak():
    "A Python float argument takes the dtype it meets, as it does outside a trace (no float32)."
    x64, x32 = np.arange(1.0, 4.0), np.arange(1.0, 4.0, dtype=np.float32)
    f = gd.jit(lambda x, s: x * s)
    assert f(x64, 1 / 3).dtype == np.float64
    np.testing.assert_array_equal(f(x64, 1 / 3), x64 * (1 / 3))         # to the last bit
    assert f(x32, 1 / 3).dtype == np.float32
    np.testing.assert_array_equal(f(x32, 1 / 3), x32 * (1 / 3))
    g = gd.jit(lambda x, s: x * (1 - s) * 2)                            # arithmetic on s alone
    np.testing.assert_array_equal(g(x64, 1 / 3), x64 * (1 - 1 / 3) * 2)
    assert g(x32, 0.25).dtype == np.float32
    i32 = np.arange(3, dtype=np.int32)
    assert gd.jit(lambda i, n: i + n)(i32, 2).dtype == np.int32          # a weak int too
    assert gd.jit(lambda s: s * 2.0)(1 / 3) == 2 / 3                     # weak alone: exact
    c = np.full(3, 3.0)                        # a float64 constant makes s * c strong float64,
    inner = gd.jit(lambda t: c * t)            # also when the inner graph is replayed in an outer
    assert gd.jit(lambda x, s: inner(s) * x)(x32, 0.5).dtype == np.float64


def test_python_scalar_argument_keys_by_kind_not_value():
    f = gd.jit(lambda x, s: x * s)
    for s in (0.5, 1 / 3, 2.0): f(np.ones(2), s)
    assert len(f.cache) == 1
    f(np.ones(2), 2); f(np.ones(2), np.float64(2.0))        # a weak int, a strong float64
    f(np.ones(2), np.float32(2.0))                          # a strong float32: not the weak float
    assert len(f.cache) == 4


def test_grad_of_python_float_argument_is_float64():
    g = gd.grad(lambda s: s * s)(1 / 3)
    assert g.dtype == np.float64 and g == 2 / 3
    (gx, gs) = gd.grad(lambda x, s: T.sum(x * s), argnums=(0, 1))(np.ones(2, np.float32), 0.5)
    assert gx.dtype == np.float32 and gs.dtype == np.float64 and gs == 2.0
    _, f_vjp = gd.vjp(lambda x, s: x * s, np.ones(2), 1 / 3)
    np.testing.assert_array_equal(f_vjp(np.ones(2))[0], np.full(2, 1 / 3))
    assert gd.grad(gd.grad(lambda s: s * s * s))(0.5) == 3.0             # nested: weak inside
