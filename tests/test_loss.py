"Losses against scipy/numpy oracles, their gradients against finite differences, and their errors."
import numpy as np
import pytest
import scipy.special as sp
import gradus as gd
from gradus.learn import loss
from gradus.errors import DTypeError
from gradus.errors import ShapeError
import _loss_reference as R

rng = np.random.default_rng(0)


def test_mse_fixture_and_oracle():
    assert loss.mse(np.array([[1., 2.], [3., 4.]]), np.array([[1., 2.], [3., 3.]])) == 0.25
    p, t = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    assert np.isclose(loss.mse(p, t), np.mean((p - t) ** 2), rtol=1e-14)
    gd.check_grads(loss.mse, (p, t))


def test_mse_refuses_broadcasting():
    with pytest.raises(ShapeError, match=r"\(8, 1\).*\(8,\)"):
        loss.mse(np.zeros((8, 1)), np.zeros(8))


def test_cross_entropy_oracle_and_grad():
    z, y = rng.standard_normal((2, 3, 7)), rng.integers(0, 7, (2, 3))
    ref = -np.mean(np.take_along_axis(sp.log_softmax(z, -1), y[..., None], -1))
    assert np.isclose(loss.cross_entropy(z, y), ref, rtol=1e-13)
    g = gd.grad(loss.cross_entropy)(z, y)
    onehot = np.eye(7)[y]
    np.testing.assert_allclose(g, (sp.softmax(z, -1) - onehot) / 6, atol=1e-14)
    gd.check_grads(lambda z: loss.cross_entropy(z, y), (z,))


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_cross_entropy_huge_logits(dtype):
    z = np.array([[1e4, -1e4, 0.0], [-1e4, 1e4, 5e3]], dtype)
    v, g = gd.value_and_grad(loss.cross_entropy)(z, np.array([2, 1]))
    assert v.dtype == dtype and np.isfinite(v) and np.all(np.isfinite(g))
    assert np.isclose(float(v), (1e4 + 0.0) / 2, rtol=1e-6)    # row 0: 1e4 - 0; row 1: ~0
    np.testing.assert_allclose(g, np.array([[0.5, 0, -0.5], [0, 0, 0]], dtype), atol=1e-6)


def _ce_reference(z, y, ignore_index=None):
    """Mean loss and gradient from the exact reference, over the rows whose label is not
    `ignore_index`."""
    C = z.shape[-1]
    zr, yr = z.reshape(-1, C), y.reshape(-1)
    keep = [i for i in range(len(yr)) if yr[i] != ignore_index]
    total, g = 0, np.zeros(zr.shape)
    for i in keep:
        loss, gi = R.ce_row(zr[i], int(yr[i]))
        total += loss
        g[i] = [float(v) for v in gi]
    n = max(len(keep), 1)
    return float(total / n), (g / n).reshape(z.shape), len(keep)


def test_cross_entropy_ignore_index():
    z, y = rng.standard_normal((6, 4)), np.array([0, -100, 3, -100, 1, 2])
    ref, gref, count = _ce_reference(z, y, -100)
    assert count == 4
    v, g = gd.value_and_grad(lambda z: loss.cross_entropy(z, y, ignore_index=-100))(z)
    assert np.isclose(v, ref, rtol=1e-14)
    assert np.isclose(loss.cross_entropy(z, y, ignore_index=-100), ref, rtol=1e-14)
    np.testing.assert_allclose(g, gref, rtol=1e-13, atol=1e-16)
    assert np.all(g[y == -100] == 0)
    allign = np.full(6, -100)
    v, g = gd.value_and_grad(lambda z: loss.cross_entropy(z, allign, ignore_index=-100))(z)
    assert v == 0 and np.all(g == 0)


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_cross_entropy_ignore_index_counts_over_leading_axes(dtype):
    """The mean divides by the number of kept labels over all leading axes, whatever the ignored
    rows hold."""
    z = (rng.standard_normal((2, 3, 5)) * 3).astype(dtype)
    y = np.array([[0, -1, 4], [-1, -1, 2]])
    z[0, 1] = -np.inf                        # an ignored row with no finite logit
    z[1, 0, 0] = -np.inf                     # ignored, and class 0 (its placeholder) is -inf
    ref, gref, count = _ce_reference(z, y, -1)
    assert count == 3
    with np.errstate(divide='raise', invalid='raise'):   # no log 0, 0 * inf or inf - inf on the way
        v, g = gd.value_and_grad(lambda z: loss.cross_entropy(z, y, ignore_index=-1))(z)
    eps = np.finfo(dtype).eps
    assert abs(float(v) - ref) <= 16 * eps * ref, (float(v), ref)
    np.testing.assert_allclose(g, gref, rtol=32 * eps, atol=1e-30)


# ---- the precision sweep (issue 9): magnitudes, far tails, -inf logits, value and gradient ----
MAGNITUDES = [1.0, 1e4, 1e8, 1e30]


def _ce_rows(M):
    "Rows `(logits, label)` at magnitude M whose differences are exact in both float32 and float64."
    ninf = -np.inf
    return [([M, M], 0), ([M, M], 1), ([M, -M], 0), ([M, -M], 1), ([M, M / 2, 0.0, -M], 1),
            ([M, M, M, -M], 3), ([M, ninf, M], 0), ([ninf, M], 1), ([M, 0.0, ninf], 2),
            ([-M, -M, -M], 2)]


TAILS = [([t, 0.0], 0) for t in (10.0, 30.0, 85.0, 100.0, 700.0, 740.0)] + \
        [([0.0, -25.0, -30.0, -35.5], 0), ([0.0, -25.0, -30.0, -35.5], 3), ([1.5, 1.5, -40.0], 0)]


def _ce_sweep_cases():
    rows = [(M, z, y) for M in MAGNITUDES for z, y in _ce_rows(M)]
    return rows + [('tail', z, y) for z, y in TAILS]


def ce_sweep(dtype, c=16):
    """Worst error of the value and of the gradient of `cross_entropy` over the sweep, as a fraction
    of the allowed error (c units of roundoff times the problem's condition, see
    `_loss_reference.ce_condition`)."""
    eps, tiny = np.finfo(dtype).eps, np.finfo(dtype).smallest_subnormal
    rows = []
    for M, zl, y in _ce_sweep_cases():
        z = np.array([zl], dtype)
        lab = np.array([y])
        ref, gref = R.ce_row(z[0], y)
        ref, gref = float(ref), np.array([float(v) for v in gref])
        with np.errstate(divide='ignore', invalid='ignore', over='ignore'):
            v, g = gd.value_and_grad(lambda z: loss.cross_entropy(z, lab))(z)
            eager = loss.cross_entropy(z, lab)
        cv, cg = R.ce_condition(z[0], y)
        if np.isinf(ref):
            ev = 0.0 if float(v) == ref and float(eager) == ref else np.inf
        else:
            ev = max(abs(float(v) - ref), abs(float(eager) - ref)) / (c * eps * cv + 4 * tiny)
        eg = np.max(np.abs(g[0].astype(np.float64) - gref) / (c * eps * cg + 4 * tiny))
        rows.append((M, zl, y, float(v), ref, ev, eg))
    return rows


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_cross_entropy_precision_sweep(dtype):
    bad = [r for r in ce_sweep(dtype) if not (r[5] <= 1 and r[6] <= 1)]
    assert not bad, '\n'.join(f"M={M} z={z} y={y}: got {v!r} want {ref!r} (value {ev:.3g}, grad "
                              f"{eg:.3g} "
                               "of the allowed error)" for M, z, y, v, ref, ev, eg in bad)


def test_cross_entropy_equal_large_float32_logits_give_ln2():
    "The issue's case: two equal float32 logits of 1e4, 1e6 and 1e8 gave 0.693359, 0.6875 and 0."
    for M in (1e4, 1e6, 1e8, 1e30):
        v = loss.cross_entropy(np.array([[M, M]], np.float32), np.array([0]))
        assert abs(float(v) - np.log(2)) <= 2 * np.spacing(np.float32(np.log(2))), (M, float(v))


def bce_sweep(dtype, c=16):
    """Worst error of `binary_cross_entropy_with_logits`'s value and d/dlogit over magnitudes, tails
    and ±inf."""
    eps, tiny = np.finfo(dtype).eps, np.finfo(dtype).smallest_subnormal
    mags = MAGNITUDES + [0.5, 10.0, 20.0, 40.0, 90.0, 100.0, 700.0, 740.0]
    xs = [s * m for m in mags for s in (1, -1)]
    xs += [0.0, np.inf, -np.inf]
    rows = []
    for t in (0.0, 1.0, 0.25, 0.5, 0.75):
        x = np.array(xs, dtype)
        tt = np.full(x.shape, t, dtype)
        with np.errstate(divide='ignore', invalid='ignore', over='ignore'):
            v, g = gd.value_and_grad(lambda x: loss.binary_cross_entropy_with_logits(x, tt))(x)
            per = [loss.binary_cross_entropy_with_logits(x[i:i + 1], tt[i:i + 1])
                   for i in range(len(x))]
        n = len(x)
        for i in range(n):
            ref, gref, _ = R.bce(x[i], t)
            ref, gref = float(ref), float(gref)
            xi = abs(float(x[i]))
            sig = 1 / (1 + np.exp(-min(xi, 700.0)))
            cond_v = abs(ref) + (xi * abs(gref) if np.isfinite(xi) else 0.0)
            cond_g = abs(gref) + (xi * sig * (1 - sig) if np.isfinite(xi) else 0.0)
            if np.isinf(ref): ev = 0.0 if float(per[i]) == ref else np.inf
            else: ev = abs(float(per[i]) - ref) / (c * eps * cond_v + 4 * tiny)
            eg = abs(float(g[i]) * n - gref) / (c * eps * cond_g + 4 * tiny * n)   # g: of the mean
            rows.append((float(x[i]), t, float(per[i]), ref, ev, eg))
        ref_mean = float(sum(R.bce(xx, t)[0] for xx in x) / n)
        if np.isfinite(ref_mean):
            assert np.isclose(float(v), ref_mean, rtol=c * eps), (t, float(v), ref_mean)
    return rows


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_bce_with_logits_precision_sweep(dtype):
    bad = [r for r in bce_sweep(dtype) if not (r[4] <= 1 and r[5] <= 1)]
    assert not bad, '\n'.join(f"x={x} t={t}: got {v!r} want {ref!r} (value {ev:.3g}, grad "
                              f"{eg:.3g} of the "
                               "allowed error)" for x, t, v, ref, ev, eg in bad)


def test_bce_with_logits_tail_keeps_relative_accuracy():
    """x = 20, t = 1 in float32: the loss log(1 + e^-20) = 2.06e-9 was computed as softplus(20) - 20
    = 0."""
    v, g = gd.value_and_grad(loss.binary_cross_entropy_with_logits)(np.array([20.0], np.float32),
                                                                    np.array([1.0], np.float32))
    assert np.isclose(float(v), np.log1p(np.exp(-20.0)), rtol=1e-6)
    assert np.isclose(float(g[0]), -1 / (1 + np.exp(20.0)), rtol=1e-6)


def test_mse_exact_differences_at_large_magnitudes():
    """Differences of a few ulps on top of huge values are exact in float arithmetic: so must the
    loss be."""
    for dt in (np.float32, np.float64):
        for M in MAGNITUDES:
            t = np.full(4, M, dt)
            p = t + np.spacing(t) * np.array([1, -2, 3, 0], dt)
            d = [float(a) - float(b) for a, b in zip(p, t)]
            ref = sum(x * x for x in d) / 4
            eps = float(np.finfo(dt).eps)
            with np.errstate(over='ignore'):
                v, g = gd.value_and_grad(loss.mse)(p, t)
                ref_dt = float(dt(ref))              # inf where the mean exceeds the dtype's range
            if np.isinf(ref_dt): assert float(v) == ref_dt, (dt, M, float(v))
            else: assert abs(float(v) - ref) <= 4 * eps * ref, (dt, M, float(v), ref)
            np.testing.assert_allclose(g, np.array(d) / 2, rtol=4 * eps)


def test_cross_entropy_traced_labels():
    z, y = rng.standard_normal((5, 3)).astype(np.float32), rng.integers(0, 3, 5)
    v, g = gd.value_and_grad(loss.cross_entropy)(z, y)     # labels are a traced argument here
    ref, gref, _ = _ce_reference(z, y)
    assert g.dtype == np.float32 and np.isclose(v, ref, rtol=1e-6)
    np.testing.assert_allclose(g, gref, rtol=1e-5, atol=1e-8)


def test_cross_entropy_errors():
    z = np.zeros((2, 3))
    with pytest.raises(ValueError, match="label 3 at index"):
        loss.cross_entropy(z, np.array([0, 3]))
    with pytest.raises(ValueError, match="label -1"): loss.cross_entropy(z, np.array([-1, 0]))
    with pytest.raises(DTypeError, match="float64"): loss.cross_entropy(z, np.array([0., 1.]))
    with pytest.raises(ShapeError, match=r"\(3,\)"): loss.cross_entropy(z, np.array([0, 1, 2]))
    with pytest.raises(DTypeError): loss.cross_entropy(np.zeros((2, 3), np.int64), np.array([0, 1]))


def test_bce_with_logits():
    x, t = rng.standard_normal(20) * 3, rng.uniform(size=20)
    p = sp.expit(x)
    ref = np.mean(-t * np.log(p) - (1 - t) * np.log(1 - p))
    assert np.isclose(loss.binary_cross_entropy_with_logits(x, t), ref, rtol=1e-12)
    x[0] = 0.0
    g = gd.grad(loss.binary_cross_entropy_with_logits)(x, t)
    np.testing.assert_allclose(g, (sp.expit(x) - t) / 20, atol=1e-15)
    gd.check_grads(loss.binary_cross_entropy_with_logits, (x, t))
    big = np.array([1e4, -1e4, 1e4], np.float32); tb = np.array([1.0, 0.0, 0.0], np.float32)
    v, g = gd.value_and_grad(loss.binary_cross_entropy_with_logits)(big, tb)
    assert np.isclose(v, 1e4 / 3) and np.all(np.isfinite(g)) and v.dtype == np.float32
    with pytest.raises(ShapeError):
        loss.binary_cross_entropy_with_logits(np.zeros((3, 1)), np.zeros(3))


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_half_precision_means_over_many_elements(dtype):
    "70000 float16 elements: the sum and the count pass 65504; the means gave 0 and NaN before."
    from gradus.core.dtype import bfloat16
    dt = np.float16 if dtype == 'float16' else bfloat16
    n = 70000
    z, y = np.zeros((n, 2), dt), np.zeros(n, np.int64)
    y[::7] = -1                                              # 10000 ignored
    ln2 = np.log(2)
    tol = 4 * float(np.finfo(np.float16).eps if dtype == 'float16' else 2.0 ** -7)
    assert abs(float(loss.cross_entropy(z, np.zeros(n, np.int64))) - ln2) <= tol * ln2
    v, g = gd.value_and_grad(lambda z: loss.cross_entropy(z, y, ignore_index=-1))(z)
    assert v.dtype == dt and abs(float(v) - ln2) <= tol * ln2
    kept = g[y != -1].astype(np.float64)
    np.testing.assert_allclose(kept, np.tile([-0.5, 0.5], (60000, 1)) / 60000, rtol=tol)
    x = np.zeros(n, dt)
    assert abs(float(loss.binary_cross_entropy_with_logits(x, x)) - ln2) <= tol * ln2
    assert float(loss.mse(x + 1, x)) == 1.0
