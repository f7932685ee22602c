"""Attack tests for the decode paths on non-finite input (issue 25, item 1): a NaN or infinite
float16 scale in every kind of weight, in each block type the fused engine runs (Q4_0, Q4_1, Q8_0),
in Q4_1's minimum, in the embedding and the head; NaN and infinite norm gains; settings out of
range; weights whose products overflow float32; a worker that fails inside the engine's parallel
region. Each runs on the fused engine (int8 and exact activations), through `decode.generate` over
the default `models.stepper` (a prefill on `models.forward`, then the engine: what `gradus
generate` runs) and on the general path alone (`models.stepper(fused=False)`), in a child process
with a timeout, so that a hang fails the test instead of hanging the suite.

The oracle is the construction: a block whose scale is NaN or ±inf has only non-finite weights (IEEE
754: NaN·c and ±inf·0 are NaN, ±inf·c is ±inf), and every product that reads it is non-finite; so
every path must end in a typed error that names the tensor (a `FormatError` if admission refuses
the file, else a `NonFiniteError` on the first step), never in finite logits and never in a hang.
The models are tiny Llamas written here byte by byte (`_gguf_build`); the real SmolLM2 file with
the two bytes of the issue changed runs once through `gradus generate`. Bounded by work: a fixed,
seeded list of cases."""

import itertools
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _gguf_build as B
from _models import find
from gradus.formats import gguf

TYPES = {'Q4_0': (2, 18), 'Q4_1': (3, 20), 'Q8_0': (8, 34)}   # GGML id, bytes a block of 32
FIELDS = {'Q4_0': (0,), 'Q4_1': (0, 2), 'Q8_0': (0,)}        # float16 fields (ggml-common.h)
DIM, HEADS, KV, FFN, LAYERS, VOCAB, CTX = 64, 4, 2, 96, 2, 64, 32
MATS = {'attn_q': (HEADS * DIM // HEADS, DIM), 'attn_k': (KV * DIM // HEADS, DIM),
        'attn_v': (KV * DIM // HEADS, DIM), 'attn_output': (DIM, DIM), 'ffn_gate': (FFN, DIM),
        'ffn_up': (FFN, DIM), 'ffn_down': (DIM, FFN)}       # (rows, columns)
TOKENS = [3, 1, 2]                                            # the steps of every case
LIMIT = 600   # seconds for one child: a hang, or a first compile of the engine on a busy machine


def _f16(v): return np.array([v], np.float16).view(np.uint8)


def _matrix(rng, t, rows, cols):
    "Random blocks of type `t` with small finite float16 fields."
    nb, ts = rows * cols // 32, TYPES[t][1]
    b = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    d = (0.001 + 0.002 * rng.random(nb)) if t == 'Q8_0' else (0.02 + 0.03 * rng.random(nb))
    b[:, 0:2] = np.asarray(d, np.float16).view(np.uint8).reshape(nb, 2)
    if t == 'Q4_1': b[:, 2:4] = np.asarray(-8 * d, np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(rows, -1)


def tiny_llama(path, t, tied=False, poke=None, meta=(), seed=0):
    """A Llama GGUF of `LAYERS` layers, every matrix of type `t`; `poke`: `(tensor, row, block,
    field, value)` writes `value` (float16) into that field of that block, or `(tensor, index,
    value)` into an F32 gain; `meta`: `(key, value)` float32 settings."""
    rng, a = np.random.default_rng(seed), 'llama'
    kvs = [B.kv_str('general.architecture', a), B.kv_u32(f'{a}.block_count', LAYERS),
           B.kv_u32(f'{a}.embedding_length', DIM), B.kv_u32(f'{a}.attention.head_count', HEADS),
           B.kv_u32(f'{a}.attention.head_count_kv', KV), B.kv_u32(f'{a}.feed_forward_length', FFN),
           B.kv_u32(f'{a}.context_length', CTX)]
    settings = {'attention.layer_norm_rms_epsilon': 1e-5, **dict(meta)}
    kvs += [B.s(f'{a}.{k}') + struct.pack('<If', 6, v) for k, v in settings.items()]
    mats = {'token_embd.weight': (VOCAB, DIM)}
    mats.update({f'blk.{i}.{n}.weight': s for i in range(LAYERS) for n, s in MATS.items()})
    if not tied: mats['output.weight'] = (VOCAB, DIM)
    gains = ['output_norm.weight'] + [f'blk.{i}.{n}.weight' for i in range(LAYERS)
                                      for n in ('attn_norm', 'ffn_norm')]
    blobs = {n: _matrix(rng, t, r, c) for n, (r, c) in mats.items()}
    vecs = {n: (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32) for n in gains}
    if poke and len(poke) == 5:
        name, row, block, field, value = poke
        o = block * TYPES[t][1] + field
        blobs[name][row, o:o + 2] = _f16(value)
    elif poke:
        vecs[poke[0]][poke[1]] = poke[2]
    tensors = [(n, [c, r], TYPES[t][0], blobs[n].tobytes()) for n, (r, c) in mats.items()]
    tensors += [(n, [DIM], 0, v.tobytes()) for n, v in vecs.items()]
    path.write_bytes(B.build(kvs, tensors)[0])
    return path


CHILD = r'''
import json, math, sys
import numpy as np
from gradus.errors import GradusError
from gradus.lm import decode, engine, models
from gradus.lm.sampling import GenerationConfig

KEYS = {'attn_q': 'wq', 'attn_k': 'wk', 'attn_v': 'wv', 'attn_output': 'wo', 'ffn_gate': 'w_gate',
        'ffn_up': 'w_up', 'ffn_down': 'w_down', 'attn_norm': 'attn_norm', 'ffn_norm': 'ffn_norm'}


def where(params, name):
    "(container, key) of the tensor `name` (a GGUF name) in `params`."
    if name == 'token_embd.weight': return params, 'embed'
    if name == 'output.weight': return params, 'output'
    if name == 'output_norm.weight': return params, 'norm'
    _, layer, kind, _ = name.split('.')
    return params['layers'][int(layer)], KEYS[kind]


def mutate(params, c, m):
    "A copy of `params` (and `c`) changed in memory as the case says (bypassing admission)."
    if m is None: return params, c
    params = {**params, 'layers': [dict(lp) for lp in params['layers']]}
    if m['kind'] == 'config':
        return params, c._replace(**{m['key']: float(m['value'])})
    box, key = where(params, m['tensor'])
    t = box[key]
    if m['kind'] == 'gain':
        v = t.copy(); v[m['index']] = float(m['value']); box[key] = v
    else:
        b = t.blocks.copy()
        o = m['block'] * (b.shape[1] // (t.shape[1] // 32)) + m['field']
        b[m['row'], o:o + 2] = np.array([float(m['value'])], np.float16).view(np.uint8)
        box[key] = t._replace(blocks=b)
        if key == 'embed' and c.tied_embeddings: params['output'] = box[key]
    return params, c


def run(case):
    try:
        params, c = models.from_gguf(case['file'])
    except GradusError as e:
        return {'at': 'load', 'error': type(e).__name__, 'typed': True, 'msg': str(e)}
    params, c = mutate(params, c, case.get('mutate'))
    cache, toks, logits = models.new_cache(c, 8), case['tokens'], []
    try:
        if case.get('workers'):                        # a worker that fails inside the region
            ws = engine.workspace(params, c, 8)
            bad = ws._replace(weights=type(ws.weights)(list(ws.weights)[:7]))
            try: engine.decode_step(params, c, cache, toks[0], 0, bad)
            except RuntimeError as e: first = str(e)
            else: first = None
            again = engine.decode_step(params, c, cache, toks[0], 0, ws)
            ref = models.apply(params, np.array(toks[:1]), c)[-1]
            return {'at': 'workers', 'first': first, 'length': cache.length,
                    'again': float(np.abs(again - ref).max())}
        if case['path'] == 'generate':                 # as gradus generate: prefill, then decode
            step = models.stepper(params, c, cache)
            g = decode.generate(step, np.array(toks), GenerationConfig(max_new_tokens=3,
                                temperature=0), cache=cache)
            logits = [e.token for e in g]
            return {'at': 'done', 'finite': True, 'tokens': logits}
        if case['path'] == 'general':
            step = models.stepper(params, c, cache, fused=False)
            logits = [step(toks[:2], 0), step(toks[2:], 2)]
        else:
            step = models.stepper(params, c, cache, exact=case['path'] == 'exact', fused=True)
            logits = [step([t], p) for p, t in enumerate(toks)]
    except Exception as e:
        return {'at': 'step', 'error': type(e).__name__, 'typed': isinstance(e, GradusError),
                'msg': str(e), 'length': cache.length, 'steps': len(logits)}
    out = {'at': 'done', 'finite': bool(all(np.isfinite(z).all() for z in logits))}
    if case.get('reference'):                          # the clean model: equal to models.apply
        ref = models.apply(params, np.array(toks), c)[-len(logits):]
        out['gap'] = float(np.abs(np.stack(logits) - ref).max() / np.abs(ref).max())
    return out


for case in json.load(open(sys.argv[1])):
    print('START', case['id'], flush=True)
    print('RESULT', json.dumps({'id': case['id'], **run(case)}), flush=True)
'''


def run_cases(tmp_path, cases):
    """Run `cases` in one child process; `{id: result}`. A child that does not finish within
    `LIMIT` fails the test, naming the case it was running (a hang)."""
    (tmp_path / 'cases.json').write_text(json.dumps(cases))
    (tmp_path / 'child.py').write_text(CHILD)
    try:
        p = subprocess.run([sys.executable, str(tmp_path / 'child.py'),
                            str(tmp_path / 'cases.json')], capture_output=True, text=True,
                           timeout=LIMIT)
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
        started = [l[6:] for l in out.splitlines() if l.startswith('START ')]
        pytest.fail(f"the child hung in case {started[-1] if started else '?'} "
                    f"({len(started) - 1} of {len(cases)} done)")
    results = {r['id']: r for r in (json.loads(l[7:]) for l in out.splitlines()
                                     if l.startswith('RESULT '))}
    assert p.returncode == 0 and len(results) == len(cases), err[-3000:]
    return results


def scale_cases(tmp_path, t, rng):
    """A file per (tensor, float16 field): every matrix of both layers, the embedding and the
    head, the value NaN, +inf or -inf in turn, in a seeded block; each on the fused engine (int8
    and exact), through `decode.generate` and on the general path. Also the same in memory (the
    loaded params changed, past admission), on the first three."""
    names = ['token_embd.weight', 'output.weight'] + [
        f'blk.{i}.{n}.weight' for i in range(LAYERS) for n in MATS]
    shape = {'token_embd.weight': (VOCAB, DIM), 'output.weight': (VOCAB, DIM),
             **{f'blk.{i}.{n}.weight': s for i in range(LAYERS) for n, s in MATS.items()}}
    values = itertools.cycle([math.nan, math.inf, -math.inf])
    cases, known = [], {}
    for name, field in itertools.product(names, FIELDS[t]):
        rows, cols = shape[name]
        row = TOKENS[0] if name == 'token_embd.weight' else int(rng.integers(rows))
        block, value = int(rng.integers(cols // 32)), next(values)
        f = tiny_llama(tmp_path / f'{t}-{name}-{field}.gguf', t, poke=(name, row, block, field,
                                                                            value))
        for path in ('fused', 'exact', 'generate', 'general'):
            cid = f'{t} {name} field {field} = {value} ({path})'
            cases.append({'id': cid, 'file': str(f), 'path': path, 'tokens': TOKENS})
            known[cid] = (name, row, block)
        for path in ('fused', 'exact', 'generate'):
            cid = f'{t} {name} field {field} = {value} in memory ({path})'
            clean = tmp_path / f'{t}-clean.gguf'
            cases.append({'id': cid, 'file': str(clean), 'path': path, 'tokens': TOKENS,
                          'mutate': {'kind': 'scale', 'tensor': name, 'row': row, 'block': block,
                                     'field': field, 'value': value}})
            known[cid] = (name, row, block)
    return cases, known


def judge(cid, r, name, row=None, block=None):
    """A typed error naming `name`: a refusal at load, or a `NonFiniteError` on the first step with
    nothing committed to the cache (and, from the fused engine, the block). Through `generate`: a
    refusal at load naming `name`, or a `NonFiniteError` (from `generate`'s check of the prefill's
    logits, which knows no tensor, or from the engine on a later token, naming it)."""
    assert r['at'] in ('load', 'step'), (cid, r)
    if cid.endswith('(generate)') and r['at'] == 'step':
        assert r['error'] == 'NonFiniteError' and r['typed'], (cid, r)
        return 'NonFiniteError through generate'
    assert name in r['msg'], (cid, r['msg'])
    if r['at'] == 'load':
        assert r['error'] == 'FormatError', (cid, r)
        return 'refused at load'
    assert r['error'] == 'NonFiniteError' and r['typed'], (cid, r)
    assert r['length'] == 0 and r['steps'] == 0, (cid, r)
    if row is not None: assert f'row {row}, block {block}' in r['msg'], (cid, r['msg'])
    return 'NonFiniteError'


BAD_SETTINGS = [(key, value) for key in ('rope_base', 'norm_eps')
                for value in (math.nan, 0.0, -1.0, math.inf)]   # in a config changed by hand


@pytest.fixture(scope='module')
def scales(tmp_path_factory):
    """`{type: (cases, known)}` and the results of them all, run in one child process (one start,
    one load of the engine's compiled code): `scale_cases` of each type, a clean control of each
    on every path (equal to `models.apply`), and `BAD_SETTINGS` on the general path."""
    tmp, every, cases = tmp_path_factory.mktemp('scales'), {}, []
    for t in sorted(TYPES):
        rng = np.random.default_rng(list(TYPES).index(t))
        tiny_llama(tmp / f'{t}-clean.gguf', t)
        every[t] = scale_cases(tmp, t, rng)
        cases += every[t][0] + [{'id': f'{t} clean ({p})', 'file': str(tmp / f'{t}-clean.gguf'),
                                 'path': p, 'tokens': TOKENS, 'reference': True}
                                for p in ('fused', 'exact', 'general')]
    cases += [{'id': f'config {key} = {value} (general)', 'file': str(tmp / 'Q8_0-clean.gguf'),
               'path': 'general', 'tokens': TOKENS,
               'mutate': {'kind': 'config', 'key': key, 'value': value}}
              for key, value in BAD_SETTINGS]
    return every, run_cases(tmp, cases)


@pytest.mark.parametrize('t', sorted(TYPES))
def test_nonfinite_scales_name_the_tensor(scales, t):
    """Every weight kind, each float16 field, in files and in memory, on the fused engine (int8 and
    exact activations): a typed error naming the tensor and the block; through `decode.generate`
    (a prefill on `models.forward`, then the engine): a typed error. The clean file runs, finite
    and equal to `models.apply`, on every path. Before the fix a NaN query scale hung the engine
    (one worker raised `ZeroDivisionError` and left, the other waited for its rows), a NaN value
    scale gave logits of exactly 0, and `generate` ended in the sampler's `ValueError`."""
    (cases, known), results = scales[0][t], scales[1]
    for p in ('fused', 'exact', 'general'):
        cid = f'{t} clean ({p})'
        r = results[cid]
        assert r['at'] == 'done' and r['finite'], (cid, r)
        assert r['gap'] < (1e-4 if p != 'fused' else 0.05), (cid, r)   # relative
    checked = [c for c in cases if c['path'] != 'general']
    verdicts = [judge(c['id'], results[c['id']], *known[c['id']]) for c in checked]
    assert len(verdicts) == 6 * 16 * len(FIELDS[t])


def test_general_path_names_the_tensor_and_the_setting(scales):
    """The same files on the general path alone (`models.stepper(fused=False)`: a prefill of two
    tokens, then one): a typed error naming the tensor, never finite logits; and a config changed
    by hand to a setting no step can be finite with (`BAD_SETTINGS`): `ConfigError` naming it
    (`engine.check_settings`), as the engine does. Needs `models.stepper` to check its settings and
    logits (`engine.nonfinite_error`); see the report of issue 25 item 1."""
    every, results = scales
    for t, (cases, known) in every.items():
        for c in (c for c in cases if c['path'] == 'general'):
            r = results[c['id']]
            assert r['at'] != 'done', (c['id'], 'finished with finite' if r['finite'] else
                                       'returned non-finite logits')
            name = known[c['id']][0]
            assert name in r['msg'] and r['error'] in ('FormatError', 'NonFiniteError'), (c['id'],
                                                                                          r)
    for key, value in BAD_SETTINGS:
        cid = f'config {key} = {value} (general)'
        r = results[cid]
        assert r['at'] == 'step' and r['error'] == 'ConfigError' and key in r['msg'], (cid, r)


def test_gains_settings_overflow_and_a_failing_worker(tmp_path):
    """Norm gains NaN or ±inf (in the file: refused at load by name; in memory: the fused engine
    names the gain, `generate` raises a typed error), settings out of range (in the file: refused
    by key; in a config changed by hand: `ConfigError` naming the setting, from
    `engine.check_settings`; through `generate`, that or a `NonFiniteError` of the prefill),
    products that overflow float32 from finite weights (a norm gain of 1e30: the attention scores
    overflow; the fused engine says so, the general path and `generate` must not hang), and a
    worker that raises inside the engine's region (its workspace lacks matrices): `RuntimeError`
    from `decode_step`, no hang, and the next step runs as before."""
    t, cases, want = 'Q8_0', [], {}
    clean = tiny_llama(tmp_path / 'clean.gguf', t)
    gains = ['blk.0.attn_norm.weight', 'blk.1.ffn_norm.weight', 'output_norm.weight']
    for name, value in itertools.product(gains, (math.nan, math.inf, -math.inf)):
        f = tiny_llama(tmp_path / f'gain-{name}-{value}.gguf', t, poke=(name, 7, value))
        cases.append({'id': f'file {name} = {value}', 'file': str(f), 'path': 'fused',
                      'tokens': TOKENS})
        want[cases[-1]['id']] = ('load', name)
        for path in ('fused', 'exact'):
            cases.append({'id': f'memory {name} = {value} ({path})', 'file': str(clean),
                          'path': path, 'tokens': TOKENS,
                          'mutate': {'kind': 'gain', 'tensor': name, 'index': 7, 'value': value}})
            want[cases[-1]['id']] = ('NonFiniteError', name)
        cases.append({**cases[-1], 'id': f'memory {name} = {value} (generate)', 'path': 'generate'})
        want[cases[-1]['id']] = ('typed', None)
    bad_settings = {'rope.freq_base': [math.nan, 0.0, -1.0, math.inf],
                    'attention.layer_norm_rms_epsilon': [math.nan, -1.0, 0.0, math.inf]}
    config_key = {'rope.freq_base': 'rope_base', 'attention.layer_norm_rms_epsilon': 'norm_eps'}
    for key, values in bad_settings.items():
        for value in values:
            f = tiny_llama(tmp_path / f'meta-{key}-{value}.gguf', t, meta=[(key, value)])
            cases.append({'id': f'file {key} = {value}', 'file': str(f), 'path': 'fused',
                          'tokens': TOKENS})
            want[cases[-1]['id']] = ('load', key)
            for path in ('fused', 'exact'):
                cases.append({'id': f'config {config_key[key]} = {value} ({path})',
                              'file': str(clean), 'path': path, 'tokens': TOKENS,
                              'mutate': {'kind': 'config', 'key': config_key[key],
                                         'value': value}})
                want[cases[-1]['id']] = ('ConfigError', config_key[key])
            cases.append({**cases[-1], 'id': f'config {config_key[key]} = {value} (generate)',
                          'path': 'generate'})
            want[cases[-1]['id']] = ('typed', None)
    big = tiny_llama(tmp_path / 'big.gguf', t, poke=('blk.0.attn_norm.weight', 7, 1e30))
    for path in ('fused', 'exact', 'generate', 'general'):
        cases.append({'id': f'overflow ({path})', 'file': str(big), 'path': path,
                      'tokens': TOKENS})
        want[cases[-1]['id']] = ('overflow', None)
    cases.append({'id': 'a worker raises', 'file': str(clean), 'path': 'fused', 'tokens': TOKENS,
                  'workers': True})
    results = run_cases(tmp_path, cases)
    for cid, (kind, name) in want.items():
        r = results[cid]
        if kind == 'load':
            assert r['at'] == 'load' and r['error'] == 'FormatError' and name in r['msg'], (cid, r)
        elif kind == 'overflow':
            if 'general' in cid or 'generate' in cid:                          # it returned
                assert r['at'] == 'done' or r['typed'], (cid, r)
            else:
                assert r['at'] == 'step' and r['error'] == 'NonFiniteError', (cid, r)
                assert 'overflowed float32' in r['msg'], (cid, r['msg'])
        elif kind == 'typed':                             # generate: either error, typed
            assert r['at'] in ('load', 'step') and r['typed'], (cid, r)
            assert r['error'] in ('NonFiniteError', 'ConfigError', 'FormatError'), (cid, r)
        else:
            assert r['at'] == 'step' and r['error'] == kind and name in r['msg'], (cid, r)
    r = results['a worker raises']
    assert r['first'] is not None and 'raised inside its parallel region' in r['first'], r
    assert r['length'] == 1 and r['again'] < 1, r      # int8 activations: within rounding


SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')
CLI = "import sys; from gradus.jobs.cli import main; sys.exit(main(sys.argv[1:]))"


@needs_smollm2
def test_smollm2_nan_query_scale_is_one_error_line(tmp_path):
    """The issue's reproduction: the real SmolLM2 file with a NaN float16 scale in the first block
    of `blk.0.attn_q.weight` made `gradus generate --gguf FILE hi` hang. Now: exit status 1 and one
    line naming the tensor, in a child process with a timeout."""
    bad = tmp_path / 'smollm2-nan.gguf'
    shutil.copyfile(SMOLLM2, bad)
    info = gguf.open_gguf(bad).tensors['blk.0.attn_q.weight']
    with open(bad, 'r+b') as f:                                  # two bytes: the block's scale
        f.seek(info.offset)
        f.write(_f16(math.nan).tobytes())
    try:
        p = subprocess.run([sys.executable, '-c', CLI, 'generate', '--gguf', str(bad), 'hi',
                            '--max-new-tokens', '4'], capture_output=True, text=True, timeout=LIMIT)
    except subprocess.TimeoutExpired:
        pytest.fail("gradus generate hung on a NaN scale in blk.0.attn_q.weight")
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1, (p.returncode, p.stderr[-2000:])
    assert 'blk.0.attn_q.weight' in err[0] and 'Traceback' not in p.stderr, err
    assert 'NonFiniteError' in err[0] or 'FormatError' in err[0], err
