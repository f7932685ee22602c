"""The exempla/mlp run against an independent float64 implementation: forward and backward of the
tanh MLP, softmax cross-entropy, global-norm clipping, the warmup-cosine schedule and AdamW all
written out here in plain numpy, sharing no code with gradus. Only the inputs come from the
exemplum: the data, each step's batch rows, the initial parameters and the hyperparameter
constants."""
import importlib.util, math
from pathlib import Path
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# stated tolerance of the float32 run's final loss against float64 (observed: ~7e-7)
F32_RTOL = 1e-5


@pytest.fixture(scope='module')
def ex():
    path = ROOT / 'exempla' / 'mlp' / 'mlp.py'
    spec = importlib.util.spec_from_file_location('exemplum_mlp', path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


def forward(Ws, bs, x):
    hs = [x]
    for i, (W, b) in enumerate(zip(Ws, bs)):
        a = hs[-1] @ W + b
        hs.append(np.tanh(a) if i < len(Ws) - 1 else a)
    return hs  # inputs of each layer, then the logits


def ce_and_dlogits(z, y):
    zmax = z.max(1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(1, keepdims=True)) + zmax
    n = len(y)
    loss = float(np.mean(lse[:, 0] - z[np.arange(n), y]))
    p = np.exp(z - lse)
    p[np.arange(n), y] -= 1.0
    return loss, p / n


def backward(Ws, hs, dz):
    dWs, dbs, d = [None] * len(Ws), [None] * len(Ws), dz
    for i in reversed(range(len(Ws))):
        dWs[i] = hs[i].T @ d
        dbs[i] = d.sum(0)
        # hs[i] = tanh(pre-activation of layer i-1)
        if i > 0: d = (d @ Ws[i].T) * (1.0 - hs[i] ** 2)
    return dWs, dbs


def lr_at(t, ex):
    if t < ex.WARMUP: return ex.PEAK_LR * min(1.0, (t + 1) / ex.WARMUP)
    frac = min(t - ex.WARMUP, ex.STEPS - ex.WARMUP) / (ex.STEPS - ex.WARMUP)
    return ex.FLOOR_LR + (ex.PEAK_LR - ex.FLOOR_LR) * 0.5 * (1 + math.cos(math.pi * frac))


def reference_run(ex):
    x, y = ex.data()
    init = ex.init_params(np.float64)
    Ws = [p['w'].copy() for p in init]; bs = [p['b'].copy() for p in init]
    params = Ws + bs
    decays = [True] * len(Ws) + [False] * len(bs)
    m = [np.zeros_like(p) for p in params]; v = [np.zeros_like(p) for p in params]
    b1, b2, eps = 0.9, 0.999, 1e-8
    losses = []
    for t in range(ex.STEPS):
        idx = ex.batch_indices(t)
        Ws, bs = params[:len(Ws)], params[len(Ws):]
        hs = forward(Ws, bs, x[idx])
        loss, dz = ce_and_dlogits(hs[-1], y[idx])
        dWs, dbs = backward(Ws, hs, dz)
        g = dWs + dbs
        norm = math.sqrt(sum(float((gi ** 2).sum()) for gi in g))
        if norm > ex.CLIP: g = [gi * (ex.CLIP / norm) for gi in g]
        lr = lr_at(t, ex)
        new = []
        for i, (p, gi) in enumerate(zip(params, g)):
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            mh, vh = m[i] / (1 - b1 ** (t + 1)), v[i] / (1 - b2 ** (t + 1))
            decay = ex.WEIGHT_DECAY * p if decays[i] else 0.0
            new.append(p - lr * (mh / (np.sqrt(vh) + eps) + decay))
        params = new
        losses.append(loss)
    Ws, bs = params[:len(Ws)], params[len(Ws):]
    final, _ = ce_and_dlogits(forward(Ws, bs, x)[-1], y)
    return Ws, bs, losses, final


@pytest.fixture(scope='module')
def runs(ex):
    return reference_run(ex), ex.run(np.float64), ex.run(np.float32)


def test_reference_is_a_real_training_run(ex, runs):
    (_, _, losses, final), _, _ = runs
    assert final < 0.5 * losses[0], (losses[0], final)          # it learns
    x, y = ex.data()
    assert np.mean(y == 0) < 0.5                                # the classes are not trivially one


def test_float64_run_matches_reference_to_1e_9(runs):
    (Ws, bs, ref_losses, ref_final), (params, losses, final), _ = runs
    assert abs(final - ref_final) <= 1e-9 * abs(ref_final), (final, ref_final)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
    for p, W, b in zip(params, Ws, bs):
        np.testing.assert_allclose(p['w'], W, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(p['b'], b, rtol=1e-9, atol=1e-12)


def test_float32_run_within_stated_tolerance(runs):
    (_, _, _, ref_final), _, (params, losses, final) = runs
    assert all(p['w'].dtype == np.float32 and p['b'].dtype == np.float32 for p in params)
    rel = abs(final - ref_final) / ref_final
    assert rel <= F32_RTOL, (final, ref_final, rel)


def test_reference_gradient_is_itself_right(ex):
    """The hand-written backward checked by central differences, so the comparison above rests on a
    proven oracle."""
    rng = np.random.default_rng(0)
    Ws = [rng.standard_normal((2, 4)), rng.standard_normal((4, 3))]
    bs = [rng.standard_normal(4), rng.standard_normal(3)]
    x, y = rng.standard_normal((5, 2)), rng.integers(0, 3, 5)
    hs = forward(Ws, bs, x)
    _, dz = ce_and_dlogits(hs[-1], y)
    dWs, _ = backward(Ws, hs, dz)
    for i, j, k in [(0, 1, 2), (1, 3, 0), (0, 0, 0)]:
        h = 1e-6
        Wp = [W.copy() for W in Ws]; Wp[i][j, k] += h
        Wm = [W.copy() for W in Ws]; Wm[i][j, k] -= h
        loss_at = lambda W: ce_and_dlogits(forward(W, bs, x)[-1], y)[0]
        num = (loss_at(Wp) - loss_at(Wm)) / (2 * h)
        assert abs(num - dWs[i][j, k]) < 1e-7
