"""The quick paths of a cached call and the compile-time rewrites of the graph notebook: the flat
cache key against the treedef it stands for, the generated unflattener against `tree_unflatten`,
`simplify` and the inlined transposes against the unsimplified graph and against finite
differences."""
from typing import NamedTuple
import itertools
import numpy as np
import pytest
import gradus as gd
from gradus.core import graph as G, codegen as CG, cache as CA, pytree as P, tensor as T, ops


class Pair(NamedTuple):
    a: object
    b: object


def _trees():
    f32, f64 = np.float32, np.float64
    z = lambda *s, d=f32: np.zeros(s, d)
    return [
        (z(2, 3),), (z(3, 2),), (z(2, 3, d=f64),), (z(6),), ([z(2, 3)],), ((z(2, 3),),),
        ({'w': z(2, 3)},), ({'v': z(2, 3)},), ({'w': z(2, 3), 'b': z(3)},),
        ({'b': z(3), 'w': z(2, 3)},),                         # same tree, other insertion order
        ({'w': [z(2), z(2)]},), ({'w': (z(2), z(2))},), ({'w': [z(2)], 'x': None},),
        ({'w': [z(2)], 'x': [None]},), (Pair(z(2), z(3)),), ((z(2), z(3)),), ([z(2), z(3)],),
        (1.0,), (1,), (True,), (np.float32(1.0),), (z(2), 2.0), (z(2), None), (None, z(2)),
        ({1: z(2), 2: z(3)},), ({1: z(2), 3: z(3)},), ([[]],), ([()],), ({},), ([],),
    ]


def _signature(tree):
    leaves, td = P.tree_flatten(tree)
    leaves = [G.as_leaf(x) for x in leaves]
    return td, tuple((x.shape, x.dtype) for x in leaves)


def test_flat_key_equal_exactly_when_treedef_shapes_and_dtypes_equal():
    keyed = []
    for t in _trees():
        leaves, key = [], []
        assert CA._flat_key(t, leaves, key)
        raw = P.tree_flatten(t)[0]
        ref = [G.as_leaf(x) for x in raw]
        assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in ref]
        assert all(a is r for a, r in zip(leaves, raw) if type(r) is np.ndarray)
        keyed.append((tuple(key), _signature(t)))
    for (k1, s1), (k2, s2) in itertools.combinations(keyed, 2):
        assert (k1 == k2) == (s1 == s2), (k1, k2)


def test_flat_key_reports_tracers_and_refuses_other_leaves():
    with G.Trace() as t:
        x = t.new_input((2,), np.float32)
        assert CA._flat_key(({'x': x},), [], []) is False
    with pytest.raises(TypeError, match="str"):
        CA._flat_key(('text',), [], [])
    with pytest.raises(TypeError, match="sortable"):
        CA._flat_key(({1: np.ones(1), 'a': np.ones(1)},), [], [])


def test_tree_unflattener_matches_tree_unflatten():
    deep = np.ones(1)
    for _ in range(60): deep = [deep]                            # beyond one expression's nesting
    trees = [t for t in _trees()] + [{'a': Pair([np.ones(1), None], {(1, 2): np.ones(2)})}, deep,
                                     np.ones(3)]
    for t in trees:
        leaves, td = P.tree_flatten(t)
        got, ref = P.tree_unflattener(td)(leaves), P.tree_unflatten(td, leaves)
        assert repr(got) == repr(ref) and P.tree_flatten(got)[1] == td
        assert all(a is b for a, b in zip(P.tree_flatten(got)[0], leaves))


def _mlp(p, x, y):
    h = T.tanh(x @ p['w1'] + p['b1'])
    return ops.mean((h @ p['w2'] + p['b2'] - y) ** 2)


def _mlp_args(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(dtype)
    return {'w1': f(3, 5), 'b1': f(5), 'w2': f(5, 2), 'b2': f(2)}, f(4, 3), f(4, 2)


def test_simplified_code_matches_the_graph_and_finite_differences():
    p, x, y = _mlp_args()
    vg = gd.value_and_grad(_mlp)
    entry, leaves = vg.lower(p, x, y)
    src = entry.compiled.source
    assert 'np.vdot(' in src and 'np.add.reduce' not in src and '.transpose(' not in src
    assert src.count('np.dot(c1, ') == 2 and '.T)' in src          # bias gradients; views inline
    ref = G.eval_graph(entry.graph, leaves)                          # the unsimplified graph
    got = entry.compiled.fn(*leaves)
    for a, b in zip(got, ref): np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert gd.check_grads(_mlp, (p, x, y)) <= 1
    v, g = vg(p, x, y)                                               # the quick path of __call__
    assert set(g) == set(p) and all(g[k].shape == p[k].shape for k in p)
    np.testing.assert_allclose(v, ref[0])


def test_simplify_keeps_sums_it_does_not_rewrite_and_second_derivatives():
    def f(x):
        s3 = T.sum(T.reshape(x, (2, 2, 3)), (0, 1), keepdims=True)  # 3-D: stays a sum
        s1 = T.sum(x, 1, keepdims=True)                              # over columns: stays
        sq = T.sum(x ** 2, 0)                                        # not over all axes: stays
        return T.sum(T.tanh(s3)) + T.sum(s1 * s1) + T.sum(sq * sq) + T.sum(x ** 2) ** 2
    x = np.random.default_rng(1).standard_normal((4, 3))
    g = CG.simplify(G.trace(f, x))
    names = [e.prim.name for e in g.eqns]
    assert names.count('sum_squares') == 1 and names.count('sum') >= 3
    assert gd.check_grads(f, (x,), order=2) <= 1       # grad(grad) replays the unsimplified graph


def test_row_sum_keepdims_and_reshape_merge():
    def f(ct): return T.sum(ct, 0, keepdims=True), T.reshape(T.sum(ct, 0, keepdims=True), (3,))
    ct = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = CG.simplify(G.trace(f, ct))
    assert [e.prim.name for e in g.eqns].count('matmul') == 2 and 'sum' not in str(g)
    a, b = G.eval_graph(g, [ct])
    assert a.shape == (1, 3) and b.shape == (3,)
    np.testing.assert_array_equal(b, ct.sum(0)); np.testing.assert_array_equal(a[0], ct.sum(0))


def test_transpose_inlined_only_when_read_once():
    def f(a, b):
        t = a.T                                                      # read twice: a line of its own
        u = b.T                                                      # read once: inlined
        return t @ b + t @ b, a @ u, b.T                             # an output: a line of its own
    a, b = np.ones((3, 2)), np.ones((3, 2))
    src = CG.compile_graph(G.trace(f, a, b)).source
    assert src.count(' = a.T') == 1 and 'np.dot(a, b.T)' in src and src.count(' = b.T') == 1
    out = gd.jit(f)(a, b)
    np.testing.assert_array_equal(out[0], 2 * a.T @ b)
    np.testing.assert_array_equal(out[1], a @ b.T)
    np.testing.assert_array_equal(out[2], b.T)


def test_scalar_arithmetic_and_dot_spellings_keep_dtypes():
    def f(x, s): return T.sum(x @ x.T) / s * 2.0 - 1.0
    for dt in (np.float32, np.float64):
        x = np.arange(6, dtype=dt).reshape(2, 3)
        got = gd.jit(f)(x, dt(3.0))
        want = ((x @ x.T).sum() / dt(3.0) * dt(2.0) - dt(1.0))
        assert np.asarray(got).dtype == dt and got == want
        src = gd.show_code(gd.jit(f), x, dt(3.0))
        assert 'np.dot(' in src and ' / ' in src


def test_python_scalar_arguments_take_the_compiled_path():
    vg = gd.value_and_grad(lambda x, s: T.sum(x * s))
    v, g = vg(np.ones(3, np.float32), 2.0)
    assert v == 6.0 and g.dtype == np.float32 and (g == 2.0).all()
    assert len(vg.cache) == 1
    vg(np.ones(3, np.float32), 3.0)
    assert len(vg.cache) == 1                                        # same signature: no retrace


def test_threads_trace_at_once():
    """Each thread has its own stack of traces: three threads tracing fresh `value_and_grad`s at the
    same time (a tiny switch interval to interleave them) all get the right gradients."""
    import sys, threading
    from gradus.core import ops
    errors, before = [], sys.getswitchinterval()
    def work(k):
        for _ in range(30):
            try:
                f = gd.value_and_grad(lambda w, x: ops.mean((x @ w) ** 2 + k))
                w, x = np.ones((3, 2)), np.arange(12.0).reshape(4, 3)
                assert np.allclose(f(w, x)[1], x.T @ (x @ w) / 4)
            except Exception as e: errors.append(repr(e))
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
    finally:
        sys.setswitchinterval(before)
    assert not errors, errors[:3]


def test_gradient_of_a_0d_parameter_is_a_0d_array():
    "As the parameter: `simplify` keeps the reshape to 0-d (numpy's full sum gives a scalar)."
    from gradus.core import ops
    vg = gd.value_and_grad(lambda p, x: ops.mean((x * p['s'] + p['w']) ** 2))
    _, g = vg({'s': np.array(2.0), 'w': np.ones(3)}, np.arange(3.0))
    assert type(g['s']) is np.ndarray and g['s'].shape == () and type(g['w']) is np.ndarray


def test_large_float32_sums_stay_numpys():
    """Beyond `BLAS_SUM_MAX` terms a sum of squares stays numpy's pairwise sum: over 2e6 float32
    values BLAS's float32 dot product is off by ~2e-6 relative, numpy's sum by ~1e-9."""
    x = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64) ** 2))
    got = float(gd.jit(lambda x: T.sum(x ** 2))(x))
    assert abs(got - exact) / exact < 1e-7


def test_outputs_never_share_the_callers_memory():
    """A compiled function copies an output that is a view of an argument (reshape, transpose,
    index, same-dtype cast, an aux of value_and_grad), as it copies an argument returned as is."""
    from gradus.core import ops
    w = np.arange(6.0).reshape(3, 2)
    fns = [lambda w: T.reshape(w, (6,)), lambda w: w.T, lambda w: w[0], lambda w: w,
           lambda w: T.cast(w, np.float64)]
    for f in fns:
        out = gd.jit(f)(w)
        assert not np.shares_memory(out, w)
    vg = gd.value_and_grad(lambda w: (ops.mean(w), T.reshape(w, (6,))), has_aux=True)
    (_, aux), _ = vg(w)
    assert not np.shares_memory(aux, w)


def test_negative_static_argnums_are_refused():
    for make in (gd.jit, gd.value_and_grad):
        with pytest.raises(ValueError, match='static_argnums must be ints >= 0'):
            make(lambda x, n: T.sum(x * n), static_argnums=-1)
