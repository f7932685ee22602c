"""LoRA adapters on the fused decode engine (issue 21): `engine.decode_step` on parameters with
`lora.attach`'s `qlinear.Adapted` nodes against the general path (`models.forward` on the same
parameters: `apply` for the logits, `models.stepper(fused=False)` for greedy text), on SmolLM2.

The oracle is `models.forward`, which computes `W x + s·(x Aᵀ) Bᵀ` with numpy's matmul on the
float32 activations; the engine adds `s·B[r]·(A x)` inside its row kernels. Exact mode must meet
the tolerance the engine meets without adapters (`< 1e-3` on every logit, `26_engine`); adapters
whose `B` is zero must leave every bit of the logits as they are without adapters."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _models import find
from gradus.errors import ConfigError, NonFiniteError
from gradus.formats import gguf
from gradus.learn import random
from gradus.lm import decode, engine, lora, qlinear
from gradus.lm.models import apply, from_gguf, new_cache, stepper

SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')
pytestmark = needs_smollm2
PROMPT = [1, 504, 2365, 6354, 16438, 314, 253, 1234, 28, 411, 3458, 5]


@pytest.fixture(scope='module')
def model():
    return from_gguf(SMOLLM2)


def noisy(params, rank, targets=lora.DEFAULT_TARGETS, seed=0):
    "`params` with adapters of `rank` on `targets`: `A` from `lora.init`, `B` 0.3·normal."
    lc = lora.LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets)
    ad = lora.init(random.key(seed), params, lc)
    rng = np.random.default_rng(seed)
    for lp in ad['layers']:
        for v in lp.values(): v['b'] = (0.3 * rng.standard_normal(v['b'].shape)).astype(np.float32)
    return lora.attach(params, ad, lc)


def mixed(params):
    "Adapters of ranks 1, 3 and 8 on three matrices of three layers, by hand; the rest plain."
    rng, layers = np.random.default_rng(7), [dict(lp) for lp in params['layers']]
    for (i, k), r in zip([(0, 'wq'), (5, 'w_down'), (29, 'wv')], (1, 3, 8)):
        rows, cols = layers[i][k].shape
        a = rng.uniform(-1, 1, (r, cols)).astype(np.float32) / np.sqrt(cols)
        b = (0.3 * rng.standard_normal((rows, r))).astype(np.float32)
        layers[i][k] = qlinear.Adapted(layers[i][k], a, b, 1.5)
    return dict(params, layers=layers)


def steps(params, config, exact, toks=PROMPT[:6]):
    "Logits `(n, vocab)` of the fused engine, one token at a time from position 0."
    cache = decode.KVCache(config.n_layers, 16, config.n_kv_heads, config.head_dim)
    ws = engine.workspace(params, config, 16)
    return np.stack([engine.decode_step(params, config, cache, t, p, ws, exact)
                     for p, t in enumerate(toks)])


CASES = {'rank 4, all seven': lambda p: noisy(p, 4), 'rank 8, all seven': lambda p: noisy(p, 8),
         'rank 8, q v down': lambda p: noisy(p, 8, ('q', 'v', 'down'), 1), 'mixed ranks': mixed}


@pytest.mark.parametrize('case', CASES)
def test_fused_step_matches_forward(model, case):
    params, config = model
    p = CASES[case](params)
    assert engine.unsupported(p, config) == []
    toks = np.array(PROMPT)
    ref = apply(p, toks, config)
    assert np.abs(ref - apply(params, toks, config)).max() > 1      # the adapter matters
    step = stepper(p, config, new_cache(config, 16), exact=True, all_logits=True, fused=True)
    gaps = decode.decode_parity(step, lambda t: ref, toks, n_prefill=4)
    assert gaps[4:].max() < 1e-3


@pytest.mark.parametrize('case', ['rank 8, all seven', 'mixed ranks'])
def test_greedy_text_matches_general_path(model, case):
    params, config = model
    p = CASES[case](params)

    def greedy(**kw):
        step, prompt = stepper(p, config, new_cache(config, 32), **kw), np.array(PROMPT[:8])
        out, logits = [], step(prompt, 0)
        for i in range(16):
            out.append(int(np.argmax(logits)))
            logits = step(np.array(out[-1:]), len(prompt) + i)
        return out

    assert greedy(fused=True, exact=True) == greedy(fused=False)


@pytest.mark.parametrize('exact', [True, False])
def test_zero_adapters_leave_every_bit(model, exact):
    params, config = model
    lc = lora.LoraConfig(rank=8)
    zero = lora.attach(params, lora.init(random.key(3), params, lc), lc)   # B = 0
    assert np.array_equal(steps(zero, config, exact), steps(params, config, exact))


def test_int8_mode_runs_and_stays_near_exact(model):
    params, config = model
    p = noisy(params, 8)
    exact, int8 = steps(p, config, True), steps(p, config, False)
    assert np.isfinite(int8).all() and 0 < np.abs(exact - int8).max() < 4


def test_refusals_name_the_matrix(model):
    params, config = model
    lc = lora.LoraConfig(rank=4, dropout=0.1)
    ad = lora.init(random.key(0), params, lc)
    assert engine.unsupported(lora.attach(params, ad, lc), config) == []   # no key: no mask
    keyed = lora.attach(params, ad, lc, key=random.key(1))
    assert engine.unsupported(keyed, config)[0] == \
        'layers.0.wq: adapter dropout rate=0.1 with a key (training)'
    with pytest.raises(ConfigError, match='layers.0.wq: adapter dropout'):
        engine.workspace(keyed, config, 8)
    layers = [dict(lp) for lp in params['layers']]
    w = layers[2]['wo']
    layers[2]['wo'] = qlinear.Adapted(w, np.zeros((4, 7), np.float32),
                                      np.zeros((w.shape[0], 4), np.float32), 1.0)
    bad = dict(params, layers=layers)
    refused = engine.unsupported(bad, config)
    assert any(s.startswith('layers.2.wo: adapter A (4, 7)') for s in refused)
    head = dict(params, output=qlinear.Adapted(params['output'], None, None, 1.0))
    assert 'an adapter on the head (output)' in engine.unsupported(head, config)


def test_nonfinite_adapter_names_it(model):
    params, config = model
    layers = [dict(lp) for lp in params['layers']]
    w = layers[2]['w_up']
    b = np.zeros((w.shape[0], 2), np.float32)
    b[17, 1] = np.nan
    layers[2]['w_up'] = qlinear.Adapted(w, np.ones((2, w.shape[1]), np.float32), b, 1.0)
    p = dict(params, layers=layers)
    cache = decode.KVCache(config.n_layers, 4, config.n_kv_heads, config.head_dim)
    with pytest.raises(NonFiniteError, match=r"blk\.2\.ffn_up\.weight.*adapter whose B holds nan "
                                             r"at \[17, 1\]"):
        engine.decode_step(p, config, cache, 1, 0, engine.workspace(p, config, 4))
    assert cache.length == 0


def test_one_worker_and_all_give_the_same_bits(model):
    "Each worker makes its own `u`; whichever worker claims a row, the row gets the same bits."
    import numba
    params, config = model
    p = noisy(params, 8, ('q', 'o', 'up', 'down'))
    numba.set_num_threads(1)
    try:
        one = steps(p, config, False)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(one, steps(p, config, False))
