"""Issue 21, proof (a): LoRA's gradients on the real SmolLM2 against PyTorch autograd.

The other side is independent of gradus: `transformers`' own `LlamaForCausalLM`, loaded from the
same GGUF file by transformers' GGUF reader (which dequantizes with the `gguf` package), wrapped by
PEFT's LoRA on the same seven linear layers of every block, its `lora_A`/`lora_B` set to gradus's
adapters (`B` random and nonzero, so that every `A` has a gradient). On one batch (two sequences of
16 tokens of text, tokenized by the file's tokenizer) the checks are, in order: the dequantized
weights are the same numbers on both sides, the base models' logits agree, the adapted losses
agree, and the gradient of the mean cross-entropy with respect to every adapter leaf (30 layers x
7 matrices x {a, b} = 420 arrays) agrees, each to a stated tolerance relative to the size of what
it compares.

The layout: llama.cpp's converter stores `attn_q`/`attn_k` with the rows of each head reordered
(the two halves that RoPE rotates together are interleaved, pairs of adjacent rows); transformers'
GGUF loader undoes it (`LlamaTensorProcessor._reverse_permute_weights` in
`transformers/modeling_gguf_pytorch_utils.py`). gradus runs the file's layout as stored (with
interleaved RoPE), so for q and k the HF matrix is `W_gguf[perm]`, HF's `lora_B` is gradus's `B`
with its rows taken in the same order (`A` unchanged), and HF's gradient of `B` maps back by
`g_gguf[perm] = g_hf`. `perm` is written here from the definition and checked against the weights
transformers loaded.

Measured (2 shared cores, torch 2.13.0, transformers 5.24.0, peft 0.21.2, 2026-12-03): the
weights bit for bit; the base logits to a max abs difference of 5.6e-5 (logits up to 30.6;
asserted 1e-3); the losses 4.670298 and 4.670290 (1.7e-6 relative; asserted 1e-5); the worst leaf
`||g_gradus - g_torch|| / ||g_torch||` 1.3e-4 (layers.28.wv.b; asserted 1e-3). Against the same
PyTorch computation in float64, gradus's float32 gradients are off by at most 1.1e-5 (asserted
1e-4) and PyTorch's own float32 ones by 1.2e-4: the float32 disagreement is mostly PyTorch's
rounding. 22-56 s on the two shared cores (load 1-4), a third of it loading the models."""
import numpy as np
import pytest

WHY = "is not installed: pip install -e '.[oracle]'"
torch = pytest.importorskip('torch', reason=f"PyTorch {WHY}")
transformers = pytest.importorskip('transformers', reason=f"transformers {WHY}")
peft = pytest.importorskip('peft', reason=f"peft {WHY}")
pytest.importorskip('gguf', reason="transformers reads GGUF files with the `gguf` package")

import gradus as gd
from gradus.formats import gguf, tokenizer
from gradus.learn import loss, random
from gradus.lm import lora, models, qlinear

from _models import find

SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')
pytestmark = [needs_smollm2, pytest.mark.filterwarnings(
    'ignore:`is_gradient_checkpointing` is deprecated:FutureWarning')]   # PEFT calls it

CFG = lora.LoraConfig(rank=8, alpha=16)
HF = {'wq': 'self_attn.q_proj', 'wk': 'self_attn.k_proj', 'wv': 'self_attn.v_proj',
      'wo': 'self_attn.o_proj', 'w_gate': 'mlp.gate_proj', 'w_up': 'mlp.up_proj',
      'w_down': 'mlp.down_proj'}          # gradus's key in a layer -> HF's module in a block
TEXTS = ("The river runs through the old town, past the mill and under three stone bridges "
         "before it reaches the sea.",
         "To bake bread you need flour, water, salt and yeast; the dough rests for an hour and "
         "then goes into a hot oven.")
T = 16                                     # tokens per sequence
TOL = 1e-3                                 # ||g_gradus - g_torch|| <= TOL ||g_torch||, every leaf


def rope_rows(rows, n_heads):
    """The row order `perm` with `W_hf = W_gguf[perm]` for llama.cpp's q/k layout: within each
    head of `hd` rows, GGUF row `2i + j` (pair i, member j) is HF row `j·hd/2 + i`."""
    hd = rows // n_heads
    i, j = np.meshgrid(np.arange(hd // 2), np.arange(2), indexing='ij')   # gguf row 2i + j
    one = np.empty(hd, int)
    one[(j * (hd // 2) + i).ravel()] = (2 * i + j).ravel()                # hf row <- gguf row
    return (np.arange(n_heads)[:, None] * hd + one).ravel()


@pytest.fixture(scope='module')
def setup():
    "gradus's model and adapters, PEFT's model carrying the same adapters, the batch."
    params, c = models.from_gguf(SMOLLM2)
    tok = tokenizer.from_gguf(gguf.open_gguf(SMOLLM2))
    ids = np.array([tok.encode(t)[:T] for t in TEXTS])                    # (2, 16)
    assert ids.shape == (2, T)
    ad = lora.init(random.key(0), params, CFG)
    keys = iter(random.split(random.key(1), len(ad['layers']) * len(HF)))
    for la in ad['layers']:
        for ab in la.values():
            ab['b'] = (0.01 * random.rng(next(keys)).standard_normal(ab['b'].shape)
                       ).astype(np.float32)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(SMOLLM2.parent), gguf_file=SMOLLM2.name, dtype=torch.float32)
    hf.eval()
    perm = {'wq': rope_rows(c.n_heads * c.head_dim, c.n_heads),
            'wk': rope_rows(c.n_kv_heads * c.head_dim, c.n_kv_heads)}
    return params, c, ad, ids, hf, perm


def test_rope_rows_is_transformers_reverse_permutation():
    "`rope_rows` against transformers' own function, on row numbers (both head counts)."
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    undo = LlamaTensorProcessor()._reverse_permute_weights
    for heads, kv in ((9, 9), (9, 3)):
        rows = kv * 64
        assert np.array_equal(undo(np.arange(rows), heads, kv), rope_rows(rows, kv))


def test_same_weights(setup):
    """transformers' dequantized float32 weights are gradus's `qlinear.dense`, bit for bit. Exact
    on any CPU: the file's Q4_1 and Q8_0 blocks decode as `d·q (+ m)`, a float16 scale times a
    small integer, a product float32 holds exactly (fused multiply-add or not)."""
    params, c, _, _, hf, perm = setup
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert np.array_equal(sd['model.embed_tokens.weight'], qlinear.dense(params['embed']))
    assert np.array_equal(sd['model.norm.weight'], params['norm'])
    for i, lp in enumerate(params['layers']):
        for k, name in HF.items():
            w = qlinear.dense(lp[k])
            assert np.array_equal(sd[f'model.layers.{i}.{name}.weight'],
                                  w[perm[k]] if k in perm else w), (i, k)
        for k, name in (('attn_norm', 'input_layernorm'),
                        ('ffn_norm', 'post_attention_layernorm')):
            assert np.array_equal(sd[f'model.layers.{i}.{name}.weight'], lp[k]), (i, k)


def test_base_logits_agree(setup):
    params, c, _, ids, hf, _ = setup
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.numpy()                   # (2, T, vocab)
    ours = np.stack([models.forward(params, s, c) for s in ids])
    err = np.abs(ours - theirs).max()
    print(f"base logits: max |gradus - transformers| = {err:.2e}, max |logit| = "
          f"{np.abs(theirs).max():.1f}")
    assert err <= 1e-3


def gradus_side(params, c, ad, ids):
    "The mean cross-entropy over both sequences' 15 predictions and its gradient in the adapters."
    def f(ad):
        m = lora.attach(params, ad, CFG)
        return sum(loss.cross_entropy(models.forward(m, s[:-1], c), s[1:]) for s in ids) / len(ids)
    return gd.value_and_grad(f)(ad)


def torch_side(hf, ad, ids, perm):
    "The same loss and gradient from PEFT's LoRA on transformers' model, in gradus's layout."
    pc = peft.LoraConfig(r=CFG.rank, lora_alpha=CFG.alpha, lora_dropout=0.0,
                         target_modules=[n.split('.')[1] for n in HF.values()])
    model = peft.get_peft_model(hf, pc)
    blocks = model.base_model.model.model.layers
    mods = [{k: blocks[i].get_submodule(n) for k, n in HF.items()} for i in range(len(blocks))]
    with torch.no_grad():
        for la, lm in zip(ad['layers'], mods):
            for k, ab in la.items():
                b = ab['b'][perm[k]] if k in perm else ab['b']
                lm[k].lora_A['default'].weight.copy_(torch.from_numpy(ab['a']))
                lm[k].lora_B['default'].weight.copy_(torch.from_numpy(np.ascontiguousarray(b)))
    x = torch.from_numpy(ids)
    logits = model(input_ids=x[:, :-1]).logits                              # (2, T-1, vocab)
    value = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              x[:, 1:].reshape(-1))
    value.backward()
    grads = []
    for lm in mods:
        g = {}
        for k, m in lm.items():
            gb = m.lora_B['default'].weight.grad.numpy()
            if k in perm:
                back = np.empty_like(gb)
                back[perm[k]] = gb
                gb = back
            g[k] = {'a': m.lora_A['default'].weight.grad.numpy().copy(), 'b': gb.copy()}
        grads.append(g)
    model.unload()                           # the base model back as it was (no adapters)
    return float(value.detach()), {'layers': grads}


@pytest.fixture(scope='module')
def ours(setup):
    "gradus's loss and adapter gradients on the batch (float32)."
    params, c, ad, ids, _, _ = setup
    return gradus_side(params, c, ad, ids)


def relative_errors(ours, theirs):
    "`{'layers.i.key.a|b': ||g - h|| / ||h||}` over every leaf; each `h` must be nonzero."
    out = {}
    for i, (lo, lt) in enumerate(zip(ours['layers'], theirs['layers'])):
        assert sorted(lo) == sorted(lt) == sorted(HF)
        for k in HF:
            for ab in 'ab':
                g, h = np.asarray(lo[k][ab], np.float64), np.asarray(lt[k][ab], np.float64)
                assert g.shape == h.shape and np.linalg.norm(h) > 0, (i, k, ab)
                out[f'layers.{i}.{k}.{ab}'] = np.linalg.norm(g - h) / np.linalg.norm(h)
    return out


def test_adapter_gradients_agree_with_pytorch(setup, ours):
    """Every one of the 420 adapter leaves: `||g_gradus - g_torch|| <= 1e-3 ||g_torch||`, every
    gradient nonzero; the losses to 1e-5 relative."""
    params, c, ad, ids, hf, perm = setup
    value, grads = ours
    theirs_value, theirs = torch_side(hf, ad, ids, perm)
    assert abs(float(value) - theirs_value) <= 1e-5 * abs(theirs_value), (value, theirs_value)
    rel = relative_errors(grads, theirs)
    where = max(rel, key=rel.get)
    print(f"loss gradus {float(value):.6f} torch {theirs_value:.6f}; {len(rel)} leaves, worst "
          f"relative gradient error {rel[where]:.2e} at {where}")
    assert len(rel) == 2 * len(HF) * len(params['layers'])
    assert rel[where] <= TOL, (where, rel[where])


def test_float32_gradients_against_pytorch_in_float64(setup, ours):
    """The same PyTorch computation in float64 (the float32 weights and adapters widened): gradus's
    float32 gradients are within 1e-4 of it on every leaf, and its loss within 1e-6, so the
    disagreement above is float32 rounding, not a different function."""
    params, c, ad, ids, hf, perm = setup
    value, grads = ours
    wide = {'layers': [{k: {x: y.astype(np.float64) for x, y in ab.items()}
                        for k, ab in la.items()} for la in ad['layers']]}
    hf.to(torch.float64)
    try:
        v64, th64 = torch_side(hf, wide, ids, perm)
    finally:
        hf.to(torch.float32)               # exact: every value came from float32
    rel = relative_errors(grads, th64)
    where = max(rel, key=rel.get)
    print(f"against float64: loss {abs(float(value) - v64) / v64:.1e} relative, worst leaf "
          f"{rel[where]:.2e} at {where}")
    assert abs(float(value) - v64) <= 1e-6 * v64
    assert rel[where] <= 1e-4, (where, rel[where])
