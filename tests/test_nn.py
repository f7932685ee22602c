"""Keys, initialisers and layers: reproducibility, statistics, numpy oracles, float64 gradient
proofs, errors."""
import math
import numpy as np
import pytest
import gradus as gd
from gradus.learn import nn, random
from gradus.core import tensor as T
from gradus.errors import DTypeError
from gradus.errors import ShapeError


def test_keys_reproducible_and_distinct():
    k = random.key(7)
    assert k.dtype == np.uint64 and k.shape == (2,) and np.array_equal(k, random.key(7))
    assert not np.array_equal(random.key(7), random.key(8))
    ks = random.split(k, 100)
    assert ks.shape == (100, 2) and len({tuple(r) for r in ks}) == 100
    assert (np.array_equal(random.split(k, 5), random.split(k, 5))
            and np.array_equal(random.split(k, 5)[:3], random.split(k, 3)))
    folded = {tuple(random.fold_in(k, i)) for i in range(100)}
    assert len(folded) == 100 and not folded & {tuple(r) for r in ks}
    a = random.rng(k).standard_normal(5)
    assert np.array_equal(a, random.rng(k).standard_normal(5))


def test_key_errors():
    for bad in (-1, 1.5, True, '3'):
        with pytest.raises((TypeError, ValueError)): random.key(bad)
    with pytest.raises(TypeError, match="uint64"): random.split(np.array([1, 2]))
    with pytest.raises(ValueError): random.split(random.key(0), 0)


def test_initialiser_statistics():
    k = random.key(0)
    w = nn.he_normal(k, (1000, 500), dtype=np.float64)
    assert abs(w.std() / math.sqrt(2 / 1000) - 1) < 0.01 and abs(w.mean()) < 1e-3
    u = nn.glorot_uniform(k, (300, 100), dtype=np.float64)
    lim = math.sqrt(6 / 400)
    assert u.max() <= lim and u.min() >= -lim and u.max() > 0.99 * lim
    g = nn.glorot_normal(k, (400, 600), dtype=np.float64)
    assert abs(g.std() / math.sqrt(2 / 1000) - 1) < 0.01
    hu = nn.he_uniform(k, (500, 400), dtype=np.float64)
    assert abs(hu.var() / (2 / 500) - 1) < 0.02
    assert nn.zeros((2, 3)).dtype == np.float32 and np.all(nn.ones((3,), np.float64) == 1)
    w32 = nn.he_normal(k, (1000, 500))
    assert w32.dtype == np.float32 and np.array_equal(w32, w.astype(np.float32))
    with pytest.raises(DTypeError): nn.normal(k, (2,), dtype=np.int32)


def test_linear():
    p = nn.linear_init(random.key(1), 3, 4, dtype=np.float64)
    p['b'] = np.arange(4.0)
    x = np.random.default_rng(0).standard_normal((5, 3))
    np.testing.assert_allclose(nn.linear(p, x), x @ p['w'] + p['b'], rtol=1e-15)
    gd.check_grads(nn.linear, (p, x))
    assert set(nn.linear_init(random.key(1), 3, 4, bias=False)) == {'w'}
    with pytest.raises(ShapeError, match="in_features=3"): nn.linear(p, np.zeros((5, 4)))


def test_embedding():
    p = nn.embedding_init(random.key(2), 10, 4, dtype=np.float64)
    ids = np.array([[1, 1, 9], [0, 3, 1]])
    np.testing.assert_array_equal(nn.embedding(p, ids), p['w'][ids])
    gd.check_grads(lambda p: nn.embedding(p, ids), (p,))
    with pytest.raises(IndexError, match="id 10"): nn.embedding(p, np.array([10]))
    with pytest.raises(DTypeError): nn.embedding(p, np.array([1.0]))


def _rows():
    r = np.random.default_rng(3)
    return np.vstack([r.standard_normal((2, 6)) * 4 + 2, np.full((1, 6), -3.5), np.zeros((1, 6))])


def test_layer_norm_oracle_and_grads():
    x = _rows()
    p = {'scale': np.random.default_rng(4).standard_normal(6),
         'bias': np.random.default_rng(5).standard_normal(6)}
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(nn.layer_norm(p, x),
                               (x - mu) / np.sqrt(var + 1e-5) * p['scale'] + p['bias'], rtol=1e-12)
    gd.check_grads(nn.layer_norm, (p, x))            # includes a constant row and a zero row
    for dtype in (np.float32, np.float64):
        xc = np.full((3, 6), 2.5, dtype)
        pc = gd.tree_map(lambda a: a.astype(dtype), p)
        g = gd.grad(lambda p, x: T.sum(nn.layer_norm(p, x) ** 3), argnums=(0, 1))(pc, xc)
        assert all(np.isfinite(l).all() for l in gd.tree_leaves(g))


def test_rms_norm_oracle_and_grads():
    x = _rows()
    p = {'scale': np.random.default_rng(6).standard_normal(6)}
    np.testing.assert_allclose(nn.rms_norm(p, x),
                               x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p['scale'],
                               rtol=1e-12)
    gd.check_grads(nn.rms_norm, (p, x))
    for dtype in (np.float32, np.float64):
        g = gd.grad(lambda p, x: T.sum(nn.rms_norm(p, x) ** 2), argnums=(0, 1))(
            {'scale': np.ones(6, dtype)}, np.zeros((2, 6), dtype))
        assert all(np.isfinite(l).all() for l in gd.tree_leaves(g))


def test_dropout():
    x = np.ones((200, 500), np.float32)
    y = nn.dropout(random.key(0), x, 0.25, True)
    assert y.dtype == np.float32 and abs(np.mean(y == 0) - 0.25) < 0.01 and abs(y.mean() - 1) < 0.02
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert (nn.dropout(random.key(0), x, 0.25, False) is x
            and nn.dropout(random.key(0), x, 0.0, True) is x)
    for bad in (1.0, -0.1, 'a'):
        with pytest.raises(ValueError): nn.dropout(random.key(0), x, bad, True)
    f = gd.jit(lambda k, x: nn.dropout(k, x, 0.5, True))
    a, b = f(random.key(1), x[:4]), f(random.key(2), x[:4])
    assert (not np.array_equal(a, b)
            and np.array_equal(a, nn.dropout(random.key(1), x[:4], 0.5, True)))
    xs = np.random.default_rng(0).standard_normal((3, 4))
    gd.check_grads(lambda x: nn.dropout(random.key(5), x, 0.3, True), (xs,))


def test_mlp():
    p = nn.mlp_init(random.key(0), [3, 5, 4, 2], dtype=np.float64)
    assert [q['w'].shape for q in p] == [(3, 5), (5, 4), (4, 2)]
    x = np.random.default_rng(1).standard_normal((7, 3))
    h = x
    for i, q in enumerate(p):
        h = h @ q['w'] + q['b']
        if i < 2: h = np.tanh(h)
    np.testing.assert_allclose(nn.mlp(p, x, T.tanh), h, rtol=1e-13)
    gd.check_grads(lambda p, x: nn.mlp(p, x, T.tanh), (p, x))
    with pytest.raises(ValueError): nn.mlp_init(random.key(0), [3])
