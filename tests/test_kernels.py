"""The hand-written kernels (nn's row norm, attention's causal softmax) against their plain
references; their derivatives against central differences; the thread helpers of
gradus.core.kernels; and a 50-step training run with and without the kernels."""
import os
import subprocess
import sys
import time
import numpy as np
import pytest
import gradus as gd
from gradus.core import tensor as T, ops, kernels
from gradus.learn import nn, optim, random as R, loss as L
from gradus.transformer import gpt
from gradus.transformer import attention as A
from gradus.transformer import causal_softmax as CS
from gradus.errors import ShapeError

rng = np.random.default_rng(0)


def test_set_threads_sets_blas_and_refuses_bad_counts():
    before = kernels.blas_threads()
    try:
        assert kernels.set_threads(1) == 1 and kernels.blas_threads() == 1
    finally:
        kernels.set_threads(before)
    assert kernels.blas_threads() == before
    for bad in (0, -1, 1.5, True, '2'):
        with pytest.raises(ValueError, match='set_threads'):
            kernels.set_threads(bad)


def test_set_threads_reports_the_count_in_force():
    "BLAS caps itself (OpenBLAS at its build's count): the count reported is the one it took."
    before = kernels.threads()
    try:
        n = kernels.set_threads(10**6)
        assert n == kernels.threads() == kernels.blas_threads() < 10**6
    finally:
        kernels.set_threads(before)
    assert kernels.threads() == before


def test_thread_tuner_follows_the_faster_count_and_backs_off():
    delay = {1: 0.020, 2: 0.001}
    tuner = kernels.ThreadTuner(max_threads=2, period=10, max_backoff=4)
    before = kernels.blas_threads()
    try:
        for _ in range(30): tuner(lambda: time.sleep(delay[tuner.threads]))
        assert [n for n, _ in tuner.history[-20:]].count(2) >= 15 and tuner.best() == 2
        delay = {1: 0.001, 2: 0.020}
        for _ in range(60): tuner(lambda: time.sleep(delay[tuner.threads]))
        assert [n for n, _ in tuner.history[-20:]].count(1) >= 15 and tuner.best() == 1
        assert tuner.every[2] > 10                     # the losing count is probed less often
        assert max(tuner.every.values()) <= 40         # ... but at least every max_backoff periods
    finally:
        kernels.set_threads(before)
    for bad in (dict(period=1), dict(window=0), dict(max_backoff=0), dict(max_threads=-1)):
        with pytest.raises(ValueError, match='ThreadTuner'):
            kernels.ThreadTuner(**bad)


@pytest.mark.parametrize('center', [True, False])
@pytest.mark.parametrize('shape', [(5, 16), (2, 3, 7), (1, 1)])
def test_norm_rows_kernels_equal_reference_float64(center, shape):
    x = rng.standard_normal(shape) * 3 + 1
    g = rng.standard_normal(shape)
    np.testing.assert_allclose(nn._norm_rows_impl(x, 1e-5, center),
                               nn._norm_reference(x, 1e-5, center), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(nn._norm_rows_vjp_impl(g, x, 1e-5, center),
                               nn._norm_vjp_reference(g, x, 1e-5, center), rtol=1e-11, atol=1e-12)
    if shape[-1] > 1:   # a 1-wide row is constant: its derivative ~eps is below the noise
        assert ops.check_rule(nn._norm_rows_p, x, eps=1e-5, center=center, seed=7) < 1e-6


def test_norm_rows_non_contiguous_and_extreme_rows_float32():
    base = rng.standard_normal((16, 6))                          # (dim, rows): transposed below
    x = np.vstack([base.T * 1e30, base.T[:2] * 1e-20, np.full((1, 16), 7.0)]).astype(np.float32)
    xt = np.asfortranarray(x)                                         # not C-contiguous
    for center in (True, False):
        got = nn._norm_rows(xt, 1e-5, center)
        d = x.astype(np.float64) - (x.mean(-1, keepdims=True, dtype=np.float64) if center else 0)
        s = np.maximum(np.abs(d).max(-1, keepdims=True), 1.0)          # float64 reference, scaled
        want = (d / s) / np.sqrt(((d / s) ** 2).mean(-1, keepdims=True) + 1e-5 / s ** 2)
        assert got.dtype == np.float32 and np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_layer_norm_second_derivatives_through_the_kernels():
    p = {'scale': rng.standard_normal(5), 'bias': rng.standard_normal(5)}
    x = rng.standard_normal((3, 5)) * 2
    assert gd.check_grads(nn.layer_norm, (p, x), order=2) <= 1
    assert gd.check_grads(nn.rms_norm, ({'scale': p['scale']}, x), order=2) <= 1
    eqns = gd.value_and_grad(lambda x: T.sum(nn.layer_norm(p, x) ** 2)).lower(x)[0].graph.eqns
    assert {'norm_rows', 'norm_rows_vjp'} <= {e.prim.name for e in eqns}


@pytest.mark.parametrize('tq,tk', [(4, 4), (3, 7), (1, 5)])
def test_causal_softmax_kernels_equal_reference(tq, tk):
    s = rng.standard_normal((2, 3, tq, tk)) * 4
    g = rng.standard_normal((2, 3, tq, tk))
    p = CS._causal_softmax_impl(s, 0.3)
    np.testing.assert_allclose(p, CS._causal_softmax_reference(s, 0.3), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(CS._causal_softmax_vjp_impl(g, p, 0.3),
                               CS._causal_softmax_vjp_reference(g, p, 0.3), rtol=1e-12, atol=1e-14)
    assert ops.check_rule(CS._causal_softmax_p, s, scale=0.3, seed=7) < 1e-6
    assert gd.check_grads(lambda s: CS._causal_softmax_p.bind(s, scale=0.3), (s[:1, :1],),
                          order=2) <= 1


def test_attention_uses_the_kernel_only_for_the_causal_mask():
    q, k, v = (rng.standard_normal((2, 2, 5, 4)).astype(np.float32) for _ in range(3))
    def prims(mask):
        f = lambda q, k, v: T.sum(A.scaled_dot_product_attention(q, k, v, mask) ** 2)
        return {e.prim.name for e in gd.value_and_grad(f).lower(q, k, v)[0].graph.eqns}
    assert {'causal_softmax', 'causal_softmax_vjp'} <= prims(A.causal_mask(5))
    assert 'causal_softmax' not in prims(A.causal_mask(5, window=2))
    assert 'causal_softmax' not in prims(~A.causal_mask(5))
    fused = A.scaled_dot_product_attention(q, k, v, A.causal_mask(5))
    with kernels.disabled():
        plain = A.scaled_dot_product_attention(q, k, v, A.causal_mask(5))
    np.testing.assert_allclose(fused, plain, rtol=1e-6, atol=1e-6)


def _train(steps, cfg):
    params = gpt.init(R.key(0), cfg)
    opt = optim.adamw(3e-3, betas=(0.9, 0.99), weight_decay=0.1, mask=optim.decay_mask)
    state = opt.init(params)
    vg = gd.value_and_grad(lambda p, x, y: L.cross_entropy(gpt.apply(p, x, cfg), y))
    starts = np.random.default_rng(1).integers(0, cfg.vocab_size, (steps, 4, 1))
    data = (starts + np.arange(cfg.block_size + 1)) % cfg.vocab_size    # counting: learnable
    losses = []
    for w in data:
        loss, g = vg(params, w[:, :-1], w[:, 1:])
        g, _ = optim.clip_by_global_norm(g, 1.0)
        params, state = opt.update(g, state, params)
        losses.append(float(loss))
    return np.array(losses)


def test_fifty_steps_with_and_without_kernels_agree():
    """The same 50 training steps of a small GPT, traced with the kernels and with the plain
    composites (kernels.disabled(), the code before the kernels): losses agree to float32
    tolerance, and the run learns."""
    cfg = gpt.GPTConfig(vocab_size=17, block_size=16, n_layer=2, n_head=2, n_embd=32)
    fused = _train(50, cfg)
    with kernels.disabled():
        plain = _train(50, cfg)
    np.testing.assert_allclose(fused, plain, rtol=2e-5)
    assert fused[-5:].mean() < fused[:5].mean() - 0.1


def test_keep_arrays_on_the_heap_where_glibc_runs():
    "glibc accepts both mallopt settings (32 MiB, 256 MiB); elsewhere the call changes nothing."
    import platform
    applied = kernels.keep_arrays_on_the_heap()
    assert isinstance(applied, bool)
    if platform.libc_ver()[0] == 'glibc':
        assert applied
    assert np.ones(400_000, np.float32).sum() == 400_000   # arrays still allocate and fill


def test_one_blas_thread_and_threads():
    before = kernels.blas_threads()
    try:
        kernels.set_threads(2)
        assert kernels.threads() == 2
        with kernels.one_blas_thread():
            assert kernels.blas_threads() == 1
        assert kernels.blas_threads() == 2
        kernels.set_threads(1)
        assert kernels.threads() == 1
    finally:
        kernels.set_threads(before)


def test_blas_threads_for_chooses_by_size_and_restores():
    before = kernels.blas_threads()
    small = (1, 576, 1536)  # one token through SmolLM2's MLP: far below the threshold
    rows = -(-kernels.SMALL_PRODUCT // (576 * 1536))  # the fewest rows at or above it
    try:
        kernels.set_threads(2)
        with kernels.blas_threads_for(*small):
            assert kernels.blas_threads() == 1
        assert kernels.blas_threads() == 2
        with kernels.blas_threads_for(rows - 1, 576, 1536):
            assert kernels.blas_threads() == 1
        with kernels.blas_threads_for(rows, 576, 1536):
            assert kernels.blas_threads() == 2
        with kernels.one_blas_thread():  # restores what was in force, not threads()
            with kernels.blas_threads_for(rows, 576, 1536):
                assert kernels.blas_threads() == 2
            assert kernels.blas_threads() == 1
        with pytest.raises(RuntimeError):  # restored on the way out of an error too
            with kernels.blas_threads_for(*small):
                raise RuntimeError
        assert kernels.blas_threads() == 2
        kernels.set_threads(1)
        with kernels.blas_threads_for(rows, 576, 1536):
            assert kernels.blas_threads() == 1  # large: threads(), whatever it is
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize('bad', [-1, 2.0, None, True, '3'])
def test_blas_threads_for_refuses_bad_sizes(bad):
    with pytest.raises(ShapeError, match=f'blas_threads_for: inner .*{bad!r}'):
        with kernels.blas_threads_for(1, bad, 3):
            pass


def test_blas_threads_for_ignores_the_environment():
    "OPENBLAS_NUM_THREADS=1 at start-up does not keep a large product from threads()."
    code = (
        'from gradus.core import kernels as k; print(k.threads(), k.blas_threads())\n'
        'with k.blas_threads_for(4096, 4096, 4096): print(k.blas_threads())\n'
        'with k.blas_threads_for(1, 64, 64): print(k.blas_threads())\n'
        'print(k.blas_threads())'
    )
    env = {**os.environ, 'OPENBLAS_NUM_THREADS': '1'}
    out = subprocess.run(
        [sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True
    )
    n, start, large, small, after = out.stdout.split()
    assert (start, large, small, after) == ('1', n, '1', '1')  # threads(): the CPUs, not the env


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_gelu_passes_equal_the_numpy_steps_bit_for_bit(dtype):
    "numba, numpy's exp, numba: the same bits as ops' numpy version, non-contiguous input too."
    x = np.concatenate([rng.standard_normal(989) * 6, [0.0, -0.0, 40.0, -40.0, 40.5, -40.5, 1e30,
                                                        -1e30, np.inf, -np.inf, 1e-40]])
    for xd in (x.astype(dtype).reshape(25, 40), x.astype(dtype).reshape(40, 25).T):
        assert np.array_equal(ops._gelu_impl(xd), ops._gelu_numpy(xd))
        assert np.array_equal(ops._gelu_grad_impl(xd), ops._gelu_grad_numpy(xd))
        assert ops._gelu_impl(xd).shape == xd.shape and ops._gelu_impl(xd).dtype == dtype
    assert np.isnan(ops._gelu_impl(np.array([np.nan], dtype))[0])


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_silu_pass_equals_the_composite_bit_for_bit(dtype):
    "numpy's exp, one numba pass: the bits of `x * sigmoid(x)` eagerly, and of silu's numpy steps."
    x = np.concatenate([rng.standard_normal(989) * 8, [0.0, -0.0, 88.0, -88.0, 1e30, -1e30,
                                                        745.0, -745.0, np.inf, 1e-40, -1e-40]])
    for xd in (x.astype(dtype).reshape(25, 40), x.astype(dtype).reshape(40, 25).T):
        with np.errstate(invalid='ignore'):
            assert np.array_equal(ops._silu_impl(xd), xd * ops.sigmoid(xd))
            assert np.array_equal(ops._silu_grad_impl(xd), ops._silu_grad_numpy(xd), equal_nan=True)
        assert ops.silu(xd).shape == xd.shape and ops.silu(xd).dtype == dtype
    assert np.isnan(ops._silu_impl(np.array([np.nan], dtype))[0])
    assert ops._silu_impl(np.array([-np.inf], dtype)).tolist() != [0.0]   # -inf · 0: NaN, as x·σ(x)
