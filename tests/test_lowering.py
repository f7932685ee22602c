"""gradus.scale.lowering: every primitive's JAX rule against gradus eager; `jax.grad` of the lowered
forward as an independent oracle for gradus's generated backward; errors; the lowered training
step against the numpy step; the data-parallel steps on 8 simulated devices and `gradus
shakespeare --backend jax --devices 2` (in subprocesses, so this process keeps its own XLA device
count and other tests that import jax are unaffected)."""
import json, os, subprocess, sys, textwrap
from pathlib import Path
import numpy as np
import pytest

jax = pytest.importorskip('jax', reason='jax is not installed (the extra: pip install -e ".[jax]")')
import jax.numpy as jnp  # noqa: E402
import gradus as gd  # noqa: E402
from gradus.core import tensor as T  # noqa: E402
from gradus.core import dtype as D  # noqa: E402
from gradus.scale import lowering as LW
from gradus.learn import nn, optim, random as R
from gradus.transformer import gpt
from gradus.transformer import attention as A  # noqa: E402
from gradus.core import ops
from gradus.learn import loss as L  # noqa: E402
from gradus.core.autograd import custom_vjp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
rng = np.random.default_rng(0)
f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
pos = lambda *s: (np.abs(rng.standard_normal(s)) + 0.5).astype(np.float32)
fl32 = lambda *v: np.array(v, np.float32)


@custom_vjp
def _clipped_identity(x): return x * 1.0
_clipped_identity.defvjp(lambda x: (x * 1.0, ()),
                         lambda res, ct: (T.where(abs(ct) < 1.0, ct, 0.0),))

# (primitive exercised, function, arguments). Backward-only primitives come from gd.grad(forward).
CASES = [
    ('add', lambda a, b: a + b, (f32(3, 4), f32(4))),
    ('subtract', lambda a, b: a - b, (f32(3, 1), f32(4))),
    ('multiply', lambda a, b: a * b, (f32(3, 4), f32(3, 4))),
    ('add', T.add, (np.array([1, 2, 3]), f32(3))),        # int64 + float32: gradus's promotion
    ('multiply', lambda a, b: T.add(T.multiply(a, b), 1),
     (f32(4).astype(D.bfloat16), f32(4).astype(D.bfloat16))),   # bfloat16 compute
    ('divide', lambda a, b: a / b, (f32(3, 4), pos(3, 4))),
    ('power', lambda a, b: a ** b, (pos(3, 4), f32(3, 4))),
    ('maximum', T.maximum, (fl32(1, 2, 3), fl32(1, 0, 5))),
    ('minimum', T.minimum, (fl32(1, 2, 3), fl32(1, 0, 5))),
    ('negative', lambda a: -a, (f32(5),)),
    ('exp', T.exp, (f32(5),)),
    ('log', T.log, (pos(5),)),
    ('log1p', T.log1p, (pos(5),)),
    ('sin', T.sin, (f32(5),)),
    ('cos', T.cos, (f32(5),)),
    ('tanh', T.tanh, (f32(5),)),
    ('sqrt', T.sqrt, (pos(5),)),
    ('absolute', T.absolute, (f32(5),)),
    ('erf', ops.erf, (f32(5),)),
    ('erfc', ops.erfc, (f32(5),)),
    ('sign', T.sign, (fl32(-2, 0, 3),)),
    ('less', T.less, (fl32(1, 2, 3), fl32(2, 2, 2))),
    ('less_equal', T.less_equal, (fl32(1, 2, 3), fl32(2, 2, 2))),
    ('greater', T.greater, (fl32(1, 2, 3), fl32(2, 2, 2))),
    ('greater_equal', T.greater_equal, (fl32(1, 2, 3), fl32(2, 2, 2))),
    ('equal', T.equal, (np.array([1, 2, 3]), np.array([1, 0, 3]))),
    ('not_equal', T.not_equal, (np.array([1, 2, 3]), np.array([1, 0, 3]))),
    ('isfinite', T.isfinite, (fl32(1, np.inf, -np.inf, np.nan),)),
    ('stop_gradient', lambda a: T.stop_gradient(a) * a, (f32(4),)),
    ('where', lambda c, a, b: T.where(c, a, b), (np.array([True, False, True]), f32(3), f32(1))),
    ('matmul', lambda a, b: a @ b, (f32(2, 3, 4), f32(4, 5))),
    ('matmul', lambda a, b: a @ b, (f32(2, 3, 4), f32(2, 4, 5))),
    ('matmul', lambda a, b: a @ b, (f32(4), f32(4, 2))),
    ('sum', lambda a: T.sum(a, axis=(0, 2), keepdims=True), (f32(2, 3, 4),)),
    ('max', lambda a: T.max(a, axis=-1), (f32(2, 3, 4),)),
    ('reshape', lambda a: T.reshape(a, (4, -1)), (f32(2, 3, 4),)),
    ('transpose', lambda a: T.transpose(a, (2, 0, 1)), (f32(2, 3, 4),)),
    ('broadcast_to', lambda a: T.broadcast_to(a, (3, 2, 4)), (f32(2, 1),)),
    ('cast', lambda a: T.cast(a, np.int32), (fl32(-1.7, 0.2, 2.9),)),
    ('cast', lambda a: T.cast(a, D.bfloat16), (f32(4),)),
    ('cast', lambda a: T.cast(a, np.float16), (f32(4),)),
    ('getitem', lambda a: a[1:, None, -1, ::2], (f32(3, 4, 5),)),
    ('index_put', gd.grad(lambda a: T.sum(a[1:, ::2] ** 2)), (f32(3, 4),)),
    ('take', lambda a, i: ops.take(a, i, axis=1), (f32(2, 5), np.array([[0, -1], [4, 2]]))),
    ('scatter_add', gd.grad(lambda a, i: T.sum(ops.take(a, i, axis=0) ** 2)),
     (f32(4, 3), np.array([1, 1, -1, 0, 1]))),                 # repeated and negative indices
    ('concatenate', lambda a, b: ops.concatenate([a, b], axis=1), (f32(2, 3), f32(2, 1))),
    ('gelu_tanh', ops.gelu, (f32(6),)),
    ('gelu_grad', gd.grad(lambda a: T.sum(ops.gelu(a))), (f32(6),)),
    ('silu', ops.silu, (f32(6),)),
    ('silu_grad', gd.grad(lambda a: T.sum(ops.silu(a))), (f32(6),)),
    ('custom_vjp_call', gd.grad(lambda a: T.sum(_clipped_identity(a) * a)), (f32(6),)),
    # the hand-written kernels of nn and attention (they live in their layers, not ops.PRIMITIVES)
    ('norm_rows', lambda a: nn.layer_norm({'scale': fl32(1, 2, 3, 4)}, a), (f32(3, 4),)),
    ('norm_rows_vjp', gd.grad(lambda a: T.sum(nn.rms_norm({'scale': fl32(1, 2, 3, 4)}, a) * a)),
     (f32(3, 4),)),
    ('causal_softmax', lambda q, k: A.scaled_dot_product_attention(q, k, k, A.causal_mask(3, 5)),
     (f32(2, 3, 4), f32(2, 5, 4))),
    ('causal_softmax_vjp', gd.grad(lambda q: T.sum(A.scaled_dot_product_attention(
        q, q, q, A.causal_mask(4)) ** 2)), (f32(2, 4, 3),)),
]
KERNEL_PRIMITIVES = {'norm_rows', 'norm_rows_vjp', 'causal_softmax', 'causal_softmax_vjp'}
IDS = [f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)]


def _prims(f, args):
    return {e.prim.name for e in gd.jit(f).lower(*args)[0].graph.eqns}


def _close(a, b, rtol=2e-6, atol=2e-6):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    if a.dtype.kind in 'iub' or b.dtype.kind in 'iub':
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol, atol=atol,
                                   equal_nan=True)


def test_every_primitive_has_a_rule_or_a_reason():
    "Each gradus primitive has a rule, or a reason in NO_RULE; the cases below cover every rule."
    from gradus.core.autograd import _custom_vjp_call_p
    names = {p.name for p in ops.PRIMITIVES} | {_custom_vjp_call_p.name, 'random_split',
                                               'random_fold_in', 'random_uniform'}
    names |= KERNEL_PRIMITIVES
    known = set(LW.RULES) | set(LW.NO_RULE)
    assert names == known, names ^ known
    assert not set(LW.RULES) & set(LW.NO_RULE)
    assert {n for n, _, _ in CASES} == set(LW.RULES)


@pytest.mark.parametrize('name,f,args', CASES, ids=IDS)
def test_rule_matches_gradus_eager(name, f, args):
    "The lowered function (under jax.jit) equals gradus's numpy result; its graph has the primitive"
    assert name in _prims(f, args)
    want = f(*args)
    got = jax.jit(LW.to_jax(f, *args))(*args)
    for a, b in zip(gd.tree_leaves(got), gd.tree_leaves(want)):
        assert np.asarray(a).dtype == LW.jax_dtype(np.asarray(b).dtype)
        _close(a, b)


NO_GRAD = ('sign', 'less', 'less_equal', 'greater', 'greater_equal', 'equal', 'not_equal',
           'isfinite', 'cast', 'take')
DIFF = [(n, f, a) for n, f, a in CASES if not hasattr(f, 'lower') and n not in NO_GRAD
        and all(np.asarray(x).dtype != D.bfloat16 for x in a)]
DIFF += [('take', lambda a: ops.take(a, np.array([[0, -1], [4, 0]]), axis=1), (f32(2, 5),)),
         ('gelu_grad', lambda a: gd.grad(lambda b: T.sum(ops.gelu(b) * b))(a), (f32(6),)),  # 2nd
         ('custom_vjp_call', lambda a: _clipped_identity(a) * 2.0, (f32(6),))]


@pytest.mark.parametrize('name,f,args', DIFF, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(DIFF)])
def test_jax_grad_of_lowered_forward_is_an_oracle(name, f, args):
    """jax.grad of the lowered forward (JAX's own derivative rules) equals gradus's generated
    backward for every float argument, away from the documented convention points."""
    fl = tuple(i for i, a in enumerate(args) if np.asarray(a).dtype.kind == 'f')
    proj = [rng.standard_normal(np.shape(o)).astype(np.float32) for o in gd.tree_leaves(f(*args))]
    def scalar(*a):
        return sum(T.sum(T.cast(o, np.float32) * p) for o, p in zip(gd.tree_leaves(f(*a)), proj))
    want = gd.grad(scalar, argnums=fl)(*args)
    lowered = LW.to_jax(scalar, *args)
    if name == 'custom_vjp_call':  # gradus runs the user's bwd; JAX differentiates the user's fwd
        ct = 2 * proj[0]
        _close(want[0], np.where(np.abs(ct) < 1, ct, 0))
        _close(jax.grad(lowered)(*args), ct)
        assert (np.abs(ct) >= 1).any()       # so the two really differ here
        return
    got = jax.grad(lowered, argnums=fl)(*args)
    for a, b in zip(got, want): _close(a, b, rtol=2e-5, atol=2e-6)


def test_documented_conventions():
    "The convention differences listed in the notebook: d|x|/dx at 0, d(x**y)/dy at x = 0."
    x0 = np.zeros(1, np.float32)
    g_gradus = gd.grad(lambda x: T.sum(T.absolute(x)))(x0)
    g_jax = jax.grad(LW.to_jax(lambda x: T.sum(T.absolute(x)), x0))(x0)
    assert g_gradus[0] == 0 and g_jax[0] == 1
    y = np.full(1, 2.0, np.float32)
    f = lambda x, y: T.sum(x ** y)
    with np.errstate(divide='ignore', invalid='ignore'):
        assert np.isnan(gd.grad(f, argnums=1)(x0, y)[0])
    assert jax.grad(LW.to_jax(f, x0, y), argnums=1)(x0, y)[0] == 0


def test_float64_needs_x64():
    "float64 raises LoweringError without x64 (naming the variable); under x64 it matches to 1e-12."
    x = np.linspace(-1, 1, 7)
    f = lambda a: T.sum(T.tanh(a) * T.exp(a))
    low = LW.to_jax(gd.grad(f), x)
    with pytest.raises(LW.LoweringError, match=r'a:float64\[7\] is float64'): low(x)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(low)(x))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, gd.grad(f)(x), rtol=1e-12, atol=1e-14)


def test_missing_rule_names_the_primitive():
    "A primitive with no rule (and no key to run it on the host): an error naming it."
    twice_p = T.Primitive('twice', lambda x: 2 * x, lambda x: (tuple(x.shape), x.dtype))
    with pytest.raises(LW.LoweringError, match="no JAX lowering rule for primitive 'twice'"):
        LW.to_jax(lambda a: twice_p.bind(a) + 1.0, np.ones(3, np.float32))


def test_dropout_draws_run_on_the_host():
    """Dropout's random draws (split, fold_in, uniform from key arguments) run on the host with
    numpy, so the lowered value_and_grad equals gradus's exactly, masks included; the device part
    jits; a traced key is refused with a clear error."""
    def f(a, k):
        k1, k2 = R.split(R.fold_in(k, 3), 2)
        return T.sum(nn.dropout(k1, a, 0.5, True) * nn.dropout(k2, a, 0.3, True))
    a, k = pos(4, 5), R.key(11)
    low = LW.to_jax(gd.value_and_grad(f), a, k)
    assert not {'random_split', 'random_fold_in', 'random_uniform'} & {e.prim.name for e in
                                                                       low.graph.eqns}
    assert 1 in low.unused                      # the key leaf: read on the host only
    drawn = low.host(a, k)
    assert [d.dtype for d in drawn] == [np.bool_, np.bool_]
    want = gd.value_and_grad(f)(a, k)
    for got in (low(a, k), jax.jit(low.device)(drawn, a, k)):
        _close(got[0], want[0], rtol=1e-6)
        _close(got[1], want[1], rtol=1e-6)
    assert (np.asarray(want[1]) == 0).any()     # some elements were dropped
    with pytest.raises(LW.LoweringError, match='need concrete numpy keys'): jax.jit(low)(a, k)


def test_out_of_range_index_reads_nan_where_numpy_raises():
    "The documented decision: numpy raises IndexError; the lowered take reads NaN, not a real row."
    E, ids = f32(3, 2), np.array([0, 3])
    with pytest.raises(IndexError): ops.take(E, ids)
    got = np.asarray(LW.to_jax(lambda e, i: ops.take(e, i), E, ids)(E, ids))
    np.testing.assert_array_equal(got[0], E[0])
    assert np.isnan(got[1]).all()


def test_int64_input_that_does_not_fit_int32_is_refused():
    f = lambda i: ops.take(np.ones((3, 2), np.float32), i)
    ok = np.array([0, 2])
    low = LW.to_jax(f, ok)
    _close(low(ok), np.ones((2, 2)))
    with pytest.raises(LW.LoweringError, match='do not fit int32'): low(np.array([0, 2**40]))


def test_shape_dtype_and_structure_checks_can_fail(monkeypatch):
    "Another shape or structure is refused; a rule giving the wrong dtype is caught at trace time."
    f = lambda a: T.exp(a) * 2.0
    x = f32(3)
    low = LW.to_jax(f, x)
    with pytest.raises(LW.LoweringError, match=r'input a: JAX computed float32\[4\]'): low(f32(4))
    with pytest.raises(ValueError, match='differ'): low((x,))
    monkeypatch.setitem(LW.RULES, 'exp', lambda a: jnp.exp(a).astype(jnp.float16))
    msg = r'b = exp: JAX computed float16\[3\], gradus expects float32\[3\]'
    with pytest.raises(LW.LoweringError, match=msg): low(x)


def test_to_jax_accepts_every_kind_of_function():
    "Plain, grad, value_and_grad and jit functions lower to functions of the same output pytree."
    p = {'w': f32(3, 2), 'b': f32(2)}
    x = f32(4, 3)
    loss = lambda p, x: T.sum(T.tanh(x @ p['w'] + p['b']) ** 2)
    for fn in (loss, gd.grad(loss), gd.value_and_grad(loss), gd.jit(loss), gd.jit(gd.grad(loss))):
        want, got = fn(p, x), LW.to_jax(fn, p, x)(p, x)
        assert gd.tree_flatten(got)[1] == gd.tree_flatten(want)[1]
        for a, b in zip(gd.tree_leaves(got), gd.tree_leaves(want)): _close(a, b, rtol=1e-5)


def test_lowered_training_step_tracks_numpy_step():
    """The whole lowered step (GPT loss, generated backward, clipping, AdamW with schedule and decay
    mask) against gradus's numpy route (value_and_grad, clip_by_global_norm, adamw), 4 steps."""
    cfg = gpt.GPTConfig(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=16)
    params = gpt.init(R.key(1), cfg)
    r = np.random.default_rng(2)
    x, y = r.integers(0, 13, (4, 8)), r.integers(0, 13, (4, 8))      # (B, T) each
    loss_fn = lambda p, x, y: L.cross_entropy(gpt.apply(p, x, cfg), y)
    sched = optim.warmup_cosine(1e-2, 2, 10)
    opt = LW.AdamW(sched, (0.9, 0.99), 1e-8, 0.1, optim.decay_mask, clip_norm=0.5)
    np_opt = optim.adamw(sched, opt.betas, opt.eps, opt.weight_decay, mask=opt.mask)
    moments = {'mu': gd.tree_map(np.zeros_like, params), 'nu': gd.tree_map(np.zeros_like, params)}
    step = LW.train_step(loss_fn, opt)
    jstep = jax.jit(LW.to_jax(step, params, moments, LW.adamw_hyper(opt, 0), x, y))
    vg = gd.value_and_grad(loss_fn)
    p_np, s_np, p_jx, m_jx = params, np_opt.init(params), params, moments
    clipped = 0
    for t in range(4):
        l_np, g = vg(p_np, x, y)
        g, n_np = optim.clip_by_global_norm(g, opt.clip_norm)
        p_np, s_np = np_opt.update(g, s_np, p_np)
        l_jx, p_jx, m_jx, n_jx = jstep(p_jx, m_jx, LW.adamw_hyper(opt, t), x, y)
        clipped += n_np > opt.clip_norm
        np.testing.assert_allclose(float(l_jx), float(l_np), rtol=2e-5)
        np.testing.assert_allclose(float(n_jx), n_np, rtol=1e-4)
        for a, b in zip(gd.tree_leaves(p_jx), gd.tree_leaves(p_np)): _close(a, b, 1e-4, 2e-5)
        for a, b in zip(gd.tree_leaves(m_jx['nu']), gd.tree_leaves(s_np['nu'])):
            _close(a, b, 1e-3, 1e-9)
    assert clipped >= 2   # the clipping branch was exercised


MULTI = textwrap.dedent('''
    import os, json
    os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
    import numpy as np, jax
    import gradus as gd
    from gradus.scale import lowering as LW
    from gradus.learn import optim, nn, random as R, loss as L
    from gradus.core import tensor as T
    from gradus.core import ops
    k = R.split(R.key(0), 3)
    params = {'emb': {'w': nn.normal(k[0], (11, 4), 0.5)}, 'w1': nn.glorot_uniform(k[1], (12, 16)),
              'b1': nn.zeros((16,)), 'w2': nn.glorot_uniform(k[2], (16, 11))}
    def loss_fn(p, ids, y):
        h = nn.embedding(p['emb'], ids).reshape(ids.shape[0], -1)   # (B, T*C)
        return L.cross_entropy(ops.gelu(h @ p['w1'] + p['b1']) @ p['w2'], y)
    r = np.random.default_rng(2)
    x, y = r.integers(0, 11, (16, 3)), r.integers(0, 11, 16)
    opt = LW.AdamW(1e-2, (0.9, 0.99), 1e-8, 0.1, optim.decay_mask, clip_norm=0.5)
    moments = {'mu': gd.tree_map(np.zeros_like, params), 'nu': gd.tree_map(np.zeros_like, params)}
    hyper = LW.adamw_hyper(opt, 0)
    lowered = LW.to_jax(LW.train_step(loss_fn, opt), params, moments, hyper, x, y)
    mesh = LW.data_mesh(8)
    ref = jax.jit(lowered)(params, moments, hyper, x, y)
    out = {'devices': len(jax.devices())}
    for name, fn in [('jit', LW.data_parallel(lowered, mesh, (3, 4))),
                     ('shard_map', LW.shard_map_step(loss_fn, opt, mesh, params, moments, hyper,
                                                     x, y))]:
        got = fn(params, moments, hyper, x, y)
        out[name] = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                        for a, b in zip(gd.tree_leaves(got), gd.tree_leaves(ref)))
        out[name + '_devices'] = len(got[1]['w1'].sharding.device_set)
    try: LW.shard_map_step(loss_fn, opt, mesh, params, moments, hyper, x[:12], y[:12])
    except ValueError as e: out['uneven'] = str(e)
    print(json.dumps(out))
''')


def _env():
    return {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'} | {'PYTHONPATH': str(ROOT)}


def test_data_parallel_steps_equal_single_device_on_8_devices():
    """jit + NamedSharding and shard_map + pmean on 8 simulated CPU devices give the single-device
    step (an embedding + GELU model, batch 16, two rows per device; the GPT runs data parallel in
    the Shakespeare test). A subprocess: XLA reads the device count once, before jax starts."""
    res = subprocess.run([sys.executable, '-c', MULTI], capture_output=True, text=True, env=_env(),
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out['devices'] == 8 and out['jit_devices'] == 8 and out['shard_map_devices'] == 8
    assert out['jit'] < 1e-5 and out['shard_map'] < 1e-5, out
    assert out['uneven'] == 'shard_map_step: batch 12 is not a multiple of 8'


def test_data_mesh_refuses_more_devices_than_exist():
    assert LW.data_mesh(1).shape['data'] == 1
    with pytest.raises(ValueError, match='data_mesh: 9 devices requested'):
        LW.data_mesh(9 * len(jax.devices()))


TINY = ['--iters', '50', '--eval-interval', '50', '--eval-iters', '1', '--batch-size', '4',
        '--block-size', '16', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--warmup', '5',
        '--lr', '1e-2', '--min-lr', '1e-3', '--dropout', '0.1', '--sample-len', '5',
        '--no-progress']


def _config(argv):
    from gradus.jobs import shakespeare as S
    from gradus.jobs.cli import build_parser
    ns = build_parser().parse_args(['shakespeare', *argv])
    return S.RunConfig(**{k: getattr(ns, k) for k in S.RunConfig._fields if hasattr(ns, k)})


def test_shakespeare_jax_backend_tracks_numpy_over_50_steps(tmp_path):
    """`gradus shakespeare --backend jax --devices 2` (a subprocess, where JAX starts with 2 CPU
    devices) against the numpy backend in this process: tiny model with dropout 0.1 (masks drawn on
    the host, sharded with the batch), same text and seed; the 50 training losses agree within
    float32 tolerance, and so do the final validation losses."""
    from gradus.jobs import shakespeare as S
    text = tmp_path / 'text.txt'
    text.write_text((ROOT / 'README.md').read_text(encoding='utf-8')[:20000], encoding='utf-8')
    cfg = _config(['--data', str(text), '--out', str(tmp_path / 'np'), *TINY])
    _, rec_np = S.run(cfg, progress=False, log=lambda *a: None)
    argv = ['--data', str(text), '--out', str(tmp_path / 'jx'), *TINY, '--backend', 'jax',
            '--devices', '2']
    res = subprocess.run([sys.executable, '-m', 'gradus', 'shakespeare', *argv],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rec_jx = S.read_metrics(tmp_path / 'jx')
    assert json.loads((tmp_path / 'jx' / 'config.json').read_text())['run']['devices'] == 2
    assert [r['step'] for r in rec_jx] == [r['step'] for r in rec_np] == list(range(1, 51))
    diff = max(abs(a['train_loss'] - b['train_loss']) for a, b in zip(rec_np, rec_jx))
    assert diff < 1e-4, diff
    assert rec_np[-1]['train_loss'] < rec_np[0]['train_loss'] - 0.5     # it trained: not vacuous
    assert abs(rec_np[-1]['val_loss'] - rec_jx[-1]['val_loss']) < 1e-4


@pytest.mark.parametrize('kw,msg', [
    (dict(backend='tpu'), "--backend must be 'numpy' or 'jax'"),
    (dict(devices=2), '--devices must be 1'),
    (dict(backend='jax', devices=5), '--batch-size must be a multiple of --devices 5')])
def test_shakespeare_backend_settings_are_checked(kw, msg):
    from gradus.jobs import shakespeare as S
    with pytest.raises(S.ConfigError, match=msg): S.check_config(S.RunConfig(**kw))


def test_shakespeare_jax_backend_needs_its_training_loop():
    from gradus.jobs import shakespeare as S
    with pytest.raises(S.ConfigError, match='--backend jax: pass its training loop'):
        S.run(S.RunConfig(backend='jax', out='/nonexistent/never-written'))


NO_JAX = textwrap.dedent('''
    import sys
    sys.modules['jax'] = None                  # as if the extra were not installed
    import numpy as np
    from gradus.scale import lowering
    from gradus.core import tensor as T
    from gradus.core import ops
    from gradus.jobs.cli import main
    try: lowering.to_jax(lambda a: T.exp(a), np.ones(2, np.float32))
    except ImportError as e: print('to_jax:', e)
    print('exit', main(['shakespeare', '--backend', 'jax', '--iters', '1']))
''')


def test_without_jax_the_module_imports_and_use_says_how_to_install():
    "gradus.scale.lowering and the gradus command import without jax; using them names the extra."
    res = subprocess.run([sys.executable, '-c', NO_JAX], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "to_jax: gradus.scale.lowering needs jax: pip install 'gradus[jax]'" in res.stdout
    assert 'exit 1' in res.stdout
    assert "gradus shakespeare: --backend jax: gradus.scale.lowering needs jax" in res.stderr
