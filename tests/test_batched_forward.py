"""`models.forward` on a batch of token ids `(B, T)` (nbs/lm/24_models, issue 21): each row of the
batched logits is the 1-D forward of that sequence, on arrays and traced, for SmolLM2 and tiny
Llama and Gemma 3 GGUFs (every block type, Gemma's sliding window shorter than the sequence, its
qk-norm and sandwich norms); the gradient w.r.t. LoRA adapters of the batched mean loss is the mean
of the per-sequence gradients, and matches central differences in float64; every linear layer is
one product on the `B·T` rows (one decode of each matrix); what a batch may not take is refused.

Tolerance: the batched GEMM multiplies `B·T` rows at once where the 1-D forward multiplies `T`;
BLAS may block the sum over the inner axis differently, so a logit may differ by float32 rounding:
at most 1e-4 of the largest |logit| (measured: 0 on this machine's OpenBLAS)."""
import numpy as np
import pytest

import gradus as gd
from gradus.errors import ShapeError
from gradus.formats import gguf
from gradus.learn import loss, random
from gradus.lm import lora, models, qlinear

from _models import find
from test_qlinear import tiny_gguf

SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')
RTOL = 1e-4   # of the largest |logit|: float32 rounding of a different GEMM blocking
CFG = lora.LoraConfig(rank=4, alpha=8.0)


def close(got, want, rtol=RTOL):
    return got.shape == want.shape and np.abs(got - want).max() <= rtol * np.abs(want).max()


def ids_of(b, t, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (b, t))


def adapters(params, seed=1, dtype=np.float32):
    "LoRA adapters with B nonzero too (init's B = 0 would make every gradient of A zero)."
    ad = lora.init(random.key(seed), params, CFG, dtype)
    g = np.random.default_rng(seed)
    return gd.tree_map(lambda x: (x + 0.05 * g.standard_normal(x.shape)).astype(dtype), ad)


@pytest.fixture(scope='module', params=['llama', 'gemma3'])
def tiny(request, tmp_path_factory):
    arch = request.param
    return models.from_gguf(tiny_gguf(tmp_path_factory.mktemp(arch) / f'{arch}.gguf', arch))


def test_tiny_batched_rows_are_the_1d_forward(tiny):
    "Each row of `forward((B, T))` is `forward(T)` of that sequence: eager, and traced (`jit`)."
    params, c = tiny
    assert c.windows in ((), (4, 4))                  # gemma3: a window of 4 < T = 10
    ids = ids_of(3, 10, c.vocab_size)
    want = [models.forward(params, s, c) for s in ids]
    eager = models.forward(params, ids, c)
    traced = gd.jit(lambda t: models.forward(params, t, c))(ids)
    assert eager.shape == traced.shape == (3, 10, c.vocab_size)
    assert all(close(eager[b], want[b]) and close(traced[b], want[b]) for b in range(3))


def test_tiny_lora_gradient_of_the_batch_is_the_mean_of_sequences(tiny):
    """The gradient w.r.t. the adapters of the mean loss over a batch `(3, 9)` equals the mean of
    the three per-sequence gradients (the losses are means over 8 positions each, so the batch's
    is their mean); and float64 central differences agree with it on a batch of 2."""
    params, c = tiny
    ids = ids_of(3, 9, c.vocab_size, seed=2)
    ad = adapters(params)

    def ce(ad, ids):
        logits = models.forward(lora.attach(params, ad, CFG), ids[..., :-1], c)
        return loss.cross_entropy(logits, ids[..., 1:])
    vg = gd.value_and_grad(ce)
    value, g = vg(ad, ids)
    per = [vg(ad, s) for s in ids]
    assert abs(float(value) - np.mean([float(v) for v, _ in per])) <= 1e-5 * abs(float(value))
    mean = gd.tree_map(lambda *gs: sum(gs) / len(gs), *[gs for _, gs in per])
    for got, want in zip(gd.tree_leaves(g), gd.tree_leaves(mean)):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() + 1e-7
    assert gd.check_grads(ce, (adapters(params, dtype=np.float64), ids[:2]),
                          max_elements=4) <= 1


def test_batch_decodes_each_matrix_once(tiny, monkeypatch):
    "A traced batched forward and backward decode each matrix once per product, not once per row."
    params, c = tiny
    seen = []
    plain = qlinear.decode_rows
    monkeypatch.setattr(qlinear, 'decode_rows', lambda *a, **k: seen.append(1) or plain(*a, **k))
    ad = adapters(params)
    f = lambda ad, ids: loss.cross_entropy(
        models.forward(lora.attach(params, ad, CFG), ids[:, :-1], c), ids[:, 1:])
    gd.value_and_grad(f)(ad, ids_of(2, 9, c.vocab_size))
    one = len(seen)
    seen.clear()
    gd.value_and_grad(f)(ad, ids_of(4, 9, c.vocab_size))
    products = 2 * (7 * c.n_layers + 1)     # forward and backward of 7 matrices a layer + head
    assert one == len(seen) and c.n_layers * 7 < one <= products   # the same for 2 or 4 rows


def test_a_batch_refuses_a_cache_last_only_and_more_axes(tiny):
    params, c = tiny
    ids = ids_of(2, 5, c.vocab_size)
    with pytest.raises(ShapeError, match=r"batch of tokens \(2, 5\) runs without a cache"):
        models.forward(params, ids, c, cache=models.new_cache(c, 16))
    with pytest.raises(ShapeError, match="last_only=True"):
        models.forward(params, ids, c, last_only=True)
    with pytest.raises(ShapeError, match=r"tokens of shape \(1, 2, 5\)"):
        models.forward(params, ids[None], c)


@needs_smollm2
def test_smollm2_batched_rows_and_lora_gradient():
    """SmolLM2: the rows of a batch `(3, 12)` are the 1-D forwards (eager); the LoRA gradient of a
    batch `(2, 9)` is the mean of the two sequences' gradients."""
    params, c = models.from_gguf(SMOLLM2)
    ids = ids_of(3, 12, c.vocab_size)
    got = models.forward(params, ids, c)
    assert all(close(got[b], models.forward(params, ids[b], c)) for b in range(3))
    ad = adapters(params)
    ce = lambda ad, ids: loss.cross_entropy(
        models.forward(lora.attach(params, ad, CFG), ids[..., :-1], c), ids[..., 1:])
    vg = gd.value_and_grad(ce)
    ids = ids_of(2, 9, c.vocab_size, seed=3)
    _, g = vg(ad, ids)
    per = [vg(ad, s)[1] for s in ids]
    for got, a, b in zip(gd.tree_leaves(g), gd.tree_leaves(per[0]), gd.tree_leaves(per[1])):
        want = (a + b) / 2
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max() + 1e-7


def test_data_parallel_over_the_lora_step(tiny):
    """`train.data_parallel` runs the step's shards in two Python threads; each decodes blocks
    with numba `parallel=True` kernels, which numba's workqueue layer refused to enter from two
    threads at once (the process aborted). `qlinear` decodes under a lock: the shards' mean is the
    whole batch's value and gradient."""
    from gradus.learn import train
    params, c = tiny
    ad = adapters(params)
    ce = lambda ad, ids: loss.cross_entropy(
        models.forward(lora.attach(params, ad, CFG), ids[:, :-1], c), ids[:, 1:])
    vg = gd.value_and_grad(ce)
    dp = train.data_parallel(vg, (None, 0), threads=2)
    ids = ids_of(4, 17, c.vocab_size, seed=5)
    want, gw = vg(ad, ids)
    for _ in range(10):
        value, g = dp(ad, ids)
    assert abs(float(value) - float(want)) <= 1e-5 * abs(float(want))
    for a, b in zip(gd.tree_leaves(g), gd.tree_leaves(gw)):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max() + 1e-7
