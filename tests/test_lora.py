"""LoRA on the frozen quantized model (nbs/lm/32_lora): the settings refused by name, PEFT's start
(`A` uniform, `B` zero) from explicit keys, `attach` into the one `models.forward` (its linear
layers are `qlinear.linear`, which runs `Adapted` nodes): step 0 is the base bit for bit; the
adapters' gradients against finite differences in float64 through a tiny Llama and Gemma 3 and
against the `autograd` package (and PyTorch where it is installed) on a stack of frozen quantized
MLP blocks; merged equals unmerged; dropout from keys; only the adapters train."""
import math

import numpy as np
import pytest

import gradus as gd
from gradus.core import kernels
from gradus.core import tensor as T
from gradus.errors import ConfigError, MemoryBudgetError, ShapeError
from gradus.formats import gguf
from gradus.formats.quants import GGMLType, dequantize_ref
from gradus.learn import loss, nn, optim, random
from gradus.lm import lora, models, qlinear
from gradus.lm.lora import LoraConfig

from _models import find
from test_qlinear import IDS, tiny_gguf

SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')


def randomized(tree, key, std=1.0):
    "`tree` with every leaf replaced by normal samples of `std`, in the leaf's dtype."
    leaves, td = gd.tree_flatten(tree)
    keys = random.split(key, len(leaves))
    return gd.tree_unflatten(td, [(std * random.rng(k).standard_normal(v.shape)).astype(v.dtype)
                                  for k, v in zip(keys, leaves)])


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    "{arch: (params, config)} of the tiny GGUFs of test_qlinear (every block type)."
    d = tmp_path_factory.mktemp('lora')
    return {a: models.from_gguf(tiny_gguf(d / f'{a}.gguf', a)) for a in ('llama', 'gemma3')}


# ------------------------------------------------------------------ settings
def test_settings_refused_by_name(tiny):
    params, _ = tiny['llama']
    cases = [(dict(rank=0), "rank must be an int >= 1, got 0"),
             (dict(rank=-3), "got -3"), (dict(rank=2.0), "got 2.0"), (dict(rank=True), "got True"),
             (dict(rank=129), r"rank 129 exceeds the width 128 of layers.0.wk \(128 x 256\)"),
             (dict(alpha=0.0), "alpha must be a finite number > 0, got 0.0"),
             (dict(alpha=float('inf')), "got inf"), (dict(alpha='16'), "got '16'"),
             (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
             (dict(dropout=-0.1), "got -0.1"),
             (dict(targets=('q', 'qkv')), "unknown target 'qkv'; choose from q, k, v, o, gate"),
             (dict(targets='q,,v'), "unknown target ''"), (dict(targets=()), "no target"),
             (dict(targets=('q', 'q')), "named twice")]
    for kw, words in cases:
        with pytest.raises(ConfigError, match=words):
            lora.check(params, LoraConfig(**kw))
    assert lora.check(params, LoraConfig(rank=128, targets=' q , v')) == [
        (0, 'wq', (256, 256)), (0, 'wv', (128, 256)), (1, 'wq', (256, 256)), (1, 'wv', (128, 256))]
    no_q = dict(params, layers=[{k: v for k, v in lp.items() if k != 'wq'}
                                for lp in params['layers']])
    with pytest.raises(ConfigError, match=r"target 'q' \(wq\) is not in layer 0"):
        lora.check(no_q, LoraConfig())
    attached = lora.attach(params, lora.init(random.key(0), params), LoraConfig())
    with pytest.raises(ConfigError, match="layers.0.wq already has an adapter"):
        lora.check(attached, LoraConfig())


# ------------------------------------------------------------------ the start
def test_init_is_peft_start_from_explicit_keys(tiny):
    """`A (r, cols)` within ±1/√cols, spread over it; `B (rows, r)` zeros; float32 (or the dtype
    asked); the same key gives the same adapters whatever the targets' order; another key,
    others."""
    params, _ = tiny['llama']
    cfg = LoraConfig(rank=4)
    ad = lora.init(random.key(3), params, cfg)
    assert [sorted(la) for la in ad['layers']] == [sorted(lora.TARGETS.values())] * 2
    for lp, la in zip(params['layers'], ad['layers']):
        for k, ab in la.items():
            rows, cols = lp[k].shape
            assert ab['a'].shape == (4, cols) and ab['b'].shape == (rows, 4)
            assert ab['a'].dtype == ab['b'].dtype == np.float32 and not ab['b'].any()
            bound = 1 / math.sqrt(cols)
            assert np.abs(ab['a']).max() <= bound and np.abs(ab['a']).max() > 0.9 * bound
            assert abs(float(ab['a'].std()) - bound / math.sqrt(3)) < 0.1 * bound
    assert lora.count(ad) == 2 * 4 * (2 * 512 + 2 * 384 + 3 * 512)
    other = lora.init(random.key(3), params, cfg._replace(targets=('down', 'v', 'q')))
    assert np.array_equal(other['layers'][1]['wv']['a'], ad['layers'][1]['wv']['a'])
    assert not np.array_equal(lora.init(random.key(4), params, cfg)['layers'][0]['wq']['a'],
                              ad['layers'][0]['wq']['a'])
    assert lora.init(random.key(3), params, cfg, np.float64)['layers'][0]['wq']['a'].dtype == \
        np.float64


@pytest.mark.parametrize('arch', ['llama', 'gemma3'])
def test_step_zero_is_the_base_bit_for_bit(arch, tiny):
    params, c = tiny[arch]
    adapted = lora.attach(params, lora.init(random.key(0), params), LoraConfig())
    for ids in (IDS, IDS[:1]):
        assert np.array_equal(models.forward(adapted, ids, c), models.forward(params, ids, c))
    w = adapted['layers'][1]['w_down']
    assert isinstance(w, qlinear.Adapted) and w.scale == 16 / 8 == LoraConfig().scale
    assert not isinstance(params['layers'][1]['w_down'], qlinear.Adapted)   # not modified


@needs_smollm2
def test_step_zero_is_the_base_on_smollm2():
    params, c = models.from_gguf(SMOLLM2)
    adapted = lora.attach(params, lora.init(random.key(1), params), LoraConfig())
    ids = np.array([1, 9690, 28, 253, 3485])
    for t in (ids, ids[:1]):
        assert np.array_equal(models.forward(adapted, t, c), models.forward(params, t, c))


def test_attach_refuses_adapters_of_another_shape(tiny):
    params, _ = tiny['llama']
    cfg = LoraConfig(rank=4)
    ad = lora.init(random.key(0), params, cfg)
    with pytest.raises(ShapeError, match=r"layers.0.wq is 256 x 256: at rank 8 it takes a "
                                         r"\(8, 256\) and b \(256, 8\), not a \(4, 256\)"):
        lora.attach(params, ad, LoraConfig(rank=8))
    with pytest.raises(ShapeError, match="an adapter for layers.0.wk, which the targets"):
        lora.attach(params, ad, cfg._replace(targets='q,v,o,gate,up,down'))
    missing = {'layers': [dict(la) for la in ad['layers']]}
    del missing['layers'][1]['w_up']
    with pytest.raises(ShapeError, match=r"no adapter \{'a', 'b'\} for layers.1.w_up"):
        lora.attach(params, missing, cfg)
    with pytest.raises(ShapeError, match="one dict per layer"):
        lora.attach(params, {'layers': ad['layers'][:1]}, cfg)


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize('arch', ['llama', 'gemma3'])
def test_adapter_gradients_through_models_forward_finite_differences(arch, tiny):
    """Rank-2 adapters on every matrix (random `B`, so every `A` has a gradient), float64, through
    the whole tiny model: every adapter leaf against central differences."""
    params, c = tiny[arch]
    cfg = LoraConfig(rank=2, alpha=4.0)
    ad = randomized(lora.init(random.key(5), params, cfg, np.float64), random.key(6), 0.05)
    f = lambda ad, ids: loss.cross_entropy(
        models.forward(lora.attach(params, ad, cfg), ids[:-1], c), ids[1:])
    value, grads = gd.value_and_grad(f)(ad, IDS)
    assert all(np.abs(g).max() > 0 for g in gd.tree_leaves(grads))
    assert gd.check_grads(f, (ad, IDS), max_elements=2) <= 1


def stack(p, x, eps=1e-5):
    "Llama MLP blocks on frozen matrices (32_lora's tiny stack)."
    for lp in p['layers']:
        h = nn.rms_norm({'scale': lp['ffn_norm']}, x, eps)
        g = qlinear.linear(lp['w_gate'], h)
        x = x + qlinear.linear(lp['w_down'], g * nn.sigmoid(g) * qlinear.linear(lp['w_up'], h))
    return x


def stack_params(key, dim=64, ffn=96, layers=2, types=('Q4_1', 'Q5_0', 'Q8_0')):
    k = iter(random.split(key, 4 * layers))
    m = lambda t, r, c: qlinear.random_qtensor(next(k), t, r, c, std=0.6 / c ** 0.5)
    gain = lambda: (1 + 0.1 * random.rng(next(k)).standard_normal(dim)).astype(np.float32)
    return {'layers': [{'ffn_norm': gain(), 'w_gate': m(types[0], ffn, dim),
                        'w_up': m(types[1], ffn, dim), 'w_down': m(types[2], dim, ffn)}
                       for _ in range(layers)]}


MLP = LoraConfig(rank=4, alpha=8.0, targets=('gate', 'up', 'down'))


@pytest.fixture(scope='module')
def small():
    p = stack_params(random.key(20))
    ad = randomized(lora.init(random.key(21), p, MLP, np.float64), random.key(22), 0.1)
    x = random.rng(random.key(23)).standard_normal((5, 64))
    P = random.rng(random.key(24)).standard_normal((5, 64))
    dense = [{k: dequantize_ref(lp[k].blocks, lp[k].type).reshape(lp[k].shape).astype(np.float64)
              for k in ('w_gate', 'w_up', 'w_down')} for lp in p['layers']]
    return p, ad, x, P, dense


def test_stack_gradients_finite_differences(small):
    p, ad, x, P, _ = small
    f = lambda ad, x: T.sum(stack(lora.attach(p, ad, MLP), x) * P)
    assert gd.check_grads(f, (ad, x), max_elements=24) <= 1


def test_stack_gradients_against_the_autograd_package(small):
    "Every adapter leaf against `autograd` on the stack written again in numpy, to 1e-10."
    autograd = pytest.importorskip('autograd')
    import autograd.numpy as anp
    p, ad, x, P, dense = small
    def reference(ad, x):
        for lp, w, a in zip(p['layers'], dense, ad['layers']):
            lin = lambda k, v: v @ w[k].T + MLP.scale * ((v @ a[k]['a'].T) @ a[k]['b'].T)
            h = x / anp.sqrt(anp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * lp['ffn_norm']
            g = lin('w_gate', h)
            x = x + lin('w_down', g / (1 + anp.exp(-g)) * lin('w_up', h))
        return anp.sum(x * P)
    ref = autograd.grad(reference)(ad, x)
    ours = gd.grad(lambda ad, x: T.sum(stack(lora.attach(p, ad, MLP), x) * P))(ad, x)
    pairs = list(zip(gd.tree_leaves(ours), gd.tree_leaves(ref)))
    assert len(pairs) == 12
    for o, r in pairs: assert np.abs(o - r).max() <= 1e-10 * np.abs(r).max()


def test_stack_gradients_against_pytorch(small):
    "Every adapter leaf against PyTorch autograd on the dequantized weights (float64), to 1e-10."
    torch = pytest.importorskip('torch', reason="PyTorch is not installed here (the autograd "
                                                "package is the independent reference)")
    p, ad, x, P, dense = small
    t = lambda v: torch.tensor(np.asarray(v, np.float64), requires_grad=True)
    tad = [{k: (t(ab['a']), t(ab['b'])) for k, ab in la.items()} for la in ad['layers']]
    h = torch.tensor(x)
    for lp, w, a in zip(p['layers'], dense, tad):
        lin = lambda k, v: v @ torch.tensor(w[k]).T + MLP.scale * ((v @ a[k][0].T) @ a[k][1].T)
        n = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * torch.tensor(
            lp['ffn_norm'].astype(np.float64))
        g = lin('w_gate', n)
        h = h + lin('w_down', torch.nn.functional.silu(g) * lin('w_up', n))
    (h * torch.tensor(P)).sum().backward()
    ours = gd.grad(lambda ad, x: T.sum(stack(lora.attach(p, ad, MLP), x) * P))(ad, x)
    for la, tla in zip(ours['layers'], tad):
        for k, ab in la.items():
            for mine, theirs in zip((ab['a'], ab['b']), tla[k]):
                ref = theirs.grad.numpy()
                assert np.abs(mine - ref).max() <= 1e-10 * np.abs(ref).max()


# ------------------------------------------------------------------ merge
def test_merged_equals_unmerged(small, tiny):
    "The stack in float64 to 1e-6 (merged in float32); the tiny Llama's logits in float32."
    p, ad, x, _, _ = small
    merged = lora.merge(p, ad, MLP)
    w = merged['layers'][0]['w_up']
    assert w.type == GGMLType.F32 and w.blocks.dtype == np.uint8 and w.shape == (96, 64)
    u, m = stack(lora.attach(p, ad, MLP), x), stack(merged, x)
    assert np.abs(u - m).max() <= 1e-6 * np.abs(u).max()
    params, c = tiny['llama']
    cfg = LoraConfig(rank=4, targets='q,k,v,o,gate,up,down')
    rad = randomized(lora.init(random.key(30), params, cfg), random.key(31), 0.05)
    u = models.forward(lora.attach(params, rad, cfg), IDS, c)
    m = models.forward(lora.merge(params, rad, cfg), IDS, c)
    assert np.abs(u - m).max() <= 1e-5 * np.abs(u).max()
    assert np.abs(u - models.forward(params, IDS, c)).max() > 1e-3       # the update counts
    d = lora.delta(rad['layers'][0]['wq'], cfg)
    assert d.dtype == np.float32 and np.allclose(d, cfg.scale * rad['layers'][0]['wq']['b']
                                                 @ rad['layers'][0]['wq']['a'])


def test_merge_checks_the_memory_first(small, monkeypatch):
    p, ad, _, _, _ = small
    monkeypatch.setattr(kernels, 'available_memory', lambda: 1000)
    with pytest.raises(MemoryBudgetError, match="lora.merge: 6 matrices in float32 needs"):
        lora.merge(p, ad, MLP)


# ------------------------------------------------------------------ dropout, training
def test_dropout_drops_the_adapter_input_from_keys(small):
    """With a key and a rate, each matrix's delta is `B(A·dropout(x))` with the key
    `fold_in(fold_in(key, layer), target)`; the same key repeats it, none runs no dropout; the base
    path never sees it; a traced key works."""
    p, ad, x, _, _ = small
    cfg = MLP._replace(dropout=0.5)
    key = random.key(40)
    on = lora.attach(p, ad, cfg, key)['layers'][1]['w_up']
    k = random.fold_in(random.fold_in(key, 1), list(lora.TARGETS.values()).index('w_up'))
    dropped = nn.dropout(k, x, 0.5, True)
    want = qlinear.linear(p['layers'][1]['w_up'], x) + cfg.scale * (
        (dropped @ ad['layers'][1]['w_up']['a'].T) @ ad['layers'][1]['w_up']['b'].T)
    assert np.allclose(qlinear.linear(on, x), want, rtol=1e-12, atol=1e-12)
    off = lora.attach(p, ad, cfg)['layers'][1]['w_up']
    assert off.key is None and np.array_equal(qlinear.linear(off, x),
                                              qlinear.linear(lora.attach(p, ad, MLP)['layers'][1]
                                                             ['w_up'], x))
    f = lambda ad, x, key: T.sum(stack(lora.attach(p, ad, cfg, key), x))
    a1, a2 = float(f(ad, x, key)), float(f(ad, x, key))
    assert a1 == a2 and a1 != float(f(ad, x, random.key(41)))
    value, grads = gd.value_and_grad(f)(ad, x, key)                      # the key traced
    assert np.isclose(float(value), a1, rtol=1e-12)


def test_only_the_adapters_train(small):
    """AdamW's state holds the adapters' leaves alone; a few steps lower the loss and leave every
    frozen block as it was, byte for byte."""
    p, _, _, _, _ = small
    before = [lp[k].blocks.copy() for lp in p['layers'] for k in ('w_gate', 'w_up', 'w_down')]
    teacher_cfg = LoraConfig(rank=2, alpha=2.0, targets=('gate', 'up', 'down'))
    teacher = lora.merge(p, randomized(lora.init(random.key(50), p, teacher_cfg), random.key(51),
                                       0.1), teacher_cfg)
    ad = lora.init(random.key(52), p, MLP)
    opt = optim.adamw(1e-2, weight_decay=0.0)
    state = opt.init(ad)
    assert len(gd.tree_leaves(state['mu'])) == len(gd.tree_leaves(ad)) == 12
    vg = gd.value_and_grad(lambda ad, x, y: loss.mse(stack(lora.attach(p, ad, MLP), x), y))
    losses = []
    for t in range(40):
        xb = random.rng(random.fold_in(random.key(53), t)).standard_normal((32, 64)).astype(
            np.float32)
        value, grads = vg(ad, xb, stack(teacher, xb))
        ad, state = opt.update(grads, state, ad)
        losses.append(float(value))
    assert losses[-1] < losses[0] / 4
    after = [lp[k].blocks for lp in p['layers'] for k in ('w_gate', 'w_up', 'w_down')]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
