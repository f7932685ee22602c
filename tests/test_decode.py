"""decode: every CacheError case of the KV cache, each sampler stage against a plain-loop reference
(ties, -inf, single-token vocabularies), GenerationConfig validation, generate's stop reasons and
streaming, decode parity of the GPT, the bottom-right causal mask."""

import numpy as np
import pytest
from gradus.transformer import gpt
from gradus.learn import random as R
from gradus.transformer.attention import causal_mask
from gradus.core.pytree import tree_map
from gradus.lm.decode import KVCache, Event, generate, decode_parity, cached_step
from gradus.lm.sampling import GenerationConfig, sample
from gradus.lm import models
from gradus.core import kernels
from gradus.lm.sampling import (
    STOP_REASONS,
    apply_penalties,
    keep_top_k,
    keep_top_p,
    keep_min_p,
    sampler_stages,
)
from gradus.errors import CacheError, ShapeError
from gradus.formats.tokenizer import BPETokenizer, CharTokenizer, byte_to_unicode

rng = np.random.default_rng(0)
rows = lambda n, h=2, d=3: rng.standard_normal((h, n, d)).astype(np.float32)


def filled(n_layers=2, capacity=6, length=0, **kw):
    c = KVCache(n_layers, capacity, 2, 3, **kw)
    if length:
        for l in range(n_layers):
            c.write(l, 0, rows(length), rows(length))
        c.commit(length)
    return c


# ---------------------------------------------------------------- KV cache
@pytest.mark.parametrize(
    'args, kw, msg',
    [
        ((-1, 4, 2, 3), {}, 'n_layers'),
        ((2, 0, 2, 3), {}, 'capacity'),
        ((2, 4, True, 3), {}, 'n_kv_heads'),
        ((2, 4, 2, 2.0), {}, 'head_dim'),
        ((2, 4, 2, 3), dict(dtype=np.int32), 'dtype'),
        ((2, 4, 2, 3), dict(windows=[None]), '1 windows for 2 layers'),
        ((2, 4, 2, 3), dict(windows=[None, 0]), 'windows[1]'),
    ],
)
def test_cache_bad_construction(args, kw, msg):
    with pytest.raises(ValueError, match=msg.replace('[', r'\[').replace(']', r'\]')):
        KVCache(*args, **kw)


def test_cache_error_is_value_error():
    assert issubclass(CacheError, ValueError)


def test_gap_names_positions_and_capacity():
    c = filled(length=2)
    with pytest.raises(
        CacheError,
        match=r'position 4 leaves a gap: positions 2\.\.3 never written \(length 2, capacity 6\)',
    ):
        c.write(0, 4, rows(1), rows(1))
    with pytest.raises(CacheError, match='gap'):
        filled().write(1, 1, rows(1), rows(1))  # empty cache, pos 1


def test_overflow_names_positions_and_capacity():
    c = filled(length=4)
    with pytest.raises(
        CacheError, match=r'positions 4\.\.6 overflows the capacity 6 \(last position 5\)'
    ):
        c.write(0, 4, rows(3), rows(3))
    k, v, start = c.write(0, 4, rows(2), rows(2))  # exactly up to the capacity is fine
    assert k.shape == (2, 6, 3) and start == 0
    with pytest.raises(CacheError, match='overflows'):
        filled(capacity=2).write(0, 0, rows(3), rows(3))


def test_overwrite_needs_explicit_truncate():
    c = filled(length=3)
    with pytest.raises(
        CacheError, match=r'overwrite committed positions 1\.\.2; rewind with truncate\(1\)'
    ):
        c.write(0, 1, rows(1), rows(1))
    c.truncate(1)
    c.write(0, 1, rows(1), rows(1))


@pytest.mark.parametrize('layer', [-1, 2, 1.0, True, None])
def test_bad_layer(layer):
    with pytest.raises(CacheError, match='layer'):
        filled().write(layer, 0, rows(1), rows(1))


@pytest.mark.parametrize('pos', [-1, 0.0, None, False])
def test_bad_position(pos):
    with pytest.raises(CacheError, match='position'):
        filled().write(0, pos, rows(1), rows(1))


@pytest.mark.parametrize(
    'k, v',
    [
        (rows(1, h=3), rows(1, h=3)),
        (rows(1, d=4), rows(1, d=4)),
        (rows(2), rows(1)),
        (rows(0), rows(0)),
        (np.zeros((1, 3)), np.zeros((1, 3))),
    ],
)
def test_bad_row_shapes(k, v):
    with pytest.raises(ShapeError, match=r'n_kv_heads=2, n >= 1, head_dim=3'):
        filled().write(0, 0, k, v)


def test_commit_requires_every_layer():
    c = filled(n_layers=3)
    c.write(0, 0, rows(2), rows(2))
    c.write(2, 0, rows(2), rows(2))
    with pytest.raises(CacheError, match=r'layers \[1\] wrote \[0\] rows, not 2'):
        c.commit(2)
    c.write(1, 0, rows(1), rows(1))
    with pytest.raises(CacheError, match=r'layers \[1\] wrote \[1\] rows, not 2'):
        c.commit(2)
    assert c.length == 0
    c.write(1, 0, rows(2), rows(2))
    c.commit(2)
    assert c.length == 2
    with pytest.raises(CacheError, match='not 1'):
        c.commit(1)  # nothing written since


def test_failed_step_leaves_cache_unchanged_and_truncate_drops_pending():
    c = filled(length=2)
    c.write(0, 2, rows(1), rows(1))  # the step dies before layer 1
    assert c.length == 2
    c.truncate(2)  # drops the pending write
    with pytest.raises(CacheError):
        c.commit(1)


@pytest.mark.parametrize('pos', [-1, 4, 1.5, True])
def test_truncate_out_of_range(pos):
    with pytest.raises(CacheError, match=r'truncate.*outside \[0, length 3\]'):
        filled(length=3).truncate(pos)


def test_no_stale_rows_after_truncate():
    c = filled(length=5)
    old = c.k[0, :, 3].copy()
    c.truncate(3)
    assert c.length == 3 and not c.k[:, :, 3:].any() and not c.v[:, :, 3:].any()
    new_k, new_v = rows(1), rows(1)
    k, v, start = c.write(0, 3, new_k, new_v)
    assert (
        k.shape[1] == 4
        and np.array_equal(k[:, 3], new_k[:, 0])
        and not np.array_equal(k[:, 3], old)
    )
    assert np.array_equal(v[:, 3], new_v[:, 0])


def test_written_rows_are_returned_in_absolute_order():
    c = KVCache(1, 8, 2, 3)
    chunks = [rows(3), rows(1), rows(2)]
    pos = 0
    for ch in chunks:
        k, v, start = c.write(0, pos, ch, -ch)
        c.commit(ch.shape[1])
        pos += ch.shape[1]
    allrows = np.concatenate(chunks, axis=1)
    assert start == 0 and np.array_equal(k, allrows) and np.array_equal(v, -allrows)


@pytest.mark.parametrize('window', [1, 2, 3, 10])
def test_sliding_window_rows(window):
    c = KVCache(2, 12, 2, 3, windows=[None, window])
    data = [rows(1) for _ in range(12)]
    for p in range(0, 9, 3):  # chunks of 3 rows at 0, 3, 6
        chunk = np.concatenate(data[p : p + 3], axis=1)
        for l in range(2):
            k, v, start = c.write(l, p, chunk, chunk)
        # the first query of the chunk, at p, sees positions p - window + 1 .. p
        assert start == max(0, p - window + 1) and k.shape[1] == p + 3 - start
        assert np.array_equal(k, np.concatenate(data[start : p + 3], axis=1))
        c.commit(3)


def test_dtype_and_repr():
    c = KVCache(2, 4, 2, 3, dtype=np.float16)
    k, _, _ = c.write(0, 0, rows(1), rows(1))
    assert k.dtype == np.float16 and c.nbytes == 2 * 2 * 2 * 4 * 3 * 2
    assert '0/4 positions' in repr(c)


# ---------------------------------------------------------------- GenerationConfig
@pytest.mark.parametrize(
    'field, value',
    [
        ('max_new_tokens', 0),
        ('max_new_tokens', 1.0),
        ('temperature', -0.1),
        ('temperature', float('nan')),
        ('temperature', float('inf')),
        ('top_k', -1),
        ('top_k', True),
        ('top_p', 0.0),
        ('top_p', 1.01),
        ('min_p', -0.1),
        ('min_p', 1.5),
        ('repetition_penalty', 0.0),
        ('repetition_penalty', -1.0),
        ('penalty_window', -1),
        ('frequency_penalty', float('nan')),
        ('presence_penalty', float('inf')),
        ('eog_ids', [1, -2]),
        ('eog_ids', 'ab'),
        ('stop_strings', 'END'),
        ('stop_strings', ['']),
        ('stop_strings', [1]),
        ('seed', -1),
        ('ignore_eos', 1),
    ],
)
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})


def test_config_normalises_and_is_frozen():
    c = GenerationConfig(eog_ids=[np.int64(2), 7], stop_strings=['a', 'bc'], penalty_window=None)
    assert c.eog_ids == (2, 7) and c.stop_strings == ('a', 'bc')
    with pytest.raises(AttributeError):
        c.top_k = 3
    assert GenerationConfig(temperature=0).temperature == 0


# ---------------------------------------------------------------- sampler stages vs plain loops
def ref_top_k(z, k):
    order = sorted((i for i in range(len(z)) if np.isfinite(z[i])), key=lambda i: (-z[i], i))
    keep = set(order if k == 0 else order[:k])
    return np.array([z[i] if i in keep else -np.inf for i in range(len(z))])


def ref_top_p(z, p):
    fin = [i for i in range(len(z)) if np.isfinite(z[i])]
    e = {i: np.exp(z[i] - max(z[j] for j in fin)) for i in fin}
    tot = sum(e.values())
    keep, acc = [], 0.0
    for i in sorted(fin, key=lambda i: (-e[i], i)):
        keep.append(i)
        acc += e[i] / tot
        if acc >= p:
            break
    return np.array([z[i] if i in keep else -np.inf for i in range(len(z))])


def tied_logits(n):
    "Logits on a coarse grid (many ties), some -inf."
    z = rng.integers(-3, 3, n).astype(np.float64)
    z[rng.random(n) < 0.2] = -np.inf
    if not np.isfinite(z).any():
        z[0] = 0.0
    return z


@pytest.mark.parametrize('trial', range(60))
def test_top_k_matches_reference_with_ties(trial):
    z = tied_logits(int(rng.integers(1, 12)))
    for k in range(0, z.size + 2):
        got = keep_top_k(z, k)
        assert np.array_equal(got, ref_top_k(z, k)), (z, k)
        assert np.isfinite(got).sum() == (
            np.isfinite(z).sum() if k == 0 else min(k, np.isfinite(z).sum())
        )


@pytest.mark.parametrize('trial', range(60))
def test_top_p_matches_reference_with_ties(trial):
    z = tied_logits(int(rng.integers(1, 12)))
    for p in (0.05, 0.3, 0.5, 0.77, 0.95, 0.999):
        got = keep_top_p(z, p)
        assert np.array_equal(got, ref_top_p(z, p)), (z, p)
        assert np.isfinite(got).sum() >= 1
    assert np.array_equal(keep_top_p(z, 1.0), z)


def test_top_p_exact_dyadic_ties():
    z = np.array([np.log(0.25)] * 4 + [-np.inf])
    survivors = lambda p: list(np.flatnonzero(np.isfinite(keep_top_p(z, p))))
    assert survivors(0.25) == [0] and survivors(0.5) == [0, 1] and survivors(0.51) == [0, 1, 2]
    assert survivors(1.0) == [0, 1, 2, 3]
    assert survivors(1e-9) == [0]


def test_min_p_keeps_ties_together():
    z = np.log([0.5, 0.3, 0.08, 0.06, 0.06])
    survivors = lambda m: list(np.flatnonzero(np.isfinite(keep_min_p(z, m))))
    assert survivors(0.1) == [0, 1, 2, 3, 4] and survivors(0.15) == [0, 1, 2]
    assert survivors(0.7) == [0] and survivors(1.0) == [0] and survivors(0.0) == [0, 1, 2, 3, 4]
    tied_top = np.array([2.0, 2.0, 0.0, -np.inf])
    assert list(np.flatnonzero(np.isfinite(keep_min_p(tied_top, 1.0)))) == [0, 1]


@pytest.mark.parametrize(
    'stage',
    [
        lambda z: keep_top_k(z, 1),
        lambda z: keep_top_k(z, 5),
        lambda z: keep_top_p(z, 0.01),
        lambda z: keep_top_p(z, 0.99),
        lambda z: keep_min_p(z, 1.0),
    ],
)
def test_single_token_vocabulary(stage):
    assert np.array_equal(stage(np.array([-3.5])), [-3.5])


def test_penalties_by_hand():
    z = np.array([2.0, -1.0, 0.0, -np.inf, 2.0, 3.0])
    c = GenerationConfig(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(z, [0, 1, 1, 3, 2], c)
    want = [2 / 2 - 0.5 - 0.25, -1 * 2 - 2 * 0.5 - 0.25, 0 - 0.5 - 0.25, -np.inf, 2.0, 3.0]
    assert np.array_equal(got, want)
    assert np.array_equal(apply_penalties(z, [], c), z)


def test_penalty_window():
    z = np.ones(4)
    hist = [0, 0, 1, 2, 3]
    win = lambda w: apply_penalties(
        z, hist, GenerationConfig(repetition_penalty=2.0, penalty_window=w)
    )
    assert np.array_equal(win(2), [1, 1, 0.5, 0.5])  # only tokens 2, 3 (the last two)
    assert np.array_equal(win(0), z)  # 0: no penalty
    assert np.array_equal(win(None), [0.5, 0.5, 0.5, 0.5])  # None: all
    assert np.array_equal(win(7), [0.5, 0.5, 0.5, 0.5])  # a window longer than the history: all
    fc = GenerationConfig(frequency_penalty=1.0, penalty_window=None)
    assert np.array_equal(apply_penalties(z, hist, fc), [-1, 0, 0, 0])


def test_penalty_history_out_of_range():
    with pytest.raises(ValueError, match=r'outside \[0, 3\)'):
        apply_penalties(np.zeros(3), [0, 3], GenerationConfig(repetition_penalty=1.5))


# ---------------------------------------------------------------- sample
def test_temperature_zero_is_argmax_lowest_tie():
    z = np.array([1.0, 5.0, -np.inf, 5.0])
    cfg = GenerationConfig(temperature=0)
    assert {sample(z, k, cfg) for k in R.split(R.key(0), 20)} == {1}
    assert sample(np.array([-np.inf, 0.0]), R.key(0), cfg) == 1
    # greedy reads the penalised logits: token 1 repeated, penalised below token 3
    assert (
        sample(z, R.key(0), GenerationConfig(temperature=0, repetition_penalty=2.0), history=[1])
        == 3
    )


def test_top_k_zero_is_off_and_one_is_greedy():
    z = np.array([0.0, 0.1, 0.0])
    drawn = {sample(z, k, GenerationConfig(top_k=0)) for k in R.split(R.key(1), 200)}
    assert drawn == {0, 1, 2}
    tied = np.array([0.0, 3.0, 3.0, 3.0])
    assert {sample(tied, k, GenerationConfig(top_k=1)) for k in R.split(R.key(1), 50)} == {1}
    assert {sample(tied, k, GenerationConfig(top_k=2)) for k in R.split(R.key(1), 200)} == {1, 2}


def test_removed_tokens_never_drawn():
    for i, k in enumerate(R.split(R.key(2), 300)):
        z = tied_logits(8)
        cfg = GenerationConfig(
            temperature=float(rng.choice([0.3, 1, 3])),
            top_k=int(rng.integers(0, 4)),
            top_p=float(rng.choice([1, 0.6])),
            min_p=float(rng.choice([0, 0.5])),
        )
        final = sampler_stages(z, cfg)[-1][1]
        assert np.isfinite(final[sample(z, k, cfg)])


def test_draw_frequencies():
    # top-k 2 of probabilities (.1, .6, 0, .3): survivors 1 and 3 with renormalised .6/.9 and .3/.9
    z = np.log(np.array([0.1, 0.6, 1.0, 0.3]))
    z[2] = -np.inf
    draws = np.array([sample(z, k, GenerationConfig(top_k=2)) for k in R.split(R.key(4), 30_000)])
    freq = np.bincount(draws, minlength=4) / draws.size
    want = np.array([0, 2 / 3, 0, 1 / 3])
    assert freq[0] == 0 and freq[2] == 0
    assert np.abs(freq - want).max() < 4 * np.sqrt(2 / 9 / draws.size)


def test_sample_is_pure_and_key_dependent():
    z = np.zeros(50)
    cfg = GenerationConfig()
    k = R.key(9)
    assert sample(z, k, cfg) == sample(z.copy(), k.copy(), cfg)
    assert len({sample(z, kk, cfg) for kk in R.split(R.key(9), 40)}) > 10
    assert np.array_equal(z, np.zeros(50))  # input untouched


@pytest.mark.parametrize(
    'bad',
    [
        np.array([np.nan, 0.0]),
        np.array([np.inf, 0.0]),
        np.full(3, -np.inf),
        np.zeros((2, 2)),
        np.array([], dtype=np.float32),
        np.arange(3),
    ],
)
def test_sample_bad_logits(bad):
    with pytest.raises(ValueError, match='sample: '):
        sample(bad, R.key(0), GenerationConfig())


def test_sample_bad_key():
    with pytest.raises(TypeError, match='key'):
        sample(np.zeros(3), 7, GenerationConfig())


def test_sample_draws_from_the_last_stage():
    "sample (which skips work) draws exactly what an inverse CDF over sampler_stages' output gives."
    for i, k in enumerate(R.split(R.key(11), 300)):
        z = tied_logits(9) * rng.choice([0.3, 1, 4])
        cfg = GenerationConfig(
            temperature=float(rng.choice([0.5, 1, 2])),
            top_k=int(rng.integers(0, 6)),
            top_p=float(rng.choice([1, 0.8, 0.4])),
            min_p=float(rng.choice([0, 0.1, 0.5])),
            repetition_penalty=float(rng.choice([1, 1.5])),
        )
        hist = list(rng.integers(0, 9, 4))
        final = sampler_stages(z, cfg, hist)[-1][1]
        cum = np.cumsum(np.exp(final - final.max()))
        want = int(np.searchsorted(cum, R.rng(k).random() * cum[-1], side='right'))
        assert sample(z, k, cfg, hist) == want, (z, cfg, hist)


def test_stages_reach_sample():
    "sampler_stages' last distribution is what sample draws from (greedy: its argmax)."
    for i in range(40):
        z = tied_logits(6)
        cfg = GenerationConfig(temperature=0, top_k=int(rng.integers(0, 3)), repetition_penalty=1.5)
        hist = list(rng.integers(0, 6, 3))
        final = sampler_stages(z, cfg, hist)[-1][1]
        assert np.flatnonzero(np.isfinite(final)).tolist() == [sample(z, R.key(i), cfg, hist)]


# ---------------------------------------------------------------- generate
BYTES = BPETokenizer([byte_to_unicode()[b] for b in range(256)], merges=[])


def scripted(script, vocab=256, n_prompt=1, cache=None):
    "A step whose logits put 30 on the next id of `script` (0 after it); writes `cache` if given."
    calls = []

    def step(tokens, pos):
        calls.append((list(tokens), pos))
        if cache is not None:
            for l in range(cache.n_layers):
                cache.write(l, pos, np.zeros((1, len(tokens), 2)), np.zeros((1, len(tokens), 2)))
            cache.commit(len(tokens))
        out = np.zeros((len(tokens), vocab))
        for i in range(len(tokens)):
            j = pos + i - n_prompt + 1
            out[i, script[j] if 0 <= j < len(script) else 0] = 30.0
        return out

    step.calls = calls
    return step


def run(step, prompt, cfg, **kw):
    g = generate(step, prompt, cfg, **kw)
    events = list(g)
    assert (
        all(isinstance(e, Event) for e in events)
        and events[-1].stop == g.stop_reason in STOP_REASONS
    )
    assert all(e.stop is None for e in events[:-1])
    assert ''.join(e.text for e in events) == g.text and [e.token for e in events] == g.tokens
    return g, events


def test_prefill_then_one_token_steps():
    step = scripted([5, 6, 7, 8], n_prompt=3)
    g, _ = run(step, [1, 2, 3], GenerationConfig(max_new_tokens=3, temperature=0))
    assert step.calls == [([1, 2, 3], 0), ([5], 3), ([6], 4)]
    assert (
        g.tokens == [5, 6, 7]
        and g.stop_reason == 'max_new_tokens'
        and g.n_steps == 2
        and g.n_prompt == 3
    )


def test_stop_on_eog_from_config_and_tokenizer():
    g, ev = run(
        scripted(list(b'hi') + [9, 65]),
        [0],
        GenerationConfig(eog_ids=[9], temperature=0),
        tokenizer=BYTES,
    )
    assert (
        g.stop_reason == 'eog'
        and g.tokens == [104, 105, 9]
        and g.text == 'hi'
        and ev[-1].text == ''
    )
    tok = BPETokenizer([byte_to_unicode()[b] for b in range(256)], merges=[], eos_id=33)
    g, _ = run(scripted(list(b'ab!cd')), [0], GenerationConfig(temperature=0), tokenizer=tok)
    assert g.stop_reason == 'eog' and g.text == 'ab' and g.tokens[-1] == 33
    # an explicit list replaces the tokenizer's: '!' is then ordinary text
    g, _ = run(
        scripted(list(b'ab!cd')),
        [0],
        GenerationConfig(temperature=0, eog_ids=[], max_new_tokens=5),
        tokenizer=tok,
    )
    assert g.stop_reason == 'max_new_tokens' and g.text == 'ab!cd'


def test_ignore_eos_suppresses_and_continues():
    g, _ = run(
        scripted([104, 9, 9, 9]),
        [0],
        GenerationConfig(eog_ids=[9], ignore_eos=True, temperature=0, max_new_tokens=4),
        tokenizer=BYTES,
    )
    assert g.stop_reason == 'max_new_tokens' and 9 not in g.tokens and len(g.tokens) == 4


@pytest.mark.parametrize(
    'stop, text, want',
    [
        ('END', 'abc END xyz', 'abc '),
        ('END', 'aENENDx', 'aEN'),
        ('\n\n', 'one\ntwo\n\nthree', 'one\ntwo'),
        ('é!', 'caféé!x', 'café'),
        ('zz', 'no stop here', 'no stop here'),
    ],
)
def test_stop_strings_not_emitted(stop, text, want):
    script = list(text.encode())
    g, ev = run(
        scripted(script),
        [0],
        GenerationConfig(stop_strings=[stop, 'never'], temperature=0, max_new_tokens=len(script)),
        tokenizer=BYTES,
    )
    assert g.text == want
    assert g.stop_reason == ('max_new_tokens' if stop not in text else 'stop_string')


def test_stop_string_held_back_until_decided():
    g = generate(
        scripted(list(b'xEN!')),
        [0],
        GenerationConfig(stop_strings=['END'], temperature=0, max_new_tokens=4),
        tokenizer=BYTES,
    )
    texts = [e.text for e in g]
    assert texts == ['x', '', '', 'EN!'] and g.stop_reason == 'max_new_tokens'


def test_utf8_held_back_and_flushed():
    script = list('aé€'.encode())  # 1 + 2 + 3 bytes
    g, ev = run(
        scripted(script), [0], GenerationConfig(temperature=0, max_new_tokens=6), tokenizer=BYTES
    )
    assert [e.text for e in ev] == ['a', '', 'é', '', '', '€']
    g, ev = run(
        scripted(script), [0], GenerationConfig(temperature=0, max_new_tokens=5), tokenizer=BYTES
    )
    assert (
        g.text == 'aé\ufffd' and ev[-1].text == '\ufffd'
    )  # the cut-off character, flushed as U+FFFD


def test_cache_full_and_positions_continue():
    cache = KVCache(2, 6, 1, 2)
    step = scripted([5, 6, 7, 8, 9], n_prompt=3, cache=cache)
    g, _ = run(step, [1, 2, 3], GenerationConfig(temperature=0, max_new_tokens=10), cache=cache)
    assert g.stop_reason == 'cache_full' and g.tokens == [5, 6, 7, 8] and cache.length == 6
    assert [p for _, p in step.calls] == [0, 3, 4, 5]
    # a second turn starts at the cache length
    cache.truncate(2)
    step2 = scripted([1], cache=cache)
    g2, _ = run(step2, [4], GenerationConfig(temperature=0, max_new_tokens=2), cache=cache)
    assert step2.calls[0] == ([4], 2) and g2.stop_reason == 'max_new_tokens'


def test_prompt_too_long_for_cache():
    cache = KVCache(1, 4, 1, 2)
    with pytest.raises(
        CacheError, match=r'prompt of 5 tokens at position 0 does not fit the cache \(capacity 4\)'
    ):
        generate(scripted([1]), [1, 2, 3, 4, 5], GenerationConfig(), cache=cache)


def test_step_that_forgets_the_cache():
    cache = KVCache(1, 8, 1, 2)
    with pytest.raises(CacheError, match='must write and commit'):
        list(generate(scripted([1]), [1, 2], GenerationConfig(), cache=cache))


def test_bad_step_output():
    with pytest.raises(ShapeError, match='step returned logits of shape'):
        list(generate(lambda t, p: np.zeros((len(t), 2, 3)), [1, 2], GenerationConfig()))


@pytest.mark.parametrize('prompt', [[], [[1, 2]], [1.5], [-1]])
def test_bad_prompt(prompt):
    with pytest.raises(ValueError, match='prompt_ids'):
        generate(scripted([1]), np.asarray(prompt), GenerationConfig())


def test_stop_strings_need_tokenizer_and_config_type():
    with pytest.raises(ValueError, match='need a tokenizer'):
        generate(scripted([1]), [1], GenerationConfig(stop_strings=['x']))
    with pytest.raises(TypeError, match='GenerationConfig'):
        generate(scripted([1]), [1], dict(temperature=0))


def test_blas_threads_follow_the_work_of_each_step():
    "A short prefill and every decode step run on one BLAS thread, a long prefill on threads()."
    seen = []

    def step(tokens, pos):
        seen.append((len(tokens), kernels.blas_threads()))
        return np.zeros((len(tokens), 4))

    widths = (576, 1536)  # SmolLM2's dim and ffn_dim
    long = -(-kernels.SMALL_PRODUCT // (576 * 1536))  # the fewest tokens at the threshold
    cfg = GenerationConfig(temperature=0, max_new_tokens=3)
    before = kernels.blas_threads()
    try:
        kernels.set_threads(2)
        list(generate(step, [1] * 5, cfg, widths=widths))
        list(generate(step, [1] * long, cfg, widths=widths))
        list(generate(step, [1] * long, cfg))  # widths unknown: one thread throughout
        decode_steps = [(1, 1), (1, 1)]
        assert seen == [(5, 1), *decode_steps, (long, 2), *decode_steps, (long, 1), *decode_steps]
        assert kernels.blas_threads() == 2  # given back after every step
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize('widths', [(576,), (0, 1536), (576.0, 1536), 576, 'ab', (True, 2)])
def test_bad_widths(widths):
    with pytest.raises(ValueError, match=r'generate: widths must be None or \(d_in, d_out\)'):
        generate(scripted([1]), [1], GenerationConfig(), widths=widths)


def test_iterates_once_and_is_reproducible():
    step = lambda t, p: np.tile(np.linspace(0, 1, 20), (len(t), 1))
    a = generate(step, [1], GenerationConfig(seed=3, max_new_tokens=30))
    first = [e.token for e in a]
    with pytest.raises(RuntimeError, match='only once'):
        list(a)
    assert first == [
        e.token for e in generate(step, [1], GenerationConfig(seed=3, max_new_tokens=30))
    ]
    assert first != [
        e.token for e in generate(step, [1], GenerationConfig(seed=4, max_new_tokens=30))
    ]


def test_char_tokenizer_streams():
    tok = CharTokenizer.from_text('abc ')
    g, _ = run(
        scripted([1, 2, 0, 3], vocab=4),
        [0],
        GenerationConfig(temperature=0, max_new_tokens=4),
        tokenizer=tok,
    )
    assert g.text == 'ab c'


# ---------------------------------------------------------------- bottom-right causal mask
def mask_loop(t_q, t_k, window=None):
    "Query i sits at position t_k - t_q + i; it sees keys at or before it (and within the window)."
    m = np.zeros((t_q, t_k), bool)
    for i in range(t_q):
        me = t_k - t_q + i
        for j in range(t_k):
            m[i, j] = j <= me and (window is None or me - j < window)
    return m


@pytest.mark.parametrize('t_q, t_k', [(1, 1), (1, 7), (3, 7), (7, 7), (4, 9), (0, 3)])
@pytest.mark.parametrize('window', [None, 1, 2, 5])
def test_causal_mask_bottom_right(t_q, t_k, window):
    assert np.array_equal(causal_mask(t_q, t_k, window=window), mask_loop(t_q, t_k, window))
    assert causal_mask(t_q, t_k, window=window).shape == (t_q, t_k)
    if t_q:
        assert causal_mask(t_q, t_k)[-1].all()  # the last query sees every key


def test_causal_mask_explicit_offset_and_errors():
    # an explicit offset keeps its meaning: query i at position offset + i
    assert np.array_equal(causal_mask(2, 5, offset=0), np.tri(2, 5, dtype=bool))
    assert np.array_equal(causal_mask(2, offset=3), mask_loop(2, 5))
    with pytest.raises(ValueError, match='offset=-2'):
        causal_mask(5, 3)  # more queries than keys needs an explicit offset
    with pytest.raises(ValueError, match='window'):
        causal_mask(2, 3, window=0)


# ---------------------------------------------------------------- GPT decode parity
TINY = gpt.GPTConfig(vocab_size=13, block_size=16, n_layer=2, n_head=2, n_embd=8)


def gpt_params(dtype):
    p = gpt.init(R.key(0), TINY)
    return tree_map(lambda a: a.astype(dtype), p)


def gpt_parity(dtype, tokens, n_prefill):
    p = gpt_params(dtype)
    step = models.stepper(p, TINY, models.new_cache(TINY, dtype=dtype), all_logits=True)
    forward = lambda t: gpt.apply(p, t[None], TINY)[0]
    return decode_parity(step, forward, tokens, n_prefill)


@pytest.mark.parametrize('n_prefill', [1, 5, 16])
def test_gpt_decode_parity_float64(n_prefill):
    tokens = np.random.default_rng(n_prefill).integers(0, 13, 16)
    d = gpt_parity(np.float64, tokens, n_prefill)
    assert d.shape == (16,) and d.max() < 1e-10


def test_gpt_decode_parity_float32():
    tokens = np.random.default_rng(1).integers(0, 13, 16)
    assert gpt_parity(np.float32, tokens, 4).max() < 1e-5


def test_gpt_cache_positions_continue():
    "A decode step uses the position embedding of its absolute position: a wrong pos is refused."
    p = gpt_params(np.float64)
    cache = models.new_cache(TINY, dtype=np.float64)
    step = models.stepper(p, TINY, cache, all_logits=True)
    step(np.array([1, 2, 3]), 0)
    with pytest.raises(CacheError, match='gap'):
        step(np.array([4]), 5)
    with pytest.raises(CacheError, match='overwrite'):
        cached_step(lambda t, pos, kv: gpt.apply(p, t, TINY, pos=pos, kv=kv), cache)([4], 0)
    full = gpt.apply(p, np.array([[1, 2, 3, 4]]), TINY)[0, -1]
    assert np.abs(step(np.array([4]), 3)[-1] - full).max() < 1e-12
    with pytest.raises(ValueError, match="exceeds the GPT's block_size"):
        models.new_cache(TINY, capacity=17)
    with pytest.raises(ShapeError, match='outside block_size'):
        gpt.apply(p, np.arange(13)[None], TINY, pos=4)


def test_gpt_generate_with_decode_generate_stops_at_cache_full():
    p = gpt_params(np.float32)
    cache = models.new_cache(TINY)
    cfg = GenerationConfig(max_new_tokens=100, seed=1)
    g = generate(models.stepper(p, TINY, cache), [1, 2, 3], cfg, cache=cache)
    toks = [e.token for e in g]
    assert g.stop_reason == 'cache_full' and len(toks) == 14 and cache.length == 16


def sliding(p, prompt, n, key=None, **settings):
    "The ids of a GPT generation past block_size: its step slides, generate runs without the cache."
    step = models.stepper(p, TINY, models.new_cache(TINY, dtype=p['wte'].dtype))
    run = generate(step, prompt, GenerationConfig(max_new_tokens=n, **settings), key=key)
    return list(prompt) + [e.token for e in run]


def test_gpt_generate_slides_past_block_size():
    """Temperature 0 is the argmax of the full forward over the last block_size tokens, top_k 1 is
    greedy, top_k 0 is off; the sampling key defaults to key(seed) and can be given."""
    p = gpt_params(np.float64)
    greedy = sliding(p, [1], 24, temperature=0)  # past block_size 16
    assert greedy == sliding(p, [1], 24, R.key(7), top_k=1)
    seq = [1]
    for _ in range(24):
        ctx = np.asarray(seq[-TINY.block_size :])[None]
        seq.append(int(np.argmax(gpt.apply(p, ctx, TINY)[0, -1])))
    assert greedy == seq
    a, b = sliding(p, [1], 30, R.key(5)), sliding(p, [1], 30, seed=5)
    assert a == b and len(set(a)) > 3
    assert sliding(p, [1], 30, R.key(6)) != a
    long = list(range(13)) * 2                          # a prompt longer than the context
    assert sliding(p, long, 3, temperature=0)[-3:] == sliding(p, long[-16:], 3, temperature=0)[-3:]


def test_sliding_step_refuses_a_gap_and_forgets_on_rewind():
    p = gpt_params(np.float64)
    cache = models.new_cache(TINY, dtype=np.float64)
    step = models.stepper(p, TINY, cache, all_logits=True)
    step([1, 2, 3], 0)
    with pytest.raises(CacheError, match='leave a gap'):
        step([4], 5)
    cache.truncate(1)
    z = step([7, 8], 1)                                 # positions 1.. again, new tokens
    full = gpt.apply(p, np.array([[1, 7, 8]]), TINY)[0, 1:]
    assert np.abs(z - full).max() < 1e-12


def test_reserve_claims_every_layer_and_checks_as_write():
    c = KVCache(2, 6, 2, 3, windows=[None, 2])
    for l in range(2): c.write(l, 0, rows(3), rows(3))
    c.commit(3)
    k, v, starts = c.reserve(3, 2)
    assert k.shape == (2, 2, 5, 3) and starts.tolist() == [0, 2]
    k[:, :, 3:], v[:, :, 3:] = 1.0, 2.0
    c.commit(2)
    assert c.length == 5 and (c.k[:, :, 3:5] == 1).all() and (c.v[:, :, 3:5] == 2).all()
    with pytest.raises(CacheError, match='overflows'):
        c.reserve(5, 2)
    with pytest.raises(CacheError, match='gap'):
        c.reserve(6)
    with pytest.raises(CacheError, match='n must be'):
        c.reserve(5, 0)
    c.reserve(5)
    with pytest.raises(CacheError, match='commit'):
        c.commit(2)


def test_attend_mask_and_hook_layout():
    c = KVCache(1, 8, 2, 3, windows=[3])
    k, v, mask = c.attend(0, 0, rows(4), rows(4))
    want = causal_mask(4, window=3)
    assert k.shape == (2, 4, 3) and (mask == want).all()
    c.commit(4)
    hook = c.hook(4)
    with pytest.raises(ShapeError, match='batch 1'):
        hook(0, rows(1)[None, :, None].repeat(2, 0), rows(1)[None, :, None].repeat(2, 0))
    k5, v5, m5 = hook(0, rows(1)[None, :, None], rows(1)[None, :, None])
    assert k5.shape == (1, 2, 1, 3, 3) and m5.tolist() == [[True, True, True]]


def test_greedy_needs_no_key():
    z = np.array([0.0, 2.0, 2.0, 1.0])
    assert sample(z, None, GenerationConfig(temperature=0)) == 1
    with pytest.raises(TypeError, match='key'):
        sample(z, None, GenerationConfig(temperature=0.7))
    with pytest.raises(TypeError, match='key'):
        sample(z, 7, GenerationConfig(temperature=0))
