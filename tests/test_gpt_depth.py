"""A GPT's sizes (`gradus.transformer.gpt.init`): a GPT of no blocks (`n_layer=0`) is a model, the
bigram model with positions, and runs end to end; sizes that mean nothing are refused by name."""

import numpy as np
import pytest

from gradus.errors import ConfigError
from gradus.learn import random
from gradus.lm import decode, models
from gradus.transformer import gpt

FLAT = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=0, n_head=2, n_embd=8)


@pytest.mark.parametrize('field, value, low', [
    ('n_layer', -1, 0), ('n_layer', 1.5, 0), ('n_layer', True, 0), ('vocab_size', 0, 1),
    ('block_size', 0, 1), ('n_head', 0, 1), ('n_embd', -8, 1)])
def test_init_refuses_sizes_by_name(field, value, low):
    with pytest.raises(ConfigError, match=f"GPT: {field} must be an int >= {low}, got {value!r}"):
        gpt.init(random.key(0), FLAT._replace(**{field: value}))


def test_a_gpt_of_no_blocks_is_the_bigram_model_with_positions():
    p = gpt.init(random.key(0), FLAT)
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    x = p['wte'][tokens] + p['wpe'][:6]
    m, v = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = ((x - m) / np.sqrt(v + 1e-5) * p['ln_f']['scale'] + p['ln_f']['bias']) @ p['wte'].T
    np.testing.assert_allclose(gpt.apply(p, tokens, FLAT), ref, atol=1e-5)


def test_a_gpt_of_no_blocks_decodes_end_to_end():
    """The KV cache of a model without attention holds no rows but still counts positions: greedy
    decoding through `models.stepper` equals the argmax of the full forward, token by token, past
    `block_size` too (the step slides its window)."""
    p = gpt.init(random.key(1), FLAT)
    cache = models.new_cache(FLAT)
    step = models.stepper(p, FLAT, cache)
    greedy = decode.GenerationConfig(max_new_tokens=10, temperature=0)
    gen = decode.generate(step, np.array([3, 1, 4]), greedy, cache=None)
    seq = [3, 1, 4]
    for tok in [e.token for e in gen]:
        window = np.array(seq[-FLAT.block_size:])[None]
        assert tok == int(np.argmax(gpt.apply(p, window, FLAT)[0, -1]))
        seq.append(tok)
    assert len(seq) == 13 > FLAT.block_size
