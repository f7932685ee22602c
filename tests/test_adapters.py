"""Adapter files (nbs/lm/33_adapters) and the GGUF writer under them (nbs/formats/19_gguf),
checked by the readers people use: `write_gguf`'s files read by gradus's `open_gguf` and the `gguf`
package's `GGUFReader` (every key, type and tensor) and byte-identical to `gguf.GGUFWriter`'s; the
llama.cpp adapter GGUF read by the `gguf` package and held to llama.cpp's shape rule against the
base file; round trips gradus -> file -> gradus exact on tiny Llama and Gemma 3 models; the query
and key row order against transformers' own `_reverse_permute_weights`; and, where PyTorch,
transformers and PEFT import, SmolLM2 loaded by transformers from its GGUF with gradus's PEFT
folder on top: its logits agree with gradus's adapted forward about as well as the two base
models agree, while the adapter moves them by much more (and the adapter without the row
reordering does not agree)."""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _models import find
from test_qlinear import IDS, tiny_gguf
from gradus.errors import ConfigError, DTypeError, FormatError, NonFiniteError, ShapeError
from gradus.formats import gguf
from gradus.formats.gguf import GGUFValueType, open_gguf, write_gguf
from gradus.formats.quants import GGMLType
from gradus.learn import random
from gradus.lm import adapters as A
from gradus.lm import lora, models
from gradus.lm.lora import LoraConfig

gguf_py = pytest.importorskip('gguf', reason="the `gguf` package (dev extra) is the independent "
                              "reader of these files")
SMOLLM2, needs_smollm2 = find(gguf.smollm2_path, 'SmolLM2')


def randomized(adapters, seed, std=0.05):
    "`adapters` with every `B` drawn from N(0, std²) (a trained adapter's B is not zero)."
    rng = np.random.default_rng(seed)
    return {'layers': [{k: {'a': ab['a'], 'b': rng.normal(0, std, ab['b'].shape).astype(
        np.float32)} for k, ab in la.items()} for la in adapters['layers']]}


def same(x, y):
    "The two adapter trees hold the same matrices, bit for bit."
    return len(x['layers']) == len(y['layers']) and all(
        la.keys() == lb.keys() and all(np.array_equal(la[k][n], lb[k][n]) and
                                       lb[k][n].dtype == np.float32 for k in la for n in 'ab')
        for la, lb in zip(x['layers'], y['layers']))


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    "{arch: (params, config)} of two-block tiny models (every block type)."
    d = tmp_path_factory.mktemp('adapters')
    return {a: models.from_gguf(tiny_gguf(d / f'{a}.gguf', a)) for a in ('llama', 'gemma3')}


def made(params, cfg, seed=0):
    return randomized(lora.init(random.key(seed), params, cfg), seed + 1)


# ------------------------------------------------------------------ the GGUF writer
META = {'general.architecture': 'llama', 'general.name': 'tiny é', 'llama.block_count': 2,
        'llama.rope.freq_base': 10000.0, 'x.flag': False, 'x.neg': -7, 'x.big': 1 << 40,
        'x.u8': (GGUFValueType.UINT8, 255), 'x.i8': (GGUFValueType.INT8, -128),
        'x.u16': (GGUFValueType.UINT16, 65535), 'x.i16': (GGUFValueType.INT16, -32768),
        'x.i32': (GGUFValueType.INT32, -5), 'x.u64': (GGUFValueType.UINT64, (1 << 64) - 1),
        'x.f64': np.float64(0.1), 'x.f32': np.float32(-2.5), 'x.np_u16': np.uint16(9),
        'tokens': ['<s>', 'é', ''], 'scores': np.array([0, -1.5, 2], np.float32),
        'ids': [3, 1, 4], 'mixed_ints': [1, -2], 'bools': [True, False], 'floats': [0.5, 2.0],
        'empty': (GGUFValueType.STRING, []), 'i64s': np.array([-1, 1 << 50], np.int64),
        'general.alignment': 64}
TENSORS = {'w': np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
           'n': np.ones(5, np.float16), 'c': np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 8,
           'd4': np.arange(32, dtype=np.float32).reshape(2, 2, 2, 4)}


def their_type(f, ours):
    "gguf-py's type name of field `f` (an empty array's element type it does not record)."
    if [t.name for t in f.types] == ['ARRAY'] and not f.data: return ours  # checked by gradus
    return f.types[0].name if len(f.types) == 1 else f'ARRAY[{f.types[-1].name}]'


def test_write_gguf_read_by_gradus_and_gguf(tmp_path):
    p = tmp_path / 'w.gguf'
    write_gguf(p, META, TENSORS, types={'c': 'F16'})
    ours, theirs = open_gguf(p), gguf_py.GGUFReader(p)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith('GGUF.')}
    assert list(fields) == list(ours.metadata) == list(META)
    want_types = {'llama.block_count': 'UINT32', 'x.neg': 'INT64', 'x.big': 'INT64',
                  'llama.rope.freq_base': 'FLOAT32', 'x.flag': 'BOOL', 'x.u64': 'UINT64',
                  'x.f64': 'FLOAT64', 'x.f32': 'FLOAT32', 'x.np_u16': 'UINT16',
                  'tokens': 'ARRAY[STRING]', 'ids': 'ARRAY[UINT32]', 'mixed_ints': 'ARRAY[INT64]',
                  'floats': 'ARRAY[FLOAT32]', 'empty': 'ARRAY[STRING]', 'i64s': 'ARRAY[INT64]'}
    for k in META:
        assert their_type(fields[k], ours.kv_types[k]) == ours.kv_types[k], k
        assert want_types.get(k, ours.kv_types[k]) == ours.kv_types[k], k
        want = META[k][1] if isinstance(META[k], tuple) else META[k]
        got = fields[k].contents()
        assert np.array_equal(np.asarray(got), np.asarray(ours.metadata[k])), k
        assert np.array_equal(np.asarray(got), np.asarray(want)), k
    assert ours.alignment == 64
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.shape == TENSORS[t.name].shape == tuple(int(d) for d in reversed(t.shape))
        assert info.type.name == t.tensor_type.name == ('F16' if t.name in 'cn' else 'F32')
        assert (info.offset - ours.data_offset) % 64 == 0
        want = TENSORS[t.name].astype(np.float16 if t.name in 'cn' else np.float32)
        assert np.array_equal(t.data, want) and np.array_equal(ours.dequantize(t.name), want)


def test_write_gguf_bytes_are_gguf_writers(tmp_path):
    w = gguf_py.GGUFWriter(tmp_path / 'a.gguf', 'llama')
    w.add_string('general.name', 'x'); w.add_uint32('llama.block_count', 3)
    w.add_int64('x.i', -3); w.add_float32('x.f', 0.25); w.add_bool('x.b', True)
    w.add_array('x.tokens', ['a', 'bb']); w.add_array('x.ids', [5, 6])
    for k in ('w', 'n', 'c'): w.add_tensor(k, TENSORS[k])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    write_gguf(tmp_path / 'b.gguf', {'general.architecture': 'llama', 'general.name': 'x',
                                     'llama.block_count': 3, 'x.i': -3, 'x.f': 0.25, 'x.b': True,
                                     'x.tokens': ['a', 'bb'],
                                     'x.ids': (GGUFValueType.INT32, [5, 6])},   # gguf-py's int
               {k: TENSORS[k] for k in ('w', 'n', 'c')})
    assert (tmp_path / 'a.gguf').read_bytes() == (tmp_path / 'b.gguf').read_bytes()


@pytest.mark.parametrize('meta, tensors, types, err, words', [
    ({'x.d': {'a': 1}}, {}, None, FormatError, "key 'x.d': a dict"),
    ({'x.m': [1, 'a']}, {}, None, FormatError, "key 'x.m': a list value must hold scalars of one"),
    ({'x.n': [[1], [2]]}, {}, None, FormatError, "key 'x.n'"),
    ({'x.e': []}, {}, None, FormatError, "key 'x.e': an empty list"),
    ({'x.u': (GGUFValueType.UINT8, 256)}, {}, None, FormatError, r"256 is outside UINT8"),
    ({'x.u': (GGUFValueType.UINT32, -1)}, {}, None, FormatError, r"-1 is outside UINT32"),
    ({'x.u': (GGUFValueType.UINT32, 1.5)}, {}, None, FormatError, "1.5 is not a UINT32"),
    ({'x.s': (GGUFValueType.STRING, 3)}, {}, None, FormatError, "key 'x.s': expected a str"),
    ({'x.a': (GGUFValueType.ARRAY, [1])}, {}, None, FormatError, "give the element type"),
    ({'x.h': 1 << 70}, {}, None, FormatError, "does not fit in INT64"),
    ({'x.f': 1e39}, {}, None, FormatError, "1e\\+39 overflows FLOAT32"),
    ({'x.c': np.complex64(1)}, {}, None, FormatError, "numpy complex64 has no GGUF"),
    ({'x.2d': np.zeros((2, 2), np.float32)}, {}, None, FormatError, "must be 1-D"),
    ({3: 'a'}, {}, None, FormatError, "metadata key 3"),
    ({'general.alignment': 48}, {}, None, FormatError, "general.alignment 48"),
    ({'general.alignment': 'x'}, {}, None, FormatError, "general.alignment 'x'"),
    ({}, {'w': np.zeros((2, 2))}, None, DTypeError, "tensor 'w': dtype float64"),
    ({}, {'w': np.zeros((2, 2), np.int32)}, None, DTypeError, "tensor 'w': dtype int32"),
    ({}, {'s': np.array(1, np.float32)}, None, ShapeError, r"tensor 's': shape \(\)"),
    ({}, {'e': np.zeros((0, 3), np.float32)}, None, ShapeError, "tensor 'e'"),
    ({}, {'5d': np.zeros((1,) * 5, np.float32)}, None, ShapeError, "tensor '5d'"),
    ({}, {'x' * 64: np.zeros(2, np.float32)}, None, FormatError, "63 UTF-8 bytes"),
    ({}, {'l': [1.0]}, None, FormatError, "tensor 'l': expected a numpy array"),
    ({}, {'h': np.array([7e4], np.float32)}, {'h': 'F16'}, FormatError, "tensor 'h': finite"),
    ({}, {'q': np.zeros(32, np.float32)}, {'q': 'Q8_0'}, FormatError, "writes F32 or F16"),
    ({}, {}, {'ghost': 'F16'}, FormatError, "absent tensors"),
])
def test_write_gguf_refuses_by_name(tmp_path, meta, tensors, types, err, words):
    p = tmp_path / 'x.gguf'
    p.write_bytes(b'old')
    with pytest.raises(err, match=words):
        write_gguf(p, meta, tensors, types)
    assert p.read_bytes() == b'old' and sorted(tmp_path.iterdir()) == [p]


def test_write_gguf_f16_from_float32_and_alignment_pair(tmp_path):
    p = tmp_path / 'h.gguf'
    x = np.array([1 / 3, -65504, np.inf, np.nan], np.float32)
    write_gguf(p, {'general.alignment': (GGUFValueType.UINT32, 128)}, {'x': x, 'y': x[:2]},
               types={'x': GGMLType.F16})
    g = open_gguf(p)
    assert g.alignment == 128 and g.tensors['x'].type.name == 'F16'
    assert np.array_equal(g.dequantize('x'), x.astype(np.float16).astype(np.float32),
                          equal_nan=True)
    assert all((t.offset - g.data_offset) % 128 == 0 for t in g.tensors.values())


# ------------------------------------------------------------------ the adapter GGUF
@pytest.mark.parametrize('arch', ['llama', 'gemma3'])
def test_gguf_adapter_round_trip_and_llama_cpp_shapes(tiny, tmp_path, arch):
    params, config = tiny[arch]
    cfg = LoraConfig(rank=3, alpha=5.0, targets=('q', 'k', 'o', 'down'))
    ad = made(params, cfg)
    p = tmp_path / 'a.gguf'
    A.save_gguf_adapter(p, ad, cfg, config)
    back, bcfg = A.load_adapter(p, params, config)
    assert same(ad, back) and bcfg == cfg
    r = gguf_py.GGUFReader(p)
    meta = {k: (f.contents(), f.types[0].name) for k, f in r.fields.items()
            if not k.startswith('GGUF.')}
    assert meta == {'general.architecture': (arch, 'STRING'), 'general.type': ('adapter', 'STRING'),
                    'adapter.type': ('lora', 'STRING'), 'adapter.lora.alpha': (5.0, 'FLOAT32')}
    base_file = gguf_py.GGUFReader(config_path(tiny, arch, tmp_path))
    base = {t.name: [int(d) for d in t.shape] for t in base_file.tensors}
    ts = {t.name: t for t in r.tensors}
    names = {f'blk.{i}.{A.GGUF_NAMES[k]}.weight' for i in range(2) for k in ('wq', 'wk', 'wo',
                                                                            'w_down')}
    assert set(ts) == {n + s for n in names for s in ('.lora_a', '.lora_b')}
    for n in names:   # llama-adapter.cpp: a.ne[0] = W.ne[0], b.ne[1] = W.ne[1], a.ne[1] = b.ne[0]
        a, b = [int(d) for d in ts[n + '.lora_a'].shape], [int(d) for d in ts[n + '.lora_b'].shape]
        assert a[0] == base[n][0] and b[1] == base[n][1] and a[1] == b[0] == 3
        assert ts[n + '.lora_a'].tensor_type.name == 'F32'
    ids = IDS[:5]
    assert np.array_equal(models.forward(lora.attach(params, ad, cfg), ids, config),
                          models.forward(lora.attach(params, back, bcfg), ids, config))


def config_path(tiny, arch, tmp_path):
    "The tiny base model's GGUF again (the fixture's files are module-scoped)."
    return tiny_gguf(tmp_path / f'base-{arch}.gguf', arch)


def test_gguf_adapter_alpha_as_llama_cpp(tiny, tmp_path):
    params, config = tiny['llama']
    cfg = LoraConfig(rank=2, alpha=6.0, targets=('v',))
    A.save_gguf_adapter(tmp_path / 'a.gguf', made(params, cfg), cfg, config)
    g = open_gguf(tmp_path / 'a.gguf')
    tensors = {n: g.dequantize(n) for n in g.tensors}
    plain = {k: v for k, v in g.metadata.items() if k != 'adapter.lora.alpha'}
    for alpha, scale in ((None, 1.0), (0.0, 1.0), (6.0, 3.0), (1.0, 0.5)):
        meta = dict(plain) if alpha is None else {
            **plain, 'adapter.lora.alpha': (GGUFValueType.FLOAT32, alpha)}
        write_gguf(tmp_path / 'b.gguf', meta, tensors)
        _, c = A.load_adapter(tmp_path / 'b.gguf', params, config)
        assert c.rank == 2 and c.scale == scale, (alpha, c)
    for bad, words in (((GGUFValueType.INT32, 4), "adapter.lora.alpha is a INT32"),
                       ((GGUFValueType.FLOAT32, -1.0), "alpha -1.0 is not a finite"),
                       ((GGUFValueType.FLOAT32, float('nan')), "alpha nan")):
        write_gguf(tmp_path / 'b.gguf', {**plain, 'adapter.lora.alpha': bad}, tensors)
        with pytest.raises(FormatError, match=words):
            A.load_adapter(tmp_path / 'b.gguf', params, config)


def test_gguf_adapter_in_float16(tiny, tmp_path):
    "llama.cpp's converter may write F16 pairs (`--outtype f16`): read back as float32."
    params, config = tiny['llama']
    cfg = LoraConfig(rank=2, alpha=4.0, targets=('q', 'down'))
    ad = made(params, cfg)
    A.save_gguf_adapter(tmp_path / 'a.gguf', ad, cfg, config)
    g = open_gguf(tmp_path / 'a.gguf')
    write_gguf(tmp_path / 'h.gguf', g.metadata, {n: g.dequantize(n) for n in g.tensors},
               types={n: 'F16' for n in g.tensors})
    back, c = A.load_adapter(tmp_path / 'h.gguf', params, config)
    assert c == cfg and all(
        np.array_equal(back['layers'][i][k][n], la[k][n].astype(np.float16).astype(np.float32))
        and back['layers'][i][k][n].dtype == np.float32
        for i, la in enumerate(ad['layers']) for k in la for n in 'ab')


def test_gguf_adapter_refusals(tiny, tmp_path):
    params, config = tiny['llama']
    cfg = LoraConfig(rank=2, alpha=4.0, targets=('q', 'up'))
    ad = made(params, cfg)
    A.save_gguf_adapter(tmp_path / 'ok.gguf', ad, cfg, config)
    g = open_gguf(tmp_path / 'ok.gguf')
    meta, ts = dict(g.metadata), {n: g.dequantize(n) for n in g.tensors}
    q0 = 'blk.0.attn_q.weight'

    def refused(err, words, meta=meta, ts=ts):
        write_gguf(tmp_path / 'x.gguf', meta, ts)
        with pytest.raises(err, match=words):
            A.load_adapter(tmp_path / 'x.gguf', params, config)

    refused(FormatError, "architecture 'gemma3'; the model is 'llama'",
            meta={**meta, 'general.architecture': 'gemma3'})
    refused(FormatError, "general.type is 'model', not 'adapter'",
            meta={**meta, 'general.type': 'model'})
    refused(FormatError, "adapter.type is 'cvec'", meta={**meta, 'adapter.type': 'cvec'})
    refused(FormatError, "unknown tensor 'blk.0.attn_norm.weight.lora_a'",
            ts={**ts, 'blk.0.attn_norm.weight.lora_a': np.zeros(2, np.float32)})
    refused(FormatError, "unknown tensor 'token_embd.weight.lora_a'",
            ts={**ts, 'token_embd.weight.lora_a': np.zeros((2, 256), np.float32)})
    refused(FormatError, "layers.0.wq has no lora_b",
            ts={k: v for k, v in ts.items() if k != q0 + '.lora_b'})
    refused(FormatError, "an adapter for layer 7; the model has 2",
            ts={**ts, 'blk.7.attn_q.weight.lora_a': ts[q0 + '.lora_a'],
                'blk.7.attn_q.weight.lora_b': ts[q0 + '.lora_b']})
    refused(ShapeError, r"layers.0.wq is 256 x 256, but its adapter has a \(2, 128\)",
            ts={**ts, q0 + '.lora_a': np.zeros((2, 128), np.float32)})
    refused(ShapeError, "layers.0.wq", ts={**ts, q0 + '.lora_a': np.zeros((3, 256), np.float32)})
    refused(FormatError, "layers.1.wq has rank 3, others 2",
            ts={**ts, 'blk.1.attn_q.weight.lora_a': np.zeros((3, 256), np.float32),
                'blk.1.attn_q.weight.lora_b': np.zeros((256, 3), np.float32)})
    refused(FormatError, r"layer 1 adapts \['w_up'\], others \['w_up', 'wq'\]",
            ts={k: v for k, v in ts.items() if not k.startswith('blk.1.attn_q')})
    refused(NonFiniteError, "layers.0.wq holds a NaN",
            ts={**ts, q0 + '.lora_a': np.full((2, 256), np.nan, np.float32)})
    refused(FormatError, "holds no LoRA tensors", ts={})
    with pytest.raises(FormatError, match="not a LoRA adapter"):
        A.load_adapter(config_path(tiny, 'llama', tmp_path), params, config)


def test_save_refuses_adapters_of_another_shape(tiny, tmp_path):
    params, config = tiny['llama']
    cfg = LoraConfig(rank=2, targets=('q',))
    ad = made(params, cfg)
    wrong = {'layers': [dict(la) for la in ad['layers']]}
    w1 = ad['layers'][1]['wq']
    wrong['layers'][1] = {'wq': {'a': w1['a'].T, 'b': w1['b']}}
    for save in (A.save_gguf_adapter, A.save_peft):
        with pytest.raises(ShapeError, match=r"layers.1.wq is 256 x 256: at rank 2"):
            save(tmp_path / 'x', wrong, cfg, config)
        with pytest.raises(ShapeError, match="for 2 layers"):
            save(tmp_path / 'x', {'layers': ad['layers'][:1]}, cfg, config)
        with pytest.raises(ShapeError, match=r"layer 0 has adapters for \['wq'\], but the targets"):
            save(tmp_path / 'x', ad, cfg._replace(targets=('q', 'v')), config)
        nan = {'layers': [{'wq': {'a': la['wq']['a'], 'b': la['wq']['b'] * np.nan}}
                          for la in ad['layers']]}
        with pytest.raises(NonFiniteError, match="layers.0.wq"):
            save(tmp_path / 'x', nan, cfg, config)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ the PEFT folder
def test_hf_rows_is_transformers_reverse_permutation():
    mod = pytest.importorskip('transformers.modeling_gguf_pytorch_utils',
                              reason="transformers is not installed (its GGUF loader is the "
                              "reference for the row order)")
    proc = mod.LlamaTensorProcessor(config={})
    rng = np.random.default_rng(0)
    for heads, kv, hd in ((9, 3, 64), (4, 2, 8), (1, 1, 2)):
        w = rng.normal(size=(heads * hd, 5))
        assert np.array_equal(proc._reverse_permute_weights(w, heads, heads),
                              w[A.hf_rows(heads, hd)])
        wk = rng.normal(size=(kv * hd, 5))
        assert np.array_equal(proc._reverse_permute_weights(wk, heads, kv), wk[A.hf_rows(kv, hd)])
    with pytest.raises(ShapeError, match="head_dim 3 is odd"):
        A.hf_rows(2, 3)


@pytest.mark.parametrize('arch', ['llama', 'gemma3'])
def test_peft_round_trip_and_names(tiny, tmp_path, arch):
    params, config = tiny[arch]
    cfg = LoraConfig(rank=4, alpha=8.0, targets=('q', 'k', 'v', 'gate'), dropout=0.1)
    ad = made(params, cfg)
    A.save_peft(tmp_path / 'p', ad, cfg, config, base_model='some/model')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['p']
    assert sorted(p.name for p in (tmp_path / 'p').iterdir()) == [
        'adapter_config.json', 'adapter_model.safetensors']
    c = json.loads((tmp_path / 'p' / 'adapter_config.json').read_text())
    assert (c['peft_type'], c['task_type'], c['r'], c['lora_alpha'], c['lora_dropout'],
            c['base_model_name_or_path']) == ('LORA', 'CAUSAL_LM', 4, 8.0, 0.1, 'some/model')
    assert c['target_modules'] == ['gate_proj', 'k_proj', 'q_proj', 'v_proj']
    st = pytest.importorskip('safetensors.numpy').load_file(tmp_path / 'p' /
                                                             'adapter_model.safetensors')
    pre = 'base_model.model.model.layers.'
    mods = ['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'mlp.gate_proj']
    assert set(st) == {f'{pre}{i}.{m}.lora_{h}.weight' for i in range(2) for m in mods
                       for h in 'AB'}
    hd = config.head_dim
    for i, la in enumerate(ad['layers']):
        for k, m in zip(('wq', 'wk', 'wv', 'w_gate'), mods):
            perm = {'wq': A.hf_rows(config.n_heads, hd), 'wk': A.hf_rows(config.n_kv_heads, hd)
                    }.get(k) if arch == 'llama' else None
            b = la[k]['b'] if perm is None else la[k]['b'][perm]
            assert np.array_equal(st[f'{pre}{i}.{m}.lora_A.weight'], la[k]['a'])
            assert np.array_equal(st[f'{pre}{i}.{m}.lora_B.weight'], b)
    assert arch == 'gemma3' or not np.array_equal(st[f'{pre}0.self_attn.q_proj.lora_B.weight'],
                                                  ad['layers'][0]['wq']['b'])
    back, bcfg = A.load_adapter(tmp_path / 'p', params, config)
    assert same(ad, back) and bcfg == cfg
    A.save_peft(tmp_path / 'p', back, bcfg, config)          # an adapter folder is replaced
    assert same(ad, A.load_adapter(tmp_path / 'p', params, config)[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['p']


def test_peft_folder_refusals(tiny, tmp_path):
    params, config = tiny['llama']
    cfg = LoraConfig(rank=2, alpha=4.0, targets=('q', 'v'))
    A.save_peft(tmp_path / 'ok', made(params, cfg), cfg, config)
    (tmp_path / 'mine').mkdir(); (tmp_path / 'mine' / 'notes.txt').write_text('keep')
    with pytest.raises(ConfigError, match="holds other files"):
        A.save_peft(tmp_path / 'mine', made(params, cfg), cfg, config)
    assert (tmp_path / 'mine' / 'notes.txt').read_text() == 'keep'
    good = json.loads((tmp_path / 'ok' / 'adapter_config.json').read_text())
    for change, words in (({'peft_type': 'IA3'}, "peft_type is 'IA3'"),
                          ({'use_rslora': True}, "use_rslora = True"),
                          ({'use_dora': True}, "use_dora = True"),
                          ({'bias': 'all'}, "bias = 'all'"),
                          ({'fan_in_fan_out': True}, "fan_in_fan_out = True"),
                          ({'layers_to_transform': [0]}, "layers_to_transform = \\[0\\]"),
                          ({'rank_pattern': {'q_proj': 8}}, "rank_pattern"),
                          ({'modules_to_save': ['lm_head']}, "modules_to_save"),
                          ({'r': 0}, "r = 0 is not"), ({'r': 3}, "r = 3, but the tensors have "
                                                                 "rank 2"),
                          ({'lora_alpha': -1}, "lora_alpha = -1"),
                          ({'lora_dropout': 1.0}, "lora_dropout = 1.0")):
        d = tmp_path / 'bad'
        shutil.rmtree(d, ignore_errors=True); shutil.copytree(tmp_path / 'ok', d)
        (d / 'adapter_config.json').write_text(json.dumps({**good, **change}))
        with pytest.raises(FormatError, match=words):
            A.load_adapter(d, params, config)
    (d / 'adapter_config.json').write_text('{not json')
    with pytest.raises(FormatError, match="no readable adapter_config.json"):
        A.load_adapter(d, params, config)
    from gradus.formats.safetensors import load_safetensors, save_safetensors
    t = load_safetensors(tmp_path / 'ok' / 'adapter_model.safetensors')
    (d / 'adapter_config.json').write_text(json.dumps(good))
    save_safetensors(d / 'adapter_model.safetensors',
                     {**t, 'base_model.model.lm_head.lora_A.weight': np.zeros((2, 4), np.float32)})
    with pytest.raises(FormatError, match="unknown tensor 'base_model.model.lm_head.lora_A"):
        A.load_adapter(d, params, config)
    wide_params, wide_config = models.from_gguf(tiny_gguf(tmp_path / 'w.gguf', dim=512))
    with pytest.raises(ShapeError, match="layers.0.wq is 512 x 512, but its adapter has"):
        A.load_adapter(tmp_path / 'ok', wide_params, wide_config)


# ------------------------------------------------------------------ PEFT + transformers
@pytest.fixture(scope='module')
def hf_smollm2():
    "SmolLM2 loaded by transformers from gradus's GGUF file, float32 (a few seconds)."
    if SMOLLM2 is None: pytest.skip("SmolLM2 GGUF absent")
    torch = pytest.importorskip('torch', reason="PyTorch is not installed (the PEFT proof)")
    transformers = pytest.importorskip('transformers', reason="transformers is not installed")
    pytest.importorskip('peft', reason="PEFT is not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(SMOLLM2.parent), gguf_file=SMOLLM2.name, dtype=torch.float32)
    return model.eval()


@needs_smollm2
def test_peft_on_transformers_agrees_with_gradus(hf_smollm2, tmp_path):
    import peft
    import torch
    params, config = models.from_gguf(SMOLLM2)
    cfg = LoraConfig(rank=4, alpha=8.0)
    ad = made(params, cfg, seed=3)
    A.save_peft(tmp_path / 'peft', ad, cfg, config)
    wrong = tmp_path / 'unpermuted'                 # q and k rows left in GGUF order
    shutil.copytree(tmp_path / 'peft', wrong)
    from gradus.formats.safetensors import load_safetensors, save_safetensors
    t = load_safetensors(wrong / 'adapter_model.safetensors')
    for i, la in enumerate(ad['layers']):
        for k, m in (('wq', 'q_proj'), ('wk', 'k_proj')):
            t[f'{A.PEFT_PREFIX}{i}.self_attn.{m}.lora_B.weight'] = la[k]['b']
    save_safetensors(wrong / 'adapter_model.safetensors', t, {'format': 'pt'})

    ids = np.array([1, 9690, 198, 2683, 359, 253, 5356, 314])
    run = lambda m: m(torch.tensor(ids[None])).logits[0].double().numpy()
    with torch.no_grad():
        hf_base = run(hf_smollm2)
        pm = peft.PeftModel.from_pretrained(hf_smollm2, str(tmp_path / 'peft'))
        pm.eval(); hf_adapted = run(pm)
        pm.load_adapter(str(wrong), adapter_name='unpermuted'); pm.set_adapter('unpermuted')
        hf_wrong = run(pm)
        pm.unload()                                 # the module-scoped base stays clean
    base = models.forward(params, ids, config)
    adapted = models.forward(lora.attach(params, ad, cfg), ids, config)
    tol = 2e-4 * np.abs(base).max()        # observed: about 1e-4 of it on both
    d_base, d_adapted = np.abs(base - hf_base).max(), np.abs(adapted - hf_adapted).max()
    effect, d_wrong = np.abs(adapted - base).max(), np.abs(adapted - hf_wrong).max()
    print(f"max |gradus - transformers|: base {d_base:.2e}, adapted {d_adapted:.2e}; "
          f"tolerance {tol:.2e}; adapter effect {effect:.2f}; unpermuted q/k off by {d_wrong:.2f}")
    assert d_base < tol and d_adapted < tol
    assert effect > 30 * tol and d_wrong > 10 * tol
