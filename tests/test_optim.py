"""Optimizers against updates written out here, schedules at their landmarks, clipping, and the
errors."""
import math
import numpy as np
import pytest
import gradus as gd
from gradus.learn import optim
from gradus.errors import DTypeError
from gradus.errors import ShapeError

G = [np.array([0.5, -1.0]), np.array([0.25, 2.0]), np.array([-1.0, 0.0]), np.array([0.1, 0.3])]


def run(opt, p, grads):
    s = opt.init(p); out = []
    for g in grads:
        p, s = opt.update(g, s, p); out.append(p)
    return out, s


@pytest.mark.parametrize('nesterov', [False, True])
def test_sgd_momentum_by_hand(nesterov):
    out, s = run(optim.sgd(0.1, momentum=0.9, nesterov=nesterov), np.array([1.0, 2.0]), G)
    p, buf = np.array([1.0, 2.0]), np.zeros(2)
    for g, got in zip(G, out):
        buf = 0.9 * buf + g
        p = p - 0.1 * (g + 0.9 * buf if nesterov else buf)
        np.testing.assert_allclose(got, p, rtol=1e-15)
    assert int(s['step']) == 4


def test_sgd_plain_and_weight_decay():
    out, s = run(optim.sgd(0.5, weight_decay=0.1), {'w': np.array([2.0, 0.0])},
                 [{'w': g} for g in G[:1]])
    np.testing.assert_allclose(out[0]['w'], [2.0 - 0.5 * (0.5 + 0.2), 0.5])
    assert set(s) == {'step'}


def test_adamw_by_hand_with_mask_and_schedule():
    sched = lambda t: 0.1 / (t + 1)
    params = {'w': np.array([[1.0, -2.0]]), 'b': np.array([0.5, 0.5])}
    opt = optim.adamw(sched, betas=(0.5, 0.75), eps=1e-3, weight_decay=0.2, mask=optim.decay_mask)
    grads = [{'w': g[None, :], 'b': g[::-1].copy()} for g in G]
    out, s = run(opt, params, grads)
    for name, decays in (('w', True), ('b', False)):
        p = params[name].ravel().copy(); m = np.zeros_like(p); v = np.zeros_like(p)
        for t, g in enumerate(grads, start=1):
            g = g[name].ravel()
            m = 0.5 * m + 0.5 * g; v = 0.75 * v + 0.25 * g * g
            upd = (m / (1 - 0.5 ** t)) / (np.sqrt(v / (1 - 0.75 ** t)) + 1e-3)
            upd = upd + (0.2 * p if decays else 0)
            p = p - sched(t - 1) * upd
            np.testing.assert_allclose(out[t - 1][name].ravel(), p, rtol=1e-14)
    assert int(s['step']) == 4 and s['mu']['w'].shape == (1, 2)


def test_decoupled_decay_only_on_masked_leaves():
    params = {'w': np.ones((2, 2)), 'b': np.ones(2)}
    zero = gd.tree_map(np.zeros_like, params)
    out, _ = run(optim.adamw(0.1, weight_decay=0.5, mask=optim.decay_mask), params, [zero])
    np.testing.assert_allclose(out[0]['w'], 1 - 0.1 * 0.5)
    np.testing.assert_array_equal(out[0]['b'], 1.0)
    out, _ = run(optim.adamw(0.1, weight_decay=0.5), params,
                 [zero])          # default: every leaf decays
    np.testing.assert_allclose(out[0]['b'], 0.95)
    out, _ = run(optim.adamw(0.1, weight_decay=0.5, mask={'w': False, 'b': True}), params, [zero])
    np.testing.assert_array_equal(out[0]['w'], 1.0)


def adam_reference(p0, grads, lr, b1, b2, eps):
    """Adam as Kingma & Ba (2015) Algorithm 1 writes it, one scalar at a time in plain Python floats
    (no numpy, no gradus): the trajectory of every coordinate."""
    out = []
    for i, theta in enumerate(p0):
        m = v = 0.0; traj = []
        for t, g in enumerate(grads, start=1):
            g = float(g[i])
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            theta = theta - lr * m_hat / (math.sqrt(v_hat) + eps)
            traj.append(theta)
        out.append(traj)
    return np.array(out).T          # (steps, coordinates)

@pytest.mark.parametrize('betas,eps', [((0.9, 0.999), 1e-8), ((0.5, 0.75), 1e-3)])
def test_adam_against_a_hand_written_reference(betas, eps):
    """`optim.adam` follows the paper's algorithm step by step (and applies no weight decay); the
    reference shares no code with gradus."""
    p0 = [1.0, -1.0]
    got, s = run(optim.adam(0.01, betas=betas, eps=eps), np.array(p0), G)
    want = adam_reference(p0, G, 0.01, *betas, eps)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-13, atol=1e-15)
    assert int(s['step']) == len(G)


@pytest.mark.parametrize('make',
                         [lambda: optim.sgd(0.1, momentum=0.9),
                          lambda: optim.adamw(optim.cosine_decay(1e-2, 10))])
def test_float32_stays_float32(make):
    p = {'w': np.ones((3, 2), np.float32), 'b': np.zeros(2, np.float32)}
    opt = make(); s = opt.init(p)
    for _ in range(3):
        p, s = opt.update(gd.tree_map(lambda a: np.full_like(a, 0.3), p), s, p)
    moments = s['mu'] if 'mu' in s else s['momentum']
    assert all(leaf.dtype == np.float32 for leaf in gd.tree_leaves((p, moments)))



@pytest.mark.parametrize('make', [lambda: optim.sgd(0.1, momentum=0.9),
                                  lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
                                  lambda: optim.adamw(1e-2), lambda: optim.adam(1e-2)])
def test_float64_state_keeps_a_float32_parameter_float32(make):
    """A state kept in float64 (made from float64 parameters, or loaded so) does not promote a
    float32 parameter: the update keeps each parameter's dtype, the state keeps its own, and
    the parameter is the float64 step rounded to float32 (AdamW's decay term `wd · p` is
    float32's own product: within float32 rounding)."""
    p32 = {'w': np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}
    g32 = {'w': np.linspace(0.5, -0.3, 6, dtype=np.float32).reshape(2, 3)}
    f64 = lambda t: gd.tree_map(lambda a: a.astype(np.float64), t)
    opt = make(); s64 = opt.init(f64(p32))
    p, s = opt.update(g32, s64, p32)
    assert p['w'].dtype == np.float32, p['w'].dtype
    assert all(leaf.dtype == np.float64 for k, sub in s.items() if k != 'step'
               for leaf in gd.tree_leaves(sub))
    want, _ = opt.update(f64(g32), s64, f64(p32))
    np.testing.assert_allclose(p['w'], want['w'].astype(np.float32), rtol=2e-7)

def test_update_refuses_mismatched_gradients():
    opt = optim.adamw(0.1); p = {'w': np.ones((2, 2), np.float32)}; s = opt.init(p)
    with pytest.raises(ShapeError, match="w has shape"):
        opt.update({'w': np.ones((2, 1), np.float32)}, s, p)
    with pytest.raises(DTypeError, match="float64"): opt.update({'w': np.ones((2, 2))}, s, p)
    with pytest.raises(ShapeError, match="tree"):
        opt.update({'v': np.ones((2, 2), np.float32)}, s, p)


def test_bad_hyperparameters():
    for bad in (lambda: optim.sgd(-1.0), lambda: optim.sgd(0.1, momentum=1.0),
                lambda: optim.sgd(0.1, nesterov=True),
                lambda: optim.adamw(0.1, betas=(0.9, 1.0)), lambda: optim.adamw(0.1, eps=-1.0),
                lambda: optim.adamw(float('nan')), lambda: optim.adamw(0.1, weight_decay=-0.1),
                lambda: optim.warmup_cosine(1.0, 10, 10), lambda: optim.linear_warmup(1.0, 0),
                lambda: optim.warmup_cosine(1.0, 1, 10, floor=2.0)):
        with pytest.raises(ValueError): bad()


def test_schedules():
    assert optim.constant(0.3)(12345) == 0.3
    w = optim.linear_warmup(1.0, 4)
    assert [w(t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    c = optim.cosine_decay(1.0, 10, floor=0.1)
    assert (c(0) == 1.0 and math.isclose(c(5), 0.55) and math.isclose(c(10), 0.1)
            and math.isclose(c(99), 0.1))
    s = optim.warmup_cosine(2.0, 5, 25, floor=0.2)
    assert (s(0) == 0.4 and s(4) == 2.0 and s(5) == 2.0 and math.isclose(s(15), 1.1)
            and math.isclose(s(25), 0.2))
    vals = [s(t) for t in range(5, 40)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_schedule_drives_the_update():
    out, _ = run(optim.sgd(lambda t: [1.0, 10.0][t]), np.array([0.0]),
                 [np.array([1.0]), np.array([1.0])])
    np.testing.assert_array_equal([o[0] for o in out], [-1.0, -11.0])


def test_clip_by_global_norm():
    g = {'a': np.array([3.0], np.float32), 'b': [np.array([[4.0]], np.float32)]}
    c, n = optim.clip_by_global_norm(g, 2.5)
    assert (n == 5.0 and c['a'][0] == np.float32(1.5) and c['b'][0][0, 0] == np.float32(2.0)
            and c['a'].dtype == np.float32)
    c, n = optim.clip_by_global_norm(g, 10.0)
    assert c is g and n == 5.0
    z = gd.tree_map(np.zeros_like, g)
    c, n = optim.clip_by_global_norm(z, 1.0)
    assert n == 0.0 and all(np.all(l == 0) and np.isfinite(l).all() for l in gd.tree_leaves(c))
    big = {'a': np.full(4, 1e20, np.float32)}          # float32 sum of squares would overflow
    c, n = optim.clip_by_global_norm(big, 1.0)
    assert math.isclose(n, 2e20, rel_tol=1e-6) and np.allclose(c['a'], 0.5)


@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_clip_refuses_non_finite(bad):
    g = {'layers': [{'w': np.ones(3)}, {'w': np.array([1.0, bad, 2.0])}]}
    with pytest.raises(optim.NonFiniteError, match=r"layers\.1\.w contains"):
        optim.clip_by_global_norm(g, 1.0)
    with pytest.raises(ValueError): optim.clip_by_global_norm({'w': np.ones(2)}, 0.0)


@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_adamw_update_equals_the_numpy_step_bit_for_bit(dtype):
    """The one-pass kernel (float32/float64, contiguous or not) and the numpy path (float16) give
    exactly what `adamw_leaf_reference` gives leaf by leaf, at steps 1 and 2."""
    r = np.random.default_rng(1)
    params = {'w': r.standard_normal((7, 5)).astype(dtype),
              'wt': r.standard_normal((5, 6)).astype(dtype).T,           # not contiguous
              'b': r.standard_normal(5).astype(dtype)}
    opt = optim.adamw(lambda t: [3e-3, 1e-3][t], betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2,
                      mask=optim.decay_mask)
    state, p = opt.init(params), params
    m = {k: np.zeros_like(v) for k, v in params.items()}; v_ = dict(m)
    for t in range(2):
        g = {k: r.standard_normal(x.shape).astype(dtype) for k, x in params.items()}
        p_new, state = opt.update(g, state, p)
        for k in params:
            hyper = (0.8, 0.95, 1 - 0.8 ** (t + 1), 1 - 0.95 ** (t + 1), 1e-6,
                     0.2 if p[k].ndim >= 2 else 0.0, [3e-3, 1e-3][t])
            want_p, m[k], v_[k] = optim.adamw_leaf_reference(p[k], g[k], m[k], v_[k], *hyper)
            assert p_new[k].dtype == dtype and np.array_equal(p_new[k], want_p), (k, t)
            assert np.array_equal(state['mu'][k], m[k]) and np.array_equal(state['nu'][k], v_[k])
        p = p_new


def test_global_norm_against_fsum_and_float64_overflow():
    r = np.random.default_rng(2)
    tree = {'a': r.standard_normal((300, 7)).astype(np.float32), 'b': [r.standard_normal(11) * 1e3]}
    exact = math.sqrt(math.fsum(float(v) ** 2 for leaf in gd.tree_leaves(tree)
                                for v in np.asarray(leaf, np.float64).ravel()))
    assert optim.global_norm(tree) == pytest.approx(exact, rel=1e-14)
    assert optim.global_norm({'big': np.full(4, 3e38, np.float32)}) == pytest.approx(6e38)
    with pytest.raises(optim.NonFiniteError, match='overflows float64'):
        optim.clip_by_global_norm({'huge': np.array([1e200, 1.0])}, 1.0)
