"""The sampler at the edges of float64 (issue 25, item 7): temperatures down to the smallest
subnormal and up to the largest float, logits near ±1.8e308, penalties that would leave float64's
range, top-k/top-p/min-p at their extreme settings, NaN/inf and oversized logits, malformed
histories. Each case ends in a correct draw (checked against exact arithmetic: `fractions` for the
penalties, `decimal` for the tempered distribution) or a typed error; none in a numpy error or a
token that should not be drawable. A fixed, seeded list of cases: bounded by work, not time."""
import decimal, itertools, math
from fractions import Fraction
import numpy as np, pytest
from gradus.errors import ConfigError
from gradus.learn import random as R
from gradus.lm.sampling import (GenerationConfig, apply_penalties, apply_temperature,
                                sampler_stages, sample, softmax64)

MAX = np.finfo(np.float64).max
TINY = 5e-324
KEYS = R.split(R.key(25), 64)


# ---------------------------------------------------------------- the three cases
def test_tiny_temperature_is_the_argmax():
    z = np.array([5.0, 0.0, -3.0])
    for t in (1e-308, 1e-300, TINY, 2.2e-308):
        assert {sample(z, k, GenerationConfig(temperature=t)) for k in KEYS} == {0}, t
    tied = np.array([5.0, 5.0, -3.0])                      # a tie: both maxima, nothing else
    assert {sample(tied, k, GenerationConfig(temperature=1e-308)) for k in KEYS} == {0, 1}


def test_huge_negative_frequency_penalty():
    z, cfg = np.array([5.0, 0.0, -3.0]), GenerationConfig(frequency_penalty=-1e308)
    with pytest.raises(ConfigError, match=r'frequency_penalty=-1e\+308 .* token 1 \(seen 2 '):
        sample(z, KEYS[0], cfg, history=[1, 1])
    assert {sample(z, k, cfg, history=[1]) for k in KEYS} == {1}      # 0 + 1e308: certain


def test_logits_near_the_float64_limit():
    z = np.array([1.7e308, 1.6e308, -1.7e308, -MAX, MAX])
    for t in (0.5, 1.0, 1.5, 2.0):
        assert {sample(z, k, GenerationConfig(temperature=t)) for k in KEYS} == {4}, t
    z = np.array([1.7e308, 1.6e308, -1.7e308])
    p = softmax64(apply_temperature(z, 1e308))             # (1.7, 1.6, -1.7): a real distribution
    want = np.exp([0, -0.1, -3.4]); want /= want.sum()
    assert np.allclose(p, want, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- exact oracles
def exact_tempered(z, t):
    "softmax(z / t) in 60-digit decimal arithmetic (no overflow), as float64."
    with decimal.localcontext() as c:
        c.prec, c.Emin, c.Emax = 60, -10**9, 10**9
        fin = [decimal.Decimal(float(v)) for v in z if np.isfinite(v)]
        top = max(fin)
        e = [(decimal.Decimal(float(v)) - top) / decimal.Decimal(t) if np.isfinite(v) else None
             for v in z]
        q = [(x.exp() if x is not None else decimal.Decimal(0)) for x in e]
        s = sum(q)
        return np.array([float(x / s) for x in q])


def exact_penalties(z, history, cfg):
    """The penalised logits by the definition, each step rounded once to float64 (as numpy does);
    None where a step's exact value leaves float64's range."""
    z, h, w = [float(v) for v in z], list(history), cfg.penalty_window
    h = h if w is None else h[max(0, len(h) - w):] if w else []
    out = list(z)
    for i in sorted(set(h)):
        if not math.isfinite(z[i]): continue
        n = h.count(i)
        try:
            x = Fraction(z[i])
            x = float(x / Fraction(cfg.repetition_penalty) if x > 0
                      else x * Fraction(cfg.repetition_penalty))
            x = float(Fraction(x) - n * Fraction(cfg.frequency_penalty))
            x = float(Fraction(x) - Fraction(cfg.presence_penalty))
        except OverflowError: return None
        out[i] = x
    return np.array(out)


LOGITS = {
    'normal': np.array([2.0, -1.0, 0.5, 0.0, -np.inf, 3.0]),
    'near max': np.array([1.7e308, -1.7e308, MAX, -MAX, 1e308, 0.0]),
    'subnormal': np.array([TINY, -TINY, 0.0, 2 * TINY, -np.inf, 1e-310]),
    'tied': np.array([1.0, 1.0, 1.0, -np.inf, 1.0, 1.0]),
    'one finite': np.array([-np.inf, -np.inf, -1e308, -np.inf, -np.inf, -np.inf]),
    'wide': np.array([1e300, -1e300, 1e-300, 1.0, -1.0, 1e200]),
}
TEMPS = [0, TINY, 1e-308, 1e-300, 1e-3, 0.5, 1, 1.5, 2, 1e3, 1e300, MAX]
REPS = [1, TINY, 1e-300, 0.5, 2, 1e300, MAX]
ADDS = [0, 1, -1, 1e308, -1e308, MAX, -MAX, 1e-320]


def case_list():
    rng = np.random.default_rng(7)
    combos = list(itertools.product(LOGITS, TEMPS, REPS, ADDS, ADDS))
    picks = rng.choice(len(combos), 1500, replace=False)
    for j in picks:
        name, t, r, f, p = combos[j]
        cfg = GenerationConfig(temperature=t, repetition_penalty=r, frequency_penalty=f,
                               presence_penalty=p, top_k=int(rng.choice([0, 1, 2, 5, 2**62])),
                               top_p=float(rng.choice([1, 1 - 1e-16, 0.5, 1e-300, TINY])),
                               min_p=float(rng.choice([0, TINY, 1e-300, 0.5, 1])),
                               penalty_window=[None, 0, 3, 64][int(rng.integers(4))])
        yield name, cfg, rng.integers(0, 6, int(rng.integers(0, 6))).tolist()


def test_sampler_class_at_the_edges():
    """Every combination: a draw that survives the last stage and equals the inverse CDF of
    `sampler_stages`, a tempered distribution equal to exact arithmetic, penalties equal to the
    definition; or a ConfigError exactly where a penalty step leaves float64's range."""
    handled = {'drawn': 0, 'refused': 0}
    for i, (name, cfg, hist) in enumerate(case_list()):
        z, key = LOGITS[name], KEYS[i % len(KEYS)]
        want = exact_penalties(z, hist, cfg)
        if want is None:
            with pytest.raises(ConfigError, match='past float64'): sample(z, key, cfg, hist)
            with pytest.raises(ConfigError, match='past float64'): sampler_stages(z, cfg, hist)
            handled['refused'] += 1
            continue
        stages = dict(sampler_stages(z, cfg, hist))
        # the exact value is rounded once; a second formula for count·f beyond float64 may differ
        # from it by an ulp
        assert np.allclose(stages['penalties'], want, rtol=1e-15, atol=0), name
        for s, v in stages.items():
            assert not np.isnan(v).any() and not (v == np.inf).any(), (name, cfg, s)
            assert np.isfinite(v).any(), (name, cfg, s)          # every stage keeps a token
        if cfg.temperature:
            got = softmax64(stages['temperature'])
            assert np.allclose(got, exact_tempered(stages['penalties'], cfg.temperature),
                               rtol=1e-12, atol=1e-300), (name, cfg)
        final, tok = stages['min-p'], sample(z, key, cfg, hist)
        assert 0 <= tok < z.size and np.isfinite(final[tok]), (name, cfg, hist)
        cum = np.cumsum(np.exp(final - final.max()))
        inv = int(np.searchsorted(cum, R.rng(key).random() * cum[-1], side='right'))
        assert tok == (inv if cfg.temperature else int(np.argmax(stages['penalties']))), name
        handled['drawn'] += 1
    assert handled['drawn'] > 500 and handled['refused'] > 50, handled


def test_penalty_refusal_names_the_setting():
    z = np.array([1e308, -1e308, 5.0])
    for cfg, hist, setting in [(GenerationConfig(repetition_penalty=1e-10), [0], 'repetition'),
                               (GenerationConfig(repetition_penalty=1e10), [1], 'repetition'),
                               (GenerationConfig(frequency_penalty=-1e308), [0], 'frequency'),
                               (GenerationConfig(frequency_penalty=1e308), [1, 1], 'frequency'),
                               (GenerationConfig(presence_penalty=-MAX), [0], 'presence')]:
        with pytest.raises(ConfigError, match=f'{setting}_penalty=.* token {hist[0]} '):
            apply_penalties(z, hist, cfg)
    # a removed token stays removed, whatever the penalty does to the others
    out = apply_penalties(np.array([-np.inf, 1.0]), [0, 0],
                          GenerationConfig(frequency_penalty=-1e308, repetition_penalty=TINY))
    assert out[0] == -np.inf and out[1] == 1.0
    # count·f alone overflows, the penalised logit does not: -1.7e308 + 2·1e308 = 3e307
    out = apply_penalties(np.array([-1.7e308]), [0, 0], GenerationConfig(frequency_penalty=-1e308))
    assert out[0] == pytest.approx(3e307, rel=1e-15)


# ---------------------------------------------------------------- refused inputs
@pytest.mark.parametrize('logits,match', [
    (np.array([np.nan, 0.0]), 'NaN'), (np.array([0.0, np.inf]), r'\+inf'),
    (np.array([-np.inf, -np.inf]), 'every logit is -inf'),
    (np.array([np.longdouble('1e400'), 0.0], dtype=np.longdouble), "past float64's range"),
    (np.array([-np.longdouble('1e400'), 0.0], dtype=np.longdouble), "past float64's range"),
    (np.arange(3), '1-D float'), (np.array([True]), '1-D float'), (np.zeros((1, 2)), '1-D float'),
    (np.array([], np.float32), '1-D float'), (np.array([1 + 2j]), '1-D float'),
    (np.array(['a']), '1-D float')])
def test_bad_logits_are_refused(logits, match):
    if logits.dtype == np.longdouble and np.finfo(np.longdouble).max <= MAX:
        pytest.skip('long double is float64 on this machine')
    for t in (0, 1):
        with pytest.raises(ValueError, match='sample: .*' + match):
            sample(logits, KEYS[0], GenerationConfig(temperature=t))


def test_other_float_dtypes_are_read_exactly():
    for dt in (np.float16, np.float32):
        z = np.array([np.finfo(dt).max, -np.finfo(dt).max, 0], dt)
        assert {sample(z, k, GenerationConfig(temperature=1e-308)) for k in KEYS} == {0}


@pytest.mark.parametrize('history', [[1.5], [True], ['1'], [2**64], [-1], [3], [np.float64(1)],
                                     [None], [[1]]])
def test_bad_history_is_refused(history):
    cfg = GenerationConfig(repetition_penalty=1.3)
    with pytest.raises(ValueError, match=r'history holds token ids outside \[0, 3\)'):
        sample(np.zeros(3), KEYS[0], cfg, history)


def test_good_history_kinds():
    cfg, z = GenerationConfig(repetition_penalty=2.0), np.array([2.0, 2.0, 2.0])
    for h in ([0, 0], np.array([0, 0], np.uint8), (np.int64(0),), range(1), iter([0])):
        assert apply_penalties(z, h, cfg)[0] == 1.0


@pytest.mark.parametrize('field,value', [
    ('temperature', 10**400), ('temperature', -TINY), ('temperature', np.nan), ('top_p', 0),
    ('top_p', 1.0000000000000002), ('min_p', -TINY), ('min_p', 1.0000000000000002), ('top_k', -1),
    ('top_k', 2**63), ('seed', 2**64), ('max_new_tokens', 0), ('penalty_window', 2**63),
    ('repetition_penalty', 0), ('repetition_penalty', np.inf), ('frequency_penalty', np.nan),
    ('presence_penalty', 10**400), ('eog_ids', [2**63]), ('eog_ids', 5), ('stop_strings', 5),
    ('stop_strings', ['']), ('ignore_eos', 1)], ids=lambda v: str(v)[:16])
def test_config_ranges(field, value):
    with pytest.raises(ConfigError, match=field): GenerationConfig(**{field: value})


def test_config_sequences_from_generators():
    cfg = GenerationConfig(eog_ids=(i for i in (2, 3)), stop_strings=(s for s in ['END']))
    assert cfg.eog_ids == (2, 3) and cfg.stop_strings == ('END',)


def test_sample_needs_a_config():
    with pytest.raises(TypeError, match='GenerationConfig'):
        sample(np.zeros(3), KEYS[0], {'temperature': 0})
