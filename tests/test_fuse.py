"""The fusion pass of gradus.core.fuse: fused equals unfused over the gradcheck sweep (float64 to
1e-12,
float32 to 1e-5, relative to the largest magnitude of each output), a short GPT training run with
fusion on and off, the switches, the dtype rule, the disk cache read by a second process, and the
profiler."""
import json, os, subprocess, sys, textwrap
import numpy as np
import pytest
import ml_dtypes
import gradus as gd
from gradus.core import tensor as T
from gradus.core import fuse as F, codegen as CG
from gradus.core.pytree import tree_map, tree_leaves, tree_flatten, tree_unflatten
from test_gradcheck import CASES

TOL = {np.float64: 1e-12, np.float32: 1e-5}


def _scalarized(f, args):
    "`f` made scalar by a fixed random projection of its output (as check_grads does)."
    rng = np.random.default_rng(0)
    proj = tree_map(lambda o: rng.standard_normal(np.shape(o)), f(*args))
    def s(*a):
        return sum(T.sum(o * np.asarray(p, o.dtype)) for o, p in zip(tree_leaves(f(*a)),
                                                                         tree_leaves(proj)))
    return s


def _fused_and_unfused(f, args):
    """Outputs of `value_and_grad` (value, then every gradient) unfused and fused (every size, the
    transcendental templates included)."""
    s = _scalarized(f, args)
    entry, leaves = gd.value_and_grad(s, argnums=tuple(range(len(args))), fuse=False).lower(*args)
    fused = F.fuse(entry.graph, min_size=0, transcendental=True)
    n_kernels = sum(isinstance(e.prim, F.Kernel) for e in fused.eqns)
    TOTALS[f] = sum(isinstance(e.prim, F.Kernel) and any(m.prim.name in F.REDUCTIONS
                                                         for m in e.prim.eqns) for e in fused.eqns)
    return entry.compiled.fn(*leaves), CG.compile_graph(fused).fn(*leaves), n_kernels


KERNELS, TOTALS = {}, {}


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
@pytest.mark.parametrize('name', list(CASES))
def test_sweep_fused_equals_unfused(name, dtype):
    f, args = CASES[name]
    args = tuple(a.astype(dtype) for a in args)
    with np.errstate(all='ignore'):
        off, on, k = _fused_and_unfused(f, args)
    KERNELS[name, dtype] = k
    for a, b in zip(off, on):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        scale = max(float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)), 1e-30)
        assert np.array_equal(np.isfinite(a), np.isfinite(b)), name
        err = float(np.max(np.abs(a - b)[np.isfinite(a)], initial=0.0)) / scale
        assert err <= TOL[dtype], f"{name} {dtype.__name__}: {err:.2e} relative"


def test_sweep_fused_something():
    "The sweep is not vacuous: most elementwise cases do make kernels."
    if not KERNELS: pytest.skip("run with the sweep above (it records the kernel counts)")
    fused = [n for (n, d), k in KERNELS.items() if k and d == np.float64]
    assert len(fused) >= 25, fused
    assert sum(1 for k in TOTALS.values() if k) >= 10, TOTALS      # kernels ending in a row total


def test_cycle_rule_and_order():
    "A use through a matmul keeps `exp` out of the later group; the fused graph is still right."
    def f(x, w):
        h = T.exp(x)
        return h * (h @ w) + 1.0
    x, w = np.random.default_rng(0).standard_normal((2, 64, 64))
    g = gd.trace(f, x, w)
    assert F.group_eqns(g, 0, transcendental=True) == [0, -1, 1, 1]
    assert F.group_eqns(g, 0) == [-1, -1, 0, 0]                 # exp left to numpy by default
    out = CG.compile_graph(F.fuse(g, 0, transcendental=True)).fn(x, w)[0]
    np.testing.assert_allclose(out, np.exp(x) * (np.exp(x) @ w) + 1, rtol=1e-12)


def test_switches_and_dtypes(monkeypatch):
    "fuse=False, GRADUS_FUSE=0 and float16/bfloat16 all leave numpy code; float32 stays float32."
    def f(x): return T.sum(T.tanh(x * 2.0 + 1.0) ** 2)
    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    assert '@njit' in gd.show_code(gd.value_and_grad(f), x)
    assert '@njit' not in gd.show_code(gd.value_and_grad(f, fuse=False), x)
    monkeypatch.setenv('GRADUS_FUSE', '0')
    assert '@njit' not in gd.show_code(gd.value_and_grad(f), x)
    assert '@njit' in gd.show_code(gd.value_and_grad(f, fuse=True), x)
    monkeypatch.delenv('GRADUS_FUSE')
    for d in (np.float16, ml_dtypes.bfloat16):
        assert '@njit' not in gd.show_code(gd.value_and_grad(f), x.astype(d))
    v, g = gd.value_and_grad(f)(x)
    assert v.dtype == g.dtype == np.float32
    v0, g0 = gd.value_and_grad(f, fuse=False)(x)
    np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-6)


def _tiny_gpt():
    from gradus.transformer import gpt
    from gradus.learn import random, loss as L
    cfg = gpt.GPTConfig(65, 16, 2, 2, 32)
    params = gpt.init(random.key(0), cfg)
    tok = np.random.default_rng(0).integers(0, 65, (2, 4, 17))     # two batches, alternating
    return params, tok, lambda p, x, y: L.cross_entropy(gpt.apply(p, x, cfg), y)


def _train(fuse, steps=50, lr=0.5):
    params, tok, loss = _tiny_gpt()
    vg = gd.value_and_grad(loss, fuse=fuse)
    losses, leaves, td = [], *tree_flatten(params)
    for s in range(steps):
        value, g = vg(tree_unflatten(td, leaves), tok[s % 2, :, :-1], tok[s % 2, :, 1:])
        leaves = [p - np.float32(lr) * q for p, q in zip(leaves, tree_leaves(g))]
        losses.append(float(value))
    return np.array(losses), vg


def test_gpt_training_fused_equals_unfused(monkeypatch):
    """50 SGD steps of a tiny GPT on two batches, every elementwise chain fused (min size 0): losses
    equal to float32 tolerance."""
    monkeypatch.setattr(F, 'FUSE_MIN_SIZE', 0)
    off, _ = _train(False)
    on, vg = _train(True)
    params, tok, _ = _tiny_gpt()
    kernels = [e for e in vg.lower(params, tok[0, :, :-1], tok[0, :, 1:])[0].compiled.graph.eqns
               if isinstance(e.prim, F.Kernel)]
    assert len(kernels) >= 10
    assert off[-1] < off[0] - 0.3                       # it trains
    np.testing.assert_allclose(on, off, rtol=2e-5)


_CHILD = textwrap.dedent("""
    import json, numpy as np, gradus as gd
    from gradus.core import tensor as T, fuse as F
    def f(x): return T.sum(T.exp(T.tanh(x * 3.0 - 1.0)) * x)
    x = np.linspace(-1, 1, 8192).reshape(64, 128)
    vg = gd.value_and_grad(f, fuse=True)
    v, g = vg(x)
    ks = [e.prim for e in vg.lower(x)[0].compiled.graph.eqns if isinstance(e.prim, F.Kernel)]
    stats = [k.impl.stats for k in ks]
    print(json.dumps({'value': float(v), 'kernels': len(ks),
                      'hits': sum(sum(s.cache_hits.values()) for s in stats),
                      'misses': sum(sum(s.cache_misses.values()) for s in stats)}))
""")


def test_disk_cache_serves_a_second_process(tmp_path):
    "The first process compiles and writes the cache; a second one loads every kernel from it."
    env = {**os.environ, 'GRADUS_CACHE': str(tmp_path)}
    def run():
        out = subprocess.run([sys.executable, '-c', _CHILD], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])
    first, second = run(), run()
    assert first['kernels'] >= 1 and first['misses'] >= 1 and first['hits'] == 0
    assert second['misses'] == 0 and second['hits'] == second['kernels'] == first['kernels']
    assert second['value'] == first['value']
    files = list((tmp_path / 'kernels').glob('k*.py'))
    assert len(files) == first['kernels'] and not list((tmp_path / 'kernels').glob('*.tmp'))


def test_profile_counts_every_line():
    "One row per generated line (equations and dels); a plain function is refused."
    def f(x): return T.sum(T.tanh(x) * x)
    x = np.ones((64, 128))
    for fuse in (False, True):
        vg = gd.value_and_grad(f, fuse=fuse)
        p = F.profile(vg, x, repeat=3)
        src = vg.lower(x)[0].compiled.source.split('\n\n')[0].splitlines()[1:-1]
        assert len(p.lines) == len(src) and p.seconds.shape == (len(src),)
        assert ('fused' in p.labels) == fuse and 'matmul' not in p.labels
        assert 'profile of value_and_grad(f)' in repr(p)
    with pytest.raises(TypeError, match='jit/grad/value_and_grad'):
        F.profile(f, x)
