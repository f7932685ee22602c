"Losses against scipy/numpy oracles, their gradients against finite differences, and their errors."
import numpy as np
import pytest
import scipy.special as sp
import gradus as gd
from gradus import loss
from gradus.dtype import DTypeError
from gradus.shape import ShapeError

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


def test_cross_entropy_ignore_index():
    z, y = rng.standard_normal((6, 4)), np.array([0, -100, 3, -100, 1, 2])
    keep = y != -100
    assert np.isclose(loss.cross_entropy(z, y, ignore_index=-100), loss.cross_entropy(z[keep], y[keep]), rtol=1e-14)
    g = gd.grad(lambda z: loss.cross_entropy(z, y, ignore_index=-100))(z)
    assert np.all(g[~keep] == 0)
    allign = np.full(6, -100)
    v, g = gd.value_and_grad(lambda z: loss.cross_entropy(z, allign, ignore_index=-100))(z)
    assert v == 0 and np.all(g == 0)


def test_cross_entropy_traced_labels():
    z, y = rng.standard_normal((5, 3)).astype(np.float32), rng.integers(0, 3, 5)
    v, g = gd.value_and_grad(loss.cross_entropy)(z, y)     # labels are a traced argument here
    assert g.dtype == np.float32 and np.isclose(v, loss.cross_entropy(z, y), rtol=1e-6)


def test_cross_entropy_errors():
    z = np.zeros((2, 3))
    with pytest.raises(ValueError, match="label 3 at index"): loss.cross_entropy(z, np.array([0, 3]))
    with pytest.raises(ValueError, match="label -1"): loss.cross_entropy(z, np.array([-1, 0]))
    with pytest.raises(DTypeError, match="float64"): loss.cross_entropy(z, np.array([0., 1.]))
    with pytest.raises(ShapeError, match=r"\(3,\)"): loss.cross_entropy(z, np.array([0, 1, 2]))
    with pytest.raises(DTypeError): loss.cross_entropy(np.zeros((2, 3), np.int64), np.array([0, 1]))


def test_bce_with_logits():
    x, t = rng.standard_normal(20) * 3, rng.uniform(size=20)
    p = sp.expit(x)
    assert np.isclose(loss.binary_cross_entropy_with_logits(x, t), np.mean(-t * np.log(p) - (1 - t) * np.log(1 - p)), rtol=1e-12)
    x[0] = 0.0
    np.testing.assert_allclose(gd.grad(loss.binary_cross_entropy_with_logits)(x, t), (sp.expit(x) - t) / 20, atol=1e-15)
    gd.check_grads(loss.binary_cross_entropy_with_logits, (x, t))
    big = np.array([1e4, -1e4, 1e4], np.float32); tb = np.array([1.0, 0.0, 0.0], np.float32)
    v, g = gd.value_and_grad(loss.binary_cross_entropy_with_logits)(big, tb)
    assert np.isclose(v, 1e4 / 3) and np.all(np.isfinite(g)) and v.dtype == np.float32
    with pytest.raises(ShapeError): loss.binary_cross_entropy_with_logits(np.zeros((3, 1)), np.zeros(3))
