"""Batching, metrics, the training loop (convergence, shapes kept, NaN refused) and checkpoints
(atomic, resumable bit for bit)."""
import math, os
import numpy as np
import pytest
import gradus as gd
from gradus.learn import loss, nn, optim, random, train
from gradus.core import ops
from gradus.core import tensor as T
from gradus.errors import DTypeError
from gradus.errors import ShapeError


def test_batches_cover_each_row_once():
    x, y = np.arange(23.0)[:, None], np.arange(23)
    seen = [b for b in train.batches(random.key(0), (x, y), 5)]
    assert [len(b[1]) for b in seen] == [5, 5, 5, 5, 3]
    rows = np.concatenate([b[1] for b in seen])
    assert sorted(rows) == list(range(23)) and list(rows) != list(range(23))
    assert all(np.array_equal(bx[:, 0], by) for bx, by in seen)
    assert [len(b[1]) for b in train.batches(random.key(0), (x, y), 5, drop_last=True)] == [5] * 4
    assert [list(b) for b in train.batches(None, y[:4], 2, shuffle=False)] == [[0, 1], [2, 3]]
    with pytest.raises(ShapeError): list(train.batches(random.key(0), (x, y[:5]), 2))
    with pytest.raises(ValueError): list(train.batches(random.key(0), (x, y), 0))


def test_random_windows():
    tokens = np.arange(50, dtype=np.int32)
    x, y = train.random_windows(random.key(1), tokens, 8, 10)
    assert x.shape == y.shape == (8, 10) and x.dtype == np.int32
    assert np.array_equal(y, x + 1) and x.min() >= 0 and y.max() <= 49
    x2, _ = train.random_windows(random.key(1), tokens, 8, 10)
    assert np.array_equal(x, x2)
    with pytest.raises(ShapeError): train.random_windows(random.key(1), tokens[:10], 2, 10)
    with pytest.raises(DTypeError): train.random_windows(random.key(1), tokens.astype(float), 2, 5)
    with pytest.raises(ShapeError): train.random_windows(random.key(1), tokens.reshape(5, 10), 2, 5)


def test_metrics():
    assert train.accuracy(np.array([[0., 1.], [3., 2.], [0., 5.], [1., 0.]]),
                          np.array([1, 0, 0, 0])) == 0.75
    assert math.isclose(train.perplexity(math.log(50257)), 50257)
    with pytest.raises(ShapeError): train.accuracy(np.zeros((3, 2)), np.zeros(2, int))


def _regression_data(n=64):
    r = random.rng(random.key(10))
    x = r.standard_normal((n, 3)).astype(np.float32)
    w = np.array([[1.0, -2.0], [0.5, 0.0], [0.0, 1.5]], np.float32)
    return x, (np.tanh(x @ w) + 0.1).astype(np.float32)


def test_batch_training_converges_and_keeps_shapes_and_dtypes():
    """In the spirit of the broadcast-bias bug: batch > 1, every parameter keeps its shape and dtype
    at every step."""
    x, y = _regression_data()
    params = nn.mlp_init(random.key(0), [3, 16, 2])
    spec = [(l.shape, l.dtype) for l in gd.tree_leaves(params)]
    opt = optim.adam(1e-2); state = opt.init(params)
    vg = gd.value_and_grad(lambda p, x, y: loss.mse(nn.mlp(p, x, T.tanh), y))
    first = None
    for t in range(300):
        idx = random.rng(random.fold_in(random.key(1), t)).integers(0, 64, 16)
        value, grads = vg(params, x[idx], y[idx])
        params, state = opt.update(grads, state, params)
        assert [(l.shape, l.dtype) for l in gd.tree_leaves(params)] == spec
        assert [(l.shape, l.dtype) for l in gd.tree_leaves(state['mu'])] == spec
        first = first if first is not None else float(value)
    final = float(loss.mse(nn.mlp(params, x, T.tanh), y))
    assert final < 0.02 * first, (first, final)


def _setup(dtype=np.float32):
    x, y = _regression_data()
    x, y = x.astype(dtype), y.astype(dtype)
    def loss_fn(p, xb, yb, k):
        h = T.tanh(nn.linear(p['blocks'][0]['attn']['wq'], xb))
        return loss.mse(nn.linear(p['head'], nn.dropout(k, h, 0.2, True)), yb)
    def get_batch(k, t):
        kb, kd = random.split(k)
        idx = random.rng(kb).integers(0, len(x), 8)
        return x[idx], y[idx], kd
    k1, k2 = random.split(random.key(0))
    params = {'blocks': [{'attn': {'wq': nn.linear_init(k1, 3, 8, dtype=dtype)}}],
              'head': nn.linear_init(k2, 8, 2, dtype=dtype)}
    opt = optim.adamw(optim.warmup_cosine(1e-2, 3, 30), mask=optim.decay_mask)
    return loss_fn, get_batch, opt, train.init_state(params, opt, random.key(5))


def _named(state):
    return {k: np.asarray(v) for k, v in
            gd.tree_to_dict({'params': state.params, 'opt_state': state.opt_state,
                             'key': state.key}).items()}


def test_fit_records_evaluates_and_calls_back():
    loss_fn, get_batch, opt, s0 = _setup()
    logged = []
    state, hist = train.fit(loss_fn, s0, opt, get_batch, 30,
                            eval_fn=lambda p: {'val': 1.0}, eval_every=10,
                            callback=logged.append, log_every=5, progress=False)
    assert state.step == 30 and [r['step'] for r in hist] == list(range(1, 31))
    assert [r['step'] for r in hist if 'val' in r] == [10, 20, 30]
    assert [r['step'] for r in logged] == [5, 10, 15, 20, 25, 30]
    assert hist[0]['lr'] == opt.learning_rate(0) and hist[-1]['loss'] < hist[0]['loss']
    state2, _ = train.fit(loss_fn, s0, opt, get_batch, 30,
                          progress=True)      # the bar must not change anything
    assert all(np.array_equal(a, b) for a,
               b in zip(_named(state).values(), _named(state2).values()))


def test_fit_writes_periodic_checkpoints(tmp_path):
    """fit(checkpoint=..., checkpoint_every=N) leaves the state of the last multiple of N, then of
    the final step; each step's callback runs before that step's checkpoint (issue 25 item 6: a
    log is never behind its checkpoint), so the callback of step 5 still sees no checkpoint."""
    loss_fn, get_batch, opt, s0 = _setup()
    path = tmp_path / 'ckpt.safetensors'
    seen = []
    cb = lambda rec: seen.append(train.load_checkpoint(path,
                                                       like=s0).step if path.exists() else None)
    state, _ = train.fit(loss_fn, s0, opt, get_batch, 12, callback=cb, progress=False,
                         checkpoint=path, checkpoint_every=5)
    assert seen == [None] * 5 + [5] * 5 + [10] * 2
    saved = train.load_checkpoint(path, like=s0)
    assert all(np.array_equal(a, b) for a, b in zip(_named(saved).values(), _named(state).values()))


def test_fit_refuses_nan():
    loss_fn, get_batch, opt, s0 = _setup()
    def bad(k, t):
        return tuple(np.full_like(a, np.nan) if t == 3 and a.dtype == np.float32 else a
                     for a in get_batch(k, t))
    with pytest.raises(optim.NonFiniteError, match="step 3"):
        train.fit(loss_fn, s0, opt, bad, 10, progress=False)
    with pytest.raises(ValueError):
        train.fit(loss_fn, s0._replace(step=5), opt, get_batch, 2, progress=False)


@pytest.mark.parametrize('where,done,saved', [('batch', 6, 6), ('eval', 5, 5),
                                              ('checkpoint', 5, 5), ('callback', 5, 5)])
def test_fit_interrupted_hands_back_the_last_whole_step(tmp_path, where, done, saved):
    """Ctrl-C (KeyboardInterrupt) in step 6's batch, evaluation, checkpoint or callback: fit
    re-raises it with `state` at the last step finished whole (6 when the batch of step index 6
    never arrived; 5 when step 6 was computed but not finished), the records up to it, and training
    on from that state is the uninterrupted run, bit for bit. (Step 6's periodic checkpoint comes
    after its callback: a Ctrl-C in the callback leaves the checkpoint of step 5.)"""
    loss_fn, get_batch, opt, s0 = _setup()
    path = tmp_path / 'ckpt.safetensors'
    kw = dict(eval_every=1, checkpoint=path, checkpoint_every=1, progress=False)
    full, h_full = train.fit(loss_fn, s0, opt, get_batch, 12, eval_fn=lambda p: {'v': 1.0},
                             callback=lambda r: None, **kw)
    def ctrl_c(step):
        if step == 6: raise KeyboardInterrupt
    def batch(k, t):
        if where == 'batch': ctrl_c(t)
        return get_batch(k, t)
    def evaluate(p):
        if where == 'eval': ctrl_c(len(seen) + 1)
        return {'v': 1.0}
    seen = []
    def callback(r):
        seen.append(r['step'])
        if where == 'callback': ctrl_c(r['step'])
    if where == 'checkpoint':
        real = train.save_checkpoint
        def save(p, st, *a):
            ctrl_c(st.step)
            return real(p, st, *a)
        import unittest.mock
        patch = unittest.mock.patch.object(train, 'save_checkpoint', save)
    else:
        import contextlib
        patch = contextlib.nullcontext()
    with patch, pytest.raises(KeyboardInterrupt) as e:
        train.fit(loss_fn, s0, opt, batch, 12, eval_fn=evaluate, callback=callback, **kw)
    st, hist = e.value.state, e.value.history
    assert st.step == done and [r['step'] for r in hist] == list(range(1, done + 1))
    assert train.load_checkpoint(path, like=s0).step == saved      # the last one fit wrote
    on, h_on = train.fit(loss_fn, st, opt, get_batch, 12, eval_fn=lambda p: {'v': 1.0},
                         callback=lambda r: None, **kw)
    a, b = _named(full), _named(on)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert [r['loss'] for r in h_full] == [r['loss'] for r in hist + h_on]


def test_ctrl_c_reported_by_numba_is_the_interrupt():
    """Ctrl-C landing as a compiled kernel returns reaches fit as a SystemError whose context is the
    KeyboardInterrupt (seen once in a child of the Ctrl-C test): fit raises the interrupt itself,
    with the state of the last whole step; a SystemError of another cause passes through."""
    loss_fn, get_batch, opt, s0 = _setup()
    def numba_ctrl_c(rec):
        if rec['step'] == 4:
            try: raise KeyboardInterrupt
            except KeyboardInterrupt: raise SystemError('CPUDispatcher(k) returned a result with '
                                                        'an exception set')
    with pytest.raises(KeyboardInterrupt) as e:
        train.fit(loss_fn, s0, opt, get_batch, 8, callback=numba_ctrl_c, progress=False)
    assert e.value.state.step == 3 and len(e.value.history) == 3
    def other(rec):
        if rec['step'] == 4: raise SystemError('of its own')
    with pytest.raises(SystemError, match='of its own'):
        train.fit(loss_fn, s0, opt, get_batch, 8, callback=other, progress=False)
    assert train.as_interrupt(ValueError('x')) is None


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_resume_is_bit_for_bit(tmp_path, dtype):
    loss_fn, get_batch, opt, s0 = _setup(dtype)
    full, h_full = train.fit(loss_fn, s0, opt, get_batch, 24, clip_norm=1.0, progress=False)
    part, h1 = train.fit(loss_fn, s0, opt, get_batch, 11, clip_norm=1.0, progress=False)
    path = tmp_path / 'ckpt.safetensors'
    train.save_checkpoint(path, part)
    resumed = train.load_checkpoint(path, like=s0)
    assert resumed.step == 11 and isinstance(resumed.params['blocks'], list)
    resumed, h2 = train.fit(loss_fn, resumed, opt, get_batch, 24, clip_norm=1.0, progress=False)
    a, b = _named(full), _named(resumed)
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]), n
    assert [r['loss'] for r in h_full] == [r['loss'] for r in h1 + h2]
    # and the run is not trivially constant: a different key gives different parameters
    other, _ = train.fit(loss_fn, s0._replace(key=random.key(6)), opt, get_batch, 24, clip_norm=1.0,
                         progress=False)
    assert not np.array_equal(other.params['head']['w'], full.params['head']['w'])


def test_checkpoint_names_and_plain_load(tmp_path):
    from gradus.formats.safetensors import load_safetensors
    _, _, _, s0 = _setup()
    path = tmp_path / 'c.safetensors'
    train.save_checkpoint(path, s0, metadata={'run': 'test'})
    flat, meta = load_safetensors(path, with_metadata=True)
    assert ('params.blocks.0.attn.wq.w' in flat and 'opt_state.mu.head.b' in flat
            and 'opt_state.step' in flat)
    assert flat['step'].dtype == np.int64 and flat['key'].dtype == np.uint64
    assert meta['run'] == 'test' and meta['step'] == '0'
    plain = train.load_checkpoint(path)
    assert plain.step == 0 and np.array_equal(plain.params['head']['w'], s0.params['head']['w'])
    assert np.array_equal(plain.key, s0.key)


def test_checkpoint_mismatch_errors(tmp_path):
    _, _, opt, s0 = _setup()
    path = tmp_path / 'c.safetensors'
    train.save_checkpoint(path, s0)
    wider = train.init_state({**s0.params, 'head': nn.linear_init(random.key(0), 8, 3)},
                             opt, random.key(5))
    with pytest.raises(train.CheckpointError, match="head"): train.load_checkpoint(path, like=wider)
    more = train.init_state({**s0.params, 'extra': np.zeros(2, np.float32)}, opt, random.key(5))
    with pytest.raises(train.CheckpointError, match="no tensor 'opt_state.mu.extra'"):
        train.load_checkpoint(path, like=more)
    fewer = train.init_state({'head': s0.params['head']}, opt, random.key(5))
    with pytest.raises(train.CheckpointError, match="unexpected tensor"):
        train.load_checkpoint(path, like=fewer)
    with pytest.raises(train.CheckpointError, match="'a.b'"):
        train.save_checkpoint(tmp_path / 'd.safetensors', s0._replace(params={'a.b': np.zeros(1)}))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    loss_fn, get_batch, opt, s0 = _setup()
    path = tmp_path / 'c.safetensors'
    train.save_checkpoint(path, s0)
    before = path.read_bytes()
    later, _ = train.fit(loss_fn, s0, opt, get_batch, 7, progress=False)
    def crash(*a, **k): raise OSError("disk full (simulated)")
    monkeypatch.setattr(os, 'replace', crash)
    with pytest.raises(OSError, match="simulated"): train.save_checkpoint(path, later)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ['c.safetensors']
    assert train.load_checkpoint(path, like=s0).step == 0


def test_regression_exemplum(capsys):
    import importlib.util
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / 'exempla' / 'regression' / 'regression.py'
    spec = importlib.util.spec_from_file_location('exemplum_regression', script)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    params = mod.main()
    out = capsys.readouterr().out
    assert 'learned: w0=2.000 w1=-1.000 b=0.500' in out and out.count('epoch') == 10
    np.testing.assert_allclose(params['w'][:, 0], [2.0, -1.0], atol=1e-5)
    np.testing.assert_allclose(params['b'], [0.5], atol=1e-5)


def _mse_setup(dtype, n=16):
    x, y = _regression_data()
    params = nn.mlp_init(random.key(0), [3, 16, 2], dtype=dtype)
    vg = gd.value_and_grad(lambda p, xb, yb: loss.mse(nn.mlp(p, xb, T.tanh), yb))
    return vg, params, x[:n].astype(dtype), y[:n].astype(dtype)


@pytest.mark.parametrize('dtype,tol', [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize('threads', [2, 3, 5])
def test_data_parallel_equals_the_whole_batch(dtype, tol, threads):
    """Shards of 8/8, 5/5/6 and 3/3/3/3/4 rows: the size-weighted mean of their losses and gradients
    is the whole batch's, to float rounding."""
    vg, params, x, y = _mse_setup(dtype)
    whole = gd.tree_leaves(vg(params, x, y))
    split = gd.tree_leaves(train.data_parallel(vg, (None, 0, 0), threads=threads)(params, x, y))
    assert [(np.shape(a), np.asarray(a).dtype) for a in split] == \
        [(np.shape(a), np.asarray(a).dtype) for a in whole]
    for a, b in zip(split, whole):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_data_parallel_gives_each_shard_its_own_key():
    "Shard i gets fold_in(key, i): the result is the weighted mean of the shards called by hand."
    def loss_fn(p, xb, k):
        return ops.mean(nn.dropout(k, xb * p, 0.5, True))
    vg = gd.value_and_grad(loss_fn)
    p, xb, k = np.float64(1.5), np.arange(1.0, 21.0).reshape(10, 2), random.key(7)
    got = train.data_parallel(vg, (None, 0, 'key'), threads=2)(p, xb, k)
    halves = [vg(p, xb[:5], random.fold_in(k, 0)), vg(p, xb[5:], random.fold_in(k, 1))]
    want = [0.5 * (a + b) for a, b in zip(*halves)]
    assert np.allclose(got[0], want[0], rtol=1e-14) and np.allclose(got[1], want[1], rtol=1e-14)
    assert not np.isclose(halves[0][0], vg(p, xb[5:], random.fold_in(k, 0))[0])   # masks differ


def test_data_parallel_errors_and_blas_restored():
    from gradus.core import kernels
    vg, params, x, y = _mse_setup(np.float32)
    with pytest.raises(TypeError, match='data_parallel'):
        train.data_parallel(lambda p, x, y: 0.0, (None, 0, 0))
    with pytest.raises(ValueError, match='in_axes'):
        train.data_parallel(vg, (None, 0))(params, x, y)
    with pytest.raises(ValueError, match="'batch'"):
        train.data_parallel(vg, (None, 0, 'batch'))(params, x, y)
    with pytest.raises(ShapeError, match=r'\[16, 15\]'):
        train.data_parallel(vg, (None, 0, 0))(params, x, y[:15])
    before = kernels.blas_threads()
    train.data_parallel(vg, (None, 0, 0), threads=2)(params, x, y)
    assert kernels.blas_threads() == before
    one = train.data_parallel(vg, (None, 0, 0), threads=4)(params, x[:1], y[:1])   # 1 row: 1 shard
    assert all(np.array_equal(a, b) for a, b in
               zip(gd.tree_leaves(one), gd.tree_leaves(vg(params, x[:1], y[:1]))))


def test_fit_with_in_axes_tracks_the_one_thread_run():
    "20 AdamW steps with the batch split over 2 threads follow the one-thread losses closely."
    from gradus.core import kernels
    x, y = _regression_data()
    def loss_fn(p, xb, yb): return loss.mse(nn.mlp(p, xb, T.tanh), yb)
    def get_batch(k, t):
        idx = random.rng(k).integers(0, len(x), 16)
        return x[idx], y[idx]
    opt = optim.adamw(1e-2)
    s0 = train.init_state(nn.mlp_init(random.key(0), [3, 16, 2]), opt, random.key(1))
    before = kernels.threads()
    try:
        kernels.set_threads(2)
        _, split = train.fit(loss_fn, s0, opt, get_batch, 20, progress=False, in_axes=(0, 0))
    finally:
        kernels.set_threads(before)
    _, one = train.fit(loss_fn, s0, opt, get_batch, 20, progress=False)
    np.testing.assert_allclose([r['loss'] for r in split], [r['loss'] for r in one], rtol=1e-4)


def test_data_parallel_never_writes_an_argument_and_cuts_pytree_batches():
    """An output that is a view of an argument (a reshape of the parameters) is averaged into new
    memory; a tuple batch argument is cut leaf by leaf, not as a sequence."""
    r = np.random.default_rng(3)
    w, x, y = r.standard_normal((3, 2)), r.standard_normal((6, 3)), r.standard_normal((6, 2))
    w0 = w.copy()
    j = gd.jit(lambda w, x: (T.reshape(w, (6,)), ops.mean(x)))
    out = train.data_parallel(j, (None, 0), threads=3)(w, x)
    assert np.array_equal(w, w0) and np.allclose(out[0], w0.reshape(6))
    vg = gd.value_and_grad(lambda w, b: ops.mean((b[0] @ w - b[1]) ** 2))
    got = train.data_parallel(vg, (None, 0), threads=2)(w, (x, y))
    want = vg(w, (x, y))
    assert np.allclose(got[0], want[0], rtol=1e-14) and np.allclose(got[1], want[1], rtol=1e-13)


def test_data_parallel_refuses_what_it_cannot_average():
    r = np.random.default_rng(4)
    w, x = r.standard_normal((3, 2)), r.standard_normal((5, 3))
    vg = gd.value_and_grad(lambda w, x: ops.mean((x @ w) ** 2))
    with pytest.raises(TypeError, match='value_and_grad'):
        train.data_parallel(gd.grad(lambda w, x: ops.mean(x @ w)), (None, 0))
    with pytest.raises(TypeError, match='in_axes'):
        train.data_parallel(vg, 0)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f'got {bad}'):
            train.data_parallel(vg, (None, 0), threads=bad)
    with pytest.raises(ValueError, match=r'\(None, False\)'):
        train.data_parallel(vg, (None, False))(w, x)
    per_row = gd.jit(lambda w, x: T.sum(x @ w, axis=1))                  # (rows,): not a mean
    with pytest.raises(ShapeError, match='per-example'):
        train.data_parallel(per_row, (None, 0), threads=2)(w, x)
    count = gd.jit(lambda w, x: (ops.mean(x), np.int64(x.shape[0])))
    with pytest.raises(DTypeError, match='int64'):
        train.data_parallel(count, (None, 0), threads=2)(w, x)


def test_fit_in_axes_must_match_the_batch():
    loss_fn, get_batch, opt, s0 = _setup()
    with pytest.raises(TypeError, match='in_axes'):
        train.fit(loss_fn, s0, opt, get_batch, 2, progress=False, in_axes=0)
    with pytest.raises(ValueError, match='2 entries for a batch of 3'):
        train.fit(loss_fn, s0, opt, get_batch, 2, progress=False, in_axes=(0, 0))


# --- run folders after a crash (issue 25 item 6): nothing non-finite saved, steps that lie -------

def _inf_input_at(get_batch, step):
    "Batches of `get_batch`, one input infinite at step index `step`: tanh saturates, loss finite."
    def batch(k, t):
        x, y, kd = get_batch(k, t)
        if t == step: x = x.copy(); x[0, 0] = np.inf
        return x, y, kd
    return batch


def test_fit_refuses_nan_gradients_without_clipping(tmp_path):
    """clip_norm=None, a finite loss and NaN gradients (an infinite input through tanh: ∞·0): fit
    stops naming the step and the leaf, before the update; the step is not logged and the last
    good checkpoint stays, byte for byte (before: NaN parameters were saved over it)."""
    loss_fn, get_batch, opt, s0 = _setup()
    path, seen = tmp_path / 'ckpt.safetensors', []
    def saving(rec):
        seen.append(rec['step'])
        if path.exists(): good.append(path.read_bytes())
    good = []
    nan_grad = r"step 3 the gradient of blocks\.0\.attn\.wq"
    with np.errstate(invalid='ignore'), pytest.raises(optim.NonFiniteError, match=nan_grad):
        train.fit(loss_fn, s0, opt, _inf_input_at(get_batch, 3), 8, callback=saving,
                  checkpoint=path, checkpoint_every=2, progress=False)
    assert seen == [1, 2, 3] and path.read_bytes() == good[-1]
    assert train.load_checkpoint(path, like=s0).step == 2


def test_fit_refuses_to_checkpoint_a_non_finite_state(tmp_path):
    """Finite losses and gradients, but an optimizer state gone infinite (AdamW's second moment,
    which only divides, so the loss never shows it): the step that would be checkpointed is
    refused, naming the leaf; it is not logged and the checkpoint keeps the last good step."""
    loss_fn, get_batch, opt, s0 = _setup()
    class Overflowing:                              # AdamW whose nu overflows at its 10th update
        init, learning_rate = staticmethod(opt.init), staticmethod(opt.learning_rate)
        def update(self, grads, state, params):
            params, state = opt.update(grads, state, params)
            if int(state['step']) == 10:
                nu = gd.tree_map(np.copy, state['nu']); nu['head']['b'][0] = np.inf
                state = {**state, 'nu': nu}
            return params, state
    path, seen = tmp_path / 'ckpt.safetensors', []
    with pytest.raises(optim.NonFiniteError, match=r"step 9, opt_state\.nu\.head\.b contains inf"):
        train.fit(loss_fn, s0, Overflowing(), get_batch, 12, callback=lambda r: seen.append(
            r['step']), checkpoint=path, checkpoint_every=5, progress=False)
    assert seen == list(range(1, 10)) and train.load_checkpoint(path, like=s0).step == 5


@pytest.mark.parametrize('case', ['nan param', 'inf moment', 'step -5', 'step 2.5', 'step True',
                                  'step [1, 2]', 'step != optimizer', 'key float'])
def test_save_checkpoint_refuses_what_load_would(tmp_path, case):
    loss_fn, get_batch, opt, s0 = _setup()
    st, _ = train.fit(loss_fn, s0, opt, get_batch, 3, progress=False)
    path = tmp_path / 'c.safetensors'
    train.save_checkpoint(path, st)
    before = path.read_bytes()
    head = {**st.params['head'], 'w': st.params['head']['w'].copy()}
    bad, err = {
        'nan param': (st._replace(params={**st.params, 'head': {**head, 'w': head['w'] * np.nan}}),
                      optim.NonFiniteError),
        'inf moment': (st._replace(opt_state={**st.opt_state, 'mu': gd.tree_map(
            lambda a: a + np.float32(np.inf), st.opt_state['mu'])}), optim.NonFiniteError),
        'step -5': (st._replace(step=-5), train.CheckpointError),
        'step 2.5': (st._replace(step=2.5), train.CheckpointError),
        'step True': (st._replace(step=True), train.CheckpointError),
        'step [1, 2]': (st._replace(step=np.array([1, 2])), train.CheckpointError),
        'step != optimizer': (st._replace(step=7), train.CheckpointError),
        'key float': (st._replace(key=np.zeros(2)), train.CheckpointError),
    }[case]
    with pytest.raises(err, match=str(path)): train.save_checkpoint(path, bad)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ['c.safetensors']


def _lie(flat, meta, case):
    "The tensors and header metadata of a checkpoint `flat`/`meta` changed to tell `case`."
    flat, meta = dict(flat), dict(meta)
    if case == 'step -5': flat['step'] = np.int64(-5)
    elif case == 'step float': flat['step'] = np.float64(3.0)
    elif case == 'step shape': flat['step'] = np.array([3, 3], np.int64)
    elif case == 'no step': del flat['step']
    elif case == 'step != optimizer': flat['step'] = np.int64(2)
    elif case == 'optimizer != step': flat['opt_state.step'] = np.int64(9)
    elif case == 'header step': meta['step'] = '30'
    elif case == 'header junk': meta['step'] = '-5' * 1000
    elif case == 'key float': flat['key'] = np.zeros(2)
    elif case == 'key shape': flat['key'] = np.zeros(3, np.uint64)
    elif case == 'nan param': flat['params.head.w'] = flat['params.head.w'] * np.nan
    elif case == 'inf moment': flat['opt_state.nu.head.b'] = flat['opt_state.nu.head.b'] + np.inf
    return flat, meta


LIES = ['step -5', 'step float', 'step shape', 'no step', 'step != optimizer', 'optimizer != step',
        'header step', 'header junk', 'key float', 'key shape', 'nan param', 'inf moment']


@pytest.mark.parametrize('like', [True, False])
@pytest.mark.parametrize('case', LIES)
def test_load_checkpoint_refuses_a_file_that_lies(tmp_path, case, like):
    """A tampered checkpoint (step −5 ended in fold_in's ValueError; a step that disagrees with the
    optimizer's count was accepted): `CheckpointError` naming the file, with or without `like`."""
    from gradus.formats.safetensors import load_safetensors, save_safetensors
    loss_fn, get_batch, opt, s0 = _setup()
    st, _ = train.fit(loss_fn, s0, opt, get_batch, 3, progress=False)
    path = tmp_path / 'c.safetensors'
    train.save_checkpoint(path, st)
    save_safetensors(path, *_lie(*load_safetensors(path, with_metadata=True), case))
    with pytest.raises(train.CheckpointError, match=str(path)) as e:
        train.load_checkpoint(path, like=s0 if like else None)
    assert len(str(e.value)) < 400


def test_fit_removes_stale_temporaries_of_its_checkpoint(tmp_path):
    "A save killed mid-write leaves `.NAME.XXXXXXXX.tmp`; fit removes those, and no lookalike."
    loss_fn, get_batch, opt, s0 = _setup()
    path = tmp_path / 'c.safetensors'
    stale = ['.c.safetensors.ab_4x9qz.tmp', '.c.safetensors.00000000.tmp']
    kept = ['.c.safetensors.tmp', '.c.safetensors.ABCDEFGH.tmp', 'c.safetensors.abcdefgh.tmp',
            '.c.safetensors.abcdefghi.tmp', '.d.safetensors.abcdefgh.tmp', 'notes.tmp']
    for n in stale + kept: (tmp_path / n).write_text('x')
    train.fit(loss_fn, s0, opt, get_batch, 2, checkpoint=path, checkpoint_every=1, progress=False)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ['c.safetensors'])
