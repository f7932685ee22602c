"""The cross-entropy kernels (`loss._nll_rows`) against the composite path they replace (the
reference), the size gate on both sides, float64 on the old path, and second derivatives."""
import numpy as np
import pytest
import gradus as gd
from gradus.core import kernels
from gradus.core import tensor as T
from gradus.errors import DTypeError, ShapeError
from gradus.learn import loss

EPS, TINY = float(np.finfo(np.float32).eps), float(np.finfo(np.float32).smallest_subnormal)
rng = np.random.default_rng(21)


def _worst(a, b, ulps):
    "Largest `|a − b|` in units of `ulps · eps · |b| + 4 tiny`; inf/NaN must match exactly."
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    assert np.all(same | np.isfinite(b)), "inf or NaN at a different place"
    with np.errstate(invalid='ignore'):
        err = np.where(same, 0.0, np.abs(a - b) / (ulps * EPS * np.abs(b) + 4 * TINY))
    return float(err.max())


def _kernel_and_reference(z, y):
    ct = rng.standard_normal(len(y)).astype(np.float32)           # not all ones: scaling checked
    with np.errstate(all='ignore'):
        got = loss._ce_rows_impl(z, y), loss._ce_rows_vjp_impl(ct, z, y)
        want = loss._nll(z, y), loss._nll_bwd((np.exp(loss._shift_by_max(z)), y), ct)[0]
    return got, want


def _cases():
    r = rng.standard_normal((32, 32768)).astype(np.float32)
    y = rng.integers(0, 32768, 32)
    top = np.argmax(r, -1)                                         # labels at the maximum too
    yield 'random', 3 * r, y
    yield 'labels at the max', 3 * r, top
    for M in (1e4, 1e8, 1e30):
        yield f'magnitude {M:g}', M * r, y
    far = np.zeros((6, 8192), np.float32)
    far[:, 0] = [5.0, 10.0, 30.0, 60.0, 85.0, 87.0]
    yield 'far tails', far, np.zeros(6, np.int64)
    yield 'far tails, wrong class', far, np.ones(6, np.int64)
    ties = np.zeros((2, 8192), np.float32)
    ties[0, :3] = 1e8                                              # three equal maxima
    yield 'ties', ties, np.array([0, 5])
    z = rng.standard_normal((7, 8192)).astype(np.float32)
    z[0, 1:] = -np.inf                                             # one finite logit: loss 0
    z[1, 0] = -np.inf                                              # -inf true class: inf
    z[2] = -np.inf                                                 # no finite logit: NaN
    z[3, 5] = np.inf                                               # +inf logit elsewhere
    z[4, 7] = np.nan                                               # NaN logit
    z[5, ::2] = -np.inf                                            # half the classes -inf
    z[6, 9] = np.inf                                               # +inf true class: NaN
    yield '-inf, inf, NaN rows', z, np.array([0, 0, 3, 1, 2, 1, 9])


@pytest.mark.parametrize('what,z,y', list(_cases()), ids=lambda v: v if isinstance(v, str) else '')
def test_kernels_match_the_composite_path(what, z, y):
    (v, g), (vr, gr) = _kernel_and_reference(z, y)
    assert v.dtype == g.dtype == np.float32 and v.shape == y.shape and g.shape == z.shape
    assert _worst(v, vr, 4) <= 1, what
    assert _worst(g, gr, 8) <= 1, what


def test_nan_and_inf_exactly_as_before():
    z = np.zeros((4, 4096), np.float32)
    z[0, 0] = -np.inf; z[1] = -np.inf; z[2, 3] = np.nan; z[3, 0] = np.inf
    y = np.array([0, 0, 0, 0])
    with np.errstate(all='ignore'):
        v = loss._ce_rows_impl(z, y)
    assert v[0] == np.inf and np.isnan(v[1]) and np.isnan(v[2]) and np.isnan(v[3])


def test_subnormal_float32_exp_is_more_accurate_in_the_kernel():
    z = np.zeros((1, 8192), np.float32); z[0, 0] = 95.0             # exp(-95) subnormal in f32
    y = np.zeros(1, np.int64)
    exact = float(loss._nll(z.astype(np.float64), y)[0])
    assert abs(float(loss._ce_rows_impl(z, y)[0]) - exact) <= 2 * EPS * exact


@pytest.fixture
def calls(monkeypatch):
    "Counts the kernels' calls through their primitives (forward and backward)."
    seen = []
    for p in (loss._ce_rows_p, loss._ce_rows_vjp_p):
        monkeypatch.setattr(p, 'impl', lambda *a, _f=p.impl, **k: seen.append(1) or _f(*a, **k))
    return seen


@pytest.mark.parametrize('shape,dtype,used', [
    ((256, 4096), np.float32, True),          # 2**20 elements, 4096 classes: the kernel
    ((255, 4096), np.float32, False),         # one row short of 2**20
    ((512, 4095), np.float32, False),         # enough elements, one class short
    ((1024, 2048), np.float32, False),        # 2**21 elements, 2048 classes
    ((256, 4096), np.float64, False),         # float64 keeps the composite path
])
def test_the_gate(calls, shape, dtype, used):
    z = rng.standard_normal(shape).astype(dtype)
    y = rng.integers(0, shape[1], shape[0])
    assert loss._CE_MIN_SIZE == 1 << 20 and loss._CE_MIN_CLASSES == 4096
    v = loss.cross_entropy(z, y)
    assert bool(calls) == used and v.dtype == dtype
    with kernels.disabled():
        assert loss.cross_entropy(z, y) == pytest.approx(float(v), rel=4 * EPS)
    assert len(calls) == int(used)                                 # disabled(): none


def test_small_vocabularies_are_bit_identical(calls):
    z = rng.standard_normal((4, 128, 65)).astype(np.float32)        # the character GPT's shape
    y = rng.integers(0, 65, (4, 128))
    v, g = gd.value_and_grad(loss.cross_entropy)(z, y)
    n = z.size // 65
    with kernels.disabled():
        vr, gr = gd.value_and_grad(loss.cross_entropy)(z, y)
    want = loss._mean(loss._nll(z.reshape(n, 65), y.reshape(n)))
    assert not calls and v.tobytes() == vr.tobytes() == np.asarray(want).tobytes()
    assert g.tobytes() == gr.tobytes()


@pytest.mark.parametrize('ignore', [None, -100])
def test_value_and_grad_through_cross_entropy(calls, ignore):
    z = (3 * rng.standard_normal((2, 128, 4096))).astype(np.float32)   # (B, T, vocab)
    y = rng.integers(0, 4096, (2, 128))
    if ignore is not None:
        y[0, :17] = ignore
        z[0, 3] = -np.inf                                          # an ignored row of -inf
    f = lambda z: loss.cross_entropy(z, y, ignore_index=ignore)
    v, g = gd.value_and_grad(f)(z)
    assert calls
    with kernels.disabled():
        vr, gr = gd.value_and_grad(f)(z)
    assert np.isfinite(v) and abs(float(v) - float(vr)) <= 4 * EPS * abs(float(vr))
    assert _worst(g, gr, 8) <= 1
    if ignore is not None:
        assert np.all(g[0, :17] == 0) and np.any(g[0, 17:] != 0)


def test_finite_differences_in_float64_through_cross_entropy(calls):
    z = rng.standard_normal((256, 4096)).astype(np.float32)        # the kernel's size in float32
    y = rng.integers(0, 4096, 256)
    worst = gd.check_grads(lambda z: loss.cross_entropy(z, y), (z,))    # float64: old path
    assert worst <= 1 and not calls


def test_second_derivatives_through_the_kernel(calls):
    z = rng.standard_normal((256, 4096)).astype(np.float32)
    y = rng.integers(0, 4096, 256)
    v = rng.standard_normal(z.shape).astype(np.float32)
    hvp = lambda z: gd.grad(lambda z: T.sum(gd.grad(lambda z: loss.cross_entropy(z, y))(z) * v))(z)
    h = hvp(z)
    assert calls
    with kernels.disabled():
        hr = hvp(z)
    np.testing.assert_allclose(h, hr, rtol=1e-4, atol=1e-4 * np.abs(hr).max())


def test_the_primitive_refuses_bad_operands():
    with pytest.raises(DTypeError, match='float64'):
        loss._ce_rows_p.bind(np.zeros((2, 4096)), np.zeros(2, np.int64))
    with pytest.raises(ShapeError, match=r'\(3,\)'):
        loss._ce_rows_p.bind(np.zeros((2, 4096), np.float32), np.zeros(3, np.int64))


def test_threads_other_than_main_run_the_serial_loops():
    from concurrent.futures import ThreadPoolExecutor
    z = (3 * rng.standard_normal((8, 4096))).astype(np.float32)
    y = rng.integers(0, 4096, 8)
    ct = np.ones(8, np.float32)
    main = loss._ce_rows_impl(z, y), loss._ce_rows_vjp_impl(ct, z, y)
    with ThreadPoolExecutor(2) as pool:                  # two at once: no parallel region
        jobs = [pool.submit(lambda: (loss._ce_rows_impl(z, y), loss._ce_rows_vjp_impl(ct, z, y)))
                for _ in range(2)]
        outs = [j.result() for j in jobs]
    for v, g in outs:
        assert _worst(v, main[0], 1) <= 1 and _worst(g, main[1], 1) <= 1   # same loops
    assert loss._ce_rows_kernel in loss._SERIAL
