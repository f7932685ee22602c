"""`lm.finetune` (nbs/lm/34_finetune.ipynb): the held-out split and windows, the JSONL reader, the
reply-only mask of conversations (checked against the tokenizer's decoder and the rendered text,
not against the code's own slicing), and the adapters' loss against a float64 numpy
cross-entropy of the base model's logits with the same mask."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gradus as gd
from gradus.errors import ConfigError, DataError, ShapeError
from gradus.formats import gguf, tokenizer
from gradus.learn import random
from gradus.lm import finetune as F, lora, models
from _models import find

SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')


@pytest.fixture(scope='module')
def tok():
    if SMOLLM2 is None: pytest.skip('SmolLM2 GGUF absent')
    return tokenizer.from_gguf(gguf.open_gguf(SMOLLM2))


@pytest.fixture(scope='module')
def model():
    if SMOLLM2 is None: pytest.skip('SmolLM2 GGUF absent')
    return models.from_gguf(SMOLLM2)


def test_split_is_a_contiguous_tail():
    ids = np.arange(1000)
    tr, va = F.split_tokens(ids, 16, 0.1)
    assert len(va) == 100 and np.array_equal(np.concatenate([tr, va]), ids)
    assert tr[-1] + 1 == va[0]


@pytest.mark.parametrize('args, error, words', [
    ((np.arange(30), 16, 0.1), DataError, 'held-out part of 3'),
    ((np.arange(30), 16, 0.9), DataError, 'training part of 3'),
    ((np.arange(100), 16, 0.0), ConfigError, 'val_fraction'),
    ((np.arange(100), 16, 1.0), ConfigError, 'val_fraction'),
    ((np.arange(100), 0, 0.1), ConfigError, 'seq_len'),
    ((np.arange(100), True, 0.1), ConfigError, 'seq_len'),
    ((np.arange(100).reshape(10, 10), 4, 0.1), ShapeError, '1-D int'),
    ((np.linspace(0, 1, 100), 4, 0.1), ShapeError, '1-D int'),
])
def test_split_refusals_name_the_value(args, error, words):
    with pytest.raises(error, match=words): F.split_tokens(*args)


def test_eval_windows_do_not_overlap_and_stop_at_the_data():
    ids = np.arange(50) * 3
    x, y = F.eval_windows(ids, 8, 100)
    assert x.shape == (6, 8)                                   # (50 - 1) // 8
    assert np.array_equal(x.ravel(), ids[:48]) and np.array_equal(y.ravel(), ids[1:49])
    assert F.eval_windows(ids, 8, 2)[0].shape == (2, 8)
    with pytest.raises(DataError, match='cannot hold'): F.eval_windows(ids[:5], 8, 1)
    with pytest.raises(ConfigError, match='n must be'): F.eval_windows(ids, 8, 0)


def test_read_pairs(tmp_path):
    p = tmp_path / 'd.jsonl'
    p.write_text('{"prompt": "a", "response": "b", "extra": 1}\n\n'
                 '{"prompt": "c", "response": ""}\n')
    assert F.read_pairs(p) == [('a', 'b'), ('c', '')]
    for body, words in [('{"prompt": "a", "response": "b"}\n{"prompt": 1, "response": "b"}\n',
                         r'd.jsonl:2: need an object'),
                        ('{"prompt": "a"\n', r'd.jsonl:1: not JSON'),
                        ('["a", "b"]\n', r'd.jsonl:1: need an object'),
                        ('\n\n', 'no prompt/response pair')]:
        p.write_text(body)
        with pytest.raises(DataError, match=words): F.read_pairs(p)
    p.write_bytes(b'{"prompt": "\xff", "response": "b"}\n')
    with pytest.raises(DataError, match='not UTF-8'): F.read_pairs(p)


def _rendered(tok, prompt, response):
    user = [{'role': 'user', 'content': prompt}]
    head = tok.apply_chat_template(user, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [{'role': 'assistant', 'content': response}],
                                   add_generation_prompt=False)
    return head, full


# SmolLM2's vocabulary lacks 21 of the 256 byte tokens (controls 0x04 0x06 0x13 0x14 0x16 0x1d, and
# UTF-8's never-used 0xc0 0xc1 and the lead bytes of planes 4 and above), which its encoder refuses
# by a TokenizerError: the texts are of the other characters, to U+2FFFF.
texts = st.text(st.characters(codec='utf-8', exclude_categories=('Cs', 'Cc'),
                              max_codepoint=0x2FFFF), max_size=40)


@needs_smollm2
@settings(max_examples=40, deadline=None)
@given(prompt=texts, response=texts.filter(lambda s: s.strip()), extra=st.integers(-8, 40))
def test_the_mask_keeps_exactly_the_reply(tok, prompt, response, extra):
    """The kept targets decode to the rendered reply (the conversation's text after the prompt's),
    or its start when the window cuts it; they sit in one run that starts at the prompt's last
    token; the inputs before them decode to the rendered prompt; nothing else carries a loss."""
    head, full = _rendered(tok, prompt, response)
    n_head = len(tok.encode(head, parse_special=True))
    seq_len = max(1, n_head + extra)
    try: x, y = F.chat_example(tok, prompt, response, seq_len)
    except DataError:                          # refused only when the prompt fills the window
        assert n_head >= seq_len + 1
        return
    kept = np.flatnonzero(y != F.IGNORE)
    assert kept[0] == n_head - 1 and np.array_equal(kept, np.arange(kept[0], kept[-1] + 1))
    reply = b''.join(tok.token_bytes(int(i)) for i in y[kept])      # a cut may end inside a
    whole = full[len(head):].encode('utf-8')                          # character: bytes compare
    assert reply and whole.startswith(reply)
    if kept[-1] < seq_len - 1: assert reply == whole                  # not cut: the whole reply
    assert tok.decode([int(i) for i in x[:n_head]]) == head
    assert np.array_equal(x[kept[0] + 1:kept[-1] + 1], y[kept[:-1]])  # inputs lead the targets


def test_a_template_that_puts_the_reply_elsewhere_is_refused(tok):
    class Odd:
        pad_id, eos_id = 0, 0
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return ''.join(m['content'] for m in messages[::-1]) + ('>' if add_generation_prompt
                                                                    else '')
        encode = tok.encode
    with pytest.raises(DataError, match='does not render the reply after'):
        F.chat_example(Odd(), 'question', 'answer', 32)


def _nll64(logits, y):
    "float64 per-position negative log-likelihood of the labels, by numpy's log-sum-exp."
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    safe = np.where(y == F.IGNORE, 0, y)
    return lse - np.take_along_axis(z, safe[..., None], -1)[..., 0]


@needs_smollm2
def test_loss_is_the_mean_over_kept_targets_of_the_batch(model, tok):
    """With random non-zero B, the adapters' loss over a batch whose sequences keep 16 and 3
    targets equals a float64 numpy mean over those 19 targets of the logits of the merged model
    (lora.merge: an independent route to the same weights), and not the mean of the two
    sequences' means."""
    params, config = model
    lcfg = lora.LoraConfig(rank=4, alpha=8.0, targets='q,v,down')
    ad = lora.init(random.key(3), params, lcfg)
    g = np.random.default_rng(0)
    for la in ad['layers']:
        for a in la.values(): a['b'] = (0.02 * g.standard_normal(a['b'].shape)).astype(np.float32)
    ids = np.array(tok.encode('Now is the winter of our discontent made glorious summer by this '
                              'sun of York; and all the clouds that lour'), np.int64)
    x = np.stack([ids[:16], ids[1:17]])
    y = np.stack([ids[1:17], ids[2:18]])
    y[1, :13] = F.IGNORE
    got = float(F.loss_fn(params, config, lcfg)(ad, x, y))
    merged = lora.merge(params, ad, lcfg)
    nll = _nll64(np.stack([models.forward(merged, s, config) for s in x]), y)
    keep = y != F.IGNORE
    want = nll[keep].mean()
    assert abs(got - want) < 2e-4 * want, (got, want)
    means = np.mean([nll[i][keep[i]].mean() for i in range(2)])
    assert abs(means - want) > 50 * abs(got - want)          # the test can tell the two apart


@needs_smollm2
def test_dropout_needs_its_key_and_repeats_with_it(model):
    params, config = model
    lcfg = lora.LoraConfig(rank=2, targets='q', dropout=0.5)
    ad = lora.init(random.key(1), params, lcfg)
    for la in ad['layers']: la['wq']['b'] = np.full(la['wq']['b'].shape, 0.05, np.float32)
    x = np.array([[1, 504, 3485, 282, 260, 4879, 30, 378]])
    y = np.roll(x, -1, axis=1)
    f = F.loss_fn(params, config, lcfg)
    plain, k = float(f(ad, x, y)), random.key(7)
    once, again = float(f(ad, x, y, k)), float(f(ad, x, y, k))
    other = float(f(ad, x, y, random.key(8)))
    assert once == again and once != plain and other != once
    v, grads = gd.value_and_grad(f)(ad, x, y, k)
    assert float(v) == once and np.abs(grads['layers'][0]['wq']['a']).max() > 0


def test_adapted_logits_wants_a_batch():
    with pytest.raises(ShapeError, match=r'\(batch, T\)'):
        F.adapted_logits({'layers': []}, {'layers': []}, np.arange(4), None, lora.LoraConfig())
