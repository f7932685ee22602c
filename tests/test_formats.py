"File formats: safetensors against the `safetensors` package, GGUF admission against gguf-py, dequantization bit-for-bit."
import json, os, struct, subprocess, sys
from pathlib import Path
import numpy as np, ml_dtypes, pytest
import gguf, safetensors, safetensors.numpy
from gguf import GGMLQuantizationType as GQ
from gradus import gguf as G, quants as Q, safetensors as st
from gradus.autograd import tree_to_dict, tree_from_dict
from gradus.safetensors import FormatError
from gradus.quants import GGMLType, BLOCK
sys.path.insert(0, str(Path(__file__).parent))
import _gguf_build as B

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope='module')
def smollm2():
    try: return G.smollm2_path()
    except FileNotFoundError as e: pytest.skip(f"SmolLM2 GGUF absent (install the models extra): {e}")

# ---------- block tables and dequantization ----------
def test_block_sizes_match_gguf():
    for t, (bs, ts) in BLOCK.items():
        assert gguf.constants.GGML_QUANT_SIZES[GQ(int(t))] == (bs, ts), t.name

DEQ_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
             GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q6_K]
F16_FIELDS = {GGMLType.Q4_1: [0, 2], GGMLType.Q5_1: [0, 2], GGMLType.Q4_K: [0, 2], GGMLType.Q6_K: [208]}

def finite_blocks(t, n, seed):
    rng = np.random.default_rng(seed)
    plain = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: ml_dtypes.bfloat16}
    if t in plain: return (rng.standard_normal(n) * 10).astype(plain[t]).view(np.uint8).reshape(n, -1)
    b = rng.integers(0, 256, (n, BLOCK[t][1]), dtype=np.uint8)
    for o in F16_FIELDS.get(t, [0]):
        b[:, o:o + 2] = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3, n)).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b

@pytest.mark.parametrize('t', DEQ_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_dequantize_bit_identical_to_gguf(t, seed):
    b = finite_blocks(t, 777, seed)
    theirs = gguf.quants.dequantize(b, GQ(int(t))).reshape(-1).astype(np.float32).view(np.uint32)
    assert np.array_equal(Q.dequantize(b, t).view(np.uint32), theirs)
    assert np.array_equal(Q.dequantize_ref(b, t).view(np.uint32), theirs)

@pytest.mark.parametrize('t', list(Q.DEQUANT_KERNEL), ids=lambda t: t.name)
def test_kernel_equals_reference_on_arbitrary_bytes(t):
    b = np.random.default_rng(5).integers(0, 256, (4096, BLOCK[t][1]), dtype=np.uint8)
    with np.errstate(all='ignore'):
        k, r = Q.dequantize(b, t), Q.dequantize_ref(b, t)
    nan = np.isnan(r)
    assert np.array_equal(np.isnan(k), nan)
    assert np.array_equal(k[~nan].view(np.uint32), r[~nan].view(np.uint32))

def test_dequantize_rejects_partial_blocks_and_unknown_types():
    with pytest.raises(FormatError, match='whole number'): Q.dequantize(np.zeros(35, np.uint8), GGMLType.Q8_0)
    with pytest.raises(FormatError, match='no decoder'): Q.dequantize(np.zeros(84, np.uint8), GGMLType.Q2_K)
    with pytest.raises(FormatError, match='unknown'): Q.dequantize(np.zeros(8, np.uint8), 99)

@pytest.mark.parametrize('t', [GGMLType.Q8_0, GGMLType.Q4_0], ids=lambda t: t.name)
def test_quantize_equals_gguf(t):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2048, 32)) * rng.uniform(0, 5, (2048, 1))).astype(np.float32)
    x[0] = 0; x[1, 3] = -7.5; x[2] = 1e-30
    ours = Q.quantize(x, t)
    assert np.array_equal(ours, gguf.quants.quantize(x, GQ(int(t))))

@pytest.mark.parametrize('t', Q.MATVEC_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize('shape', [(1, 32), (7, 64), (300, 576)])
def test_qmatvec_matches_dequantize_then_matmul(t, shape):
    rng = np.random.default_rng(shape[0])
    n_out, n_in = shape
    blocks = finite_blocks(t, n_out * n_in // 32, 3).reshape(n_out, -1)
    x = rng.standard_normal(n_in).astype(np.float32)
    W = Q.dequantize_ref(blocks, t).reshape(n_out, n_in).astype(np.float64)
    y = Q.qmatvec(blocks, t, x)
    assert y.dtype == np.float32 and y.shape == (n_out,)
    assert np.all(np.abs(y - W @ x) <= 1e-5 * (np.abs(W) @ np.abs(x)) + 1e-30)

def test_qmatvec_errors():
    with pytest.raises(ValueError): Q.qmatvec(np.zeros((2, 34), np.uint8), GGMLType.Q8_0, np.zeros(64, np.float32))
    with pytest.raises(FormatError): Q.qmatvec(np.zeros((2, 210), np.uint8), GGMLType.Q6_K, np.zeros(256, np.float32))

# ---------- GGUF admission ----------
ALL_SPECS = [(f't_{t.name}', [2 * BLOCK[t][0] * (1 if BLOCK[t][0] > 1 else 16), 3], int(t), BLOCK[t][1], BLOCK[t][0]) for t in DEQ_TYPES]

@pytest.fixture
def every_type_file(tmp_path):
    rng = np.random.default_rng(11)
    tensors = B.random_tensors(rng, ALL_SPECS)
    kvs = [B.kv_str('general.architecture', 'toy'), B.kv_u32('toy.block_count', 2),
           B.kv_str_array('tokenizer.ggml.tokens', ['a', 'b', 'ĠTo']), B.kv_u32('general.alignment', 64)]
    blob, _ = B.build(kvs, tensors, alignment=64)
    p = tmp_path / 'every.gguf'; p.write_bytes(blob)
    return p

def test_gguf_every_type_against_gguf_reader(every_type_file):
    g = G.open_gguf(every_type_file)
    r = gguf.GGUFReader(every_type_file)
    assert g.alignment == r.alignment == 64 and g.data_offset == r.data_offset
    assert g.metadata['tokenizer.ggml.tokens'] == ['a', 'b', 'ĠTo'] and g.hyperparameters == {'block_count': 2}
    for rt in r.tensors:
        t = g.tensors[rt.name]
        assert t.shape == tuple(int(d) for d in reversed(rt.shape)) and int(t.type) == int(rt.tensor_type)
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes      # gguf-py offsets are absolute
        theirs = gguf.quants.dequantize(rt.data, rt.tensor_type).astype(np.float32).reshape(t.shape)
        assert np.array_equal(g.dequantize(rt.name).view(np.uint32), theirs.view(np.uint32)), rt.name

def test_gguf_chunked_reads_equal_whole(every_type_file):
    whole = G.open_gguf(every_type_file)
    small = G.open_gguf(every_type_file, max_read=4096)
    for name in whole.tensors:
        assert np.array_equal(whole.dequantize(name), small.dequantize(name), equal_nan=True)
    with pytest.raises(FormatError, match='max_read'):
        G.open_gguf(every_type_file, max_read=600)        # header itself over the cap

def test_gguf_unknown_cap_is_type_error(every_type_file):
    with pytest.raises(TypeError): G.open_gguf(every_type_file, max_widgets=3)

def _tiny(**kw):
    rng = np.random.default_rng(0)
    tensors = kw.pop('tensors', None) or B.random_tensors(rng, [('w', [64, 2], 8, 34, 32), ('n', [64], 0, 4, 1)])
    return B.build(kw.pop('kvs', [B.kv_str('general.architecture', 'toy')]), tensors, **kw)

@pytest.mark.parametrize('mutate,match', [
    (lambda b, i: b'GGML' + b[4:], "magic"),
    (lambda b, i: b[:4] + struct.pack('<I', 1) + b[8:], "version 1"),
    (lambda b, i: b[:4] + struct.pack('>I', 3) + b[8:], "version"),
    (lambda b, i: b[:8] + struct.pack('<Q', 1 << 60) + b[16:], "max_tensors"),
    (lambda b, i: b[:16] + struct.pack('<Q', 1 << 60) + b[24:], "max_kv"),
    (lambda b, i: b[:24] + struct.pack('<Q', 1 << 60) + b[32:], "max_string"),
    (lambda b, i: b[:24] + struct.pack('<Q', 5000) + b[32:], "truncated|UTF-8|value type|n_dims"),
    (lambda b, i: b[:len(b) - 7], "past the end"),
    (lambda b, i: b[:60], "truncated"),
])
def test_gguf_crafted_headers(tmp_path, mutate, match):
    blob, info_at = _tiny()
    p = tmp_path / 'bad.gguf'; p.write_bytes(mutate(blob, info_at))
    with pytest.raises(FormatError, match=match): G.open_gguf(p)

def test_gguf_tensor_info_checks(tmp_path):
    rng = np.random.default_rng(1)
    def refused(tensors, match, **kw):
        blob, _ = _tiny(tensors=tensors, **kw)
        p = tmp_path / 'x.gguf'; p.write_bytes(blob)
        with pytest.raises(FormatError, match=match): G.open_gguf(p)
    refused([('w', [48, 2], 8, b'\0' * 34 * 3)], 'multiple of the Q8_0 block size 32')
    refused([('w', [32], 99, b'\0' * 34)], 'unknown or unsupported GGML type 99')
    refused([('w', [1, 1, 1, 1, 1], 0, b'\0' * 4)], 'n_dims 5')
    refused([('w', [4], 0, b'\0' * 16), ('w', [4], 0, b'\0' * 16)], 'twice')
    refused([('w', [1 << 40], 0, b'\0' * 16)], 'past the end')
    # misaligned and overlapping offsets: patch the offset field of the second tensor info
    blob, info_at = _tiny(tensors=[('a', [8], 0, b'\0' * 32), ('b', [8], 0, b'\0' * 32)])
    off_b = blob.index(B.s('b')) + len(B.s('b')) + 4 + 8 + 4
    for val, match in [(4, 'not a multiple of the alignment'), (0, 'overlaps')]:
        p = tmp_path / 'o.gguf'; p.write_bytes(blob[:off_b] + struct.pack('<Q', val) + blob[off_b + 8:])
        with pytest.raises(FormatError, match=match): G.open_gguf(p)
    for kv, match in [(B.s('general.alignment') + struct.pack('<II', 4, 24), 'power of two'),
                      (B.s('k') + struct.pack('<I', 77), 'unknown value type 77'),
                      (B.s('k') + struct.pack('<IB', 7, 2), 'bool'),
                      (B.s('k') + struct.pack('<IIQ', 9, 8, 1 << 60), 'max_array'),
                      (B.s('k') + struct.pack('<IIQ', 9, 8, 1000), 'cannot fit')]:
        blob, _ = _tiny(kvs=[kv])
        p = tmp_path / 'k.gguf'; p.write_bytes(blob)
        with pytest.raises(FormatError, match=match): G.open_gguf(p)

def test_gguf_array_cap_is_separate(smollm2):
    with pytest.raises(FormatError, match="tokenizer.ggml.tokens.*max_array=1000"): G.open_gguf(smollm2, max_array=1000)
    G.open_gguf(smollm2, max_string=4096)         # the chat template and tokens fit

# ---------- SmolLM2 ----------
def test_smollm2_header_matches_gguf_reader(smollm2):
    g, r = G.open_gguf(smollm2), gguf.GGUFReader(smollm2)
    assert g.version == 3 and len(g.tensors) == 272 and g.architecture == 'llama'
    fields = {k: f for k, f in r.fields.items() if not k.startswith('GGUF.')}
    assert list(fields) == list(g.metadata)
    for k, f in fields.items():
        theirs, ours = f.contents(), g.metadata[k]
        if isinstance(ours, np.ndarray): ours = ours.tolist()
        assert ours == theirs, k
        assert g.kv_types[k].replace('ARRAY[', '').rstrip(']') == f.types[-1].name, k
    assert g.data_offset == r.data_offset
    for rt in r.tensors:
        t = g.tensors[rt.name]
        assert (t.shape, t.type.name, t.offset, t.nbytes) == (tuple(int(d) for d in reversed(rt.shape)),
                                                              rt.tensor_type.name, rt.data_offset, rt.n_bytes)
    assert g.tensors['token_embd.weight'].shape == (49152, 576)

def test_smollm2_every_tensor_bit_identical(smollm2):
    g, r = G.open_gguf(smollm2), gguf.GGUFReader(smollm2)
    for rt in r.tensors:
        ours = g.dequantize(rt.name)
        theirs = gguf.quants.dequantize(rt.data, rt.tensor_type).astype(np.float32).reshape(ours.shape)
        assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), rt.name
    assert g.dequantize('token_embd.weight').shape == (49152, 576)

def test_smollm2_matvec(smollm2):
    g = G.open_gguf(smollm2)
    x = np.random.default_rng(0).standard_normal(576).astype(np.float32)
    for name in ('token_embd.weight', 'blk.3.ffn_gate.weight'):
        W = g.dequantize(name).astype(np.float64)
        y = g.matvec(name, x)
        assert np.all(np.abs(y - W @ x) <= 1e-5 * (np.abs(W) @ np.abs(x)))

# ---------- safetensors ----------
def tree():
    rng = np.random.default_rng(0)
    return {'emb': rng.standard_normal((5, 3)).astype(np.float32),
            'blocks': [{'attn': {'wq': rng.standard_normal((3, 3)).astype(np.float16)},
                        'g': rng.standard_normal(3).astype(ml_dtypes.bfloat16)} for _ in range(3)],
            'f64': np.arange(4, dtype=np.float64), 'i32': np.arange(6, dtype=np.int32).reshape(2, 3),
            'i64': np.array(9, np.int64), 'u8': np.arange(3, dtype=np.uint8), 'mask': np.array([True, False]),
            'empty': np.zeros((0, 4), np.float32)}

def test_safetensors_roundtrip_and_package_reads_ours(tmp_path):
    p = tmp_path / 'c.safetensors'
    st.save_safetensors(p, tree_to_dict(tree()), metadata={'step': '10', 'note': 'é'})
    back, meta = st.load_safetensors(p, with_metadata=True)
    assert meta == {'step': '10', 'note': 'é'}
    flat_in, flat_out = tree_to_dict(tree()), back
    assert flat_in.keys() == flat_out.keys() and isinstance(tree_from_dict(back)['blocks'], list)
    for k in flat_in:
        assert flat_out[k].dtype == flat_in[k].dtype and flat_out[k].shape == flat_in[k].shape
        assert flat_out[k].tobytes() == flat_in[k].tobytes(), k
    theirs = dict(safetensors.deserialize(p.read_bytes()))
    for k, v in flat_in.items():
        assert bytes(theirs[k]['data']) == v.tobytes() and list(theirs[k]['shape']) == list(v.shape), k
    with safetensors.safe_open(p, 'np') as f:
        assert f.metadata() == meta and np.array_equal(f.get_tensor('blocks.2.attn.wq'), flat_in['blocks.2.attn.wq'])

def test_safetensors_reads_package_files(tmp_path):
    rng = np.random.default_rng(1)
    d = {'model.layers.0.self_attn.q_proj.weight': rng.standard_normal((4, 4)).astype(np.float16),
         'model.embed_tokens.weight': rng.standard_normal((10, 4)).astype(np.float32), 'pos': np.arange(5, dtype=np.int64)}
    safetensors.numpy.save_file(d, tmp_path / 'hf.safetensors', metadata={'format': 'pt'})
    flat, meta = st.load_safetensors(tmp_path / 'hf.safetensors', with_metadata=True)
    assert meta == {'format': 'pt'} and all(np.array_equal(flat[k], v) for k, v in d.items())
    nested = tree_from_dict(st.load_safetensors(tmp_path / 'hf.safetensors'))
    assert np.array_equal(nested['model']['layers'][0]['self_attn']['q_proj']['weight'], d['model.layers.0.self_attn.q_proj.weight'])

def forge(tmp_path, header, data=b'', raw=None):
    h = raw if raw is not None else json.dumps(header).encode()
    p = tmp_path / 'f.safetensors'; p.write_bytes(struct.pack('<Q', len(h)) + h + data); return p

@pytest.mark.parametrize('header,match', [
    ({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 12]}}, "'w'.*12 bytes"),
    ({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}, 'v': {'dtype': 'U8', 'shape': [4], 'data_offsets': [4, 8]}}, "'v'.*overlap"),
    ({'w': {'dtype': 'X', 'shape': [2], 'data_offsets': [0, 8]}}, "'w'.*dtype"),
    ({'w': {'dtype': 'F32', 'shape': [-2], 'data_offsets': [0, 8]}}, "'w'.*shape"),
    ({'w': {'dtype': 'F32', 'shape': [4], 'data_offsets': [0, 16]}}, "'w'.*outside"),
    ({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [8, 0]}}, "'w'.*outside"),
    ({'w': [1, 2]}, "'w'.*not an object"),
    ({'__metadata__': {'a': 1}}, "__metadata__"),
    ([1, 2], "not an object"),
])
def test_safetensors_bad_headers(tmp_path, header, match):
    with pytest.raises(FormatError, match=match): st.load_safetensors(forge(tmp_path, header, bytes(12)))

def test_safetensors_bad_lengths(tmp_path):
    p = tmp_path / 'x.safetensors'
    p.write_bytes(b'\x01\x02'); pytest.raises(FormatError, st.load_safetensors, p)
    p.write_bytes(struct.pack('<Q', 1 << 62) + b'{}'); pytest.raises(FormatError, st.load_safetensors, p)
    p.write_bytes(struct.pack('<Q', 100) + b'{}'); pytest.raises(FormatError, st.load_safetensors, p)
    with pytest.raises(FormatError, match='JSON'): st.load_safetensors(forge(tmp_path, None, raw=b'{"w":'))

def test_safetensors_save_errors_and_atomicity(tmp_path, monkeypatch):
    p = tmp_path / 'c.safetensors'
    with pytest.raises(FormatError, match="'bad'"): st.save_safetensors(p, {'bad': np.zeros(2, np.complex64)})
    with pytest.raises(FormatError, match='name 1 '): st.save_safetensors(p, {1: np.zeros(2)})
    with pytest.raises(FormatError, match='dict of arrays'): st.save_safetensors(p, [np.zeros(2)])
    with pytest.raises(FormatError, match='metadata'): st.save_safetensors(p, {'a': np.zeros(2)}, metadata={'k': 1})
    st.save_safetensors(p, {'a': np.ones(2)})
    before = p.read_bytes()
    def boom(*a): raise OSError('disk full')
    monkeypatch.setattr(st.os, 'replace', boom)
    with pytest.raises(OSError): st.save_safetensors(p, {'a': np.zeros(2)})
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == ['c.safetensors']

# ---------- manifest and CLI ----------
def run_cli(*args):
    return subprocess.run([sys.executable, '-m', 'gradus', *args], capture_output=True, text=True, cwd=ROOT, timeout=120)

def test_cli_inspect_gguf_and_safetensors(tmp_path, every_type_file):
    r = run_cli('inspect', str(every_type_file))
    assert r.returncode == 0, r.stderr
    assert 'architecture  toy' in r.stdout and 't_Q4_K' in r.stdout and 'Q6_K' in r.stdout and 'max_array=' in r.stdout
    st.save_safetensors(tmp_path / 'm.safetensors', tree_to_dict(tree()), {'k': 'v'})
    r = run_cli('inspect', str(tmp_path / 'm.safetensors'))
    assert r.returncode == 0 and 'blocks.1.attn.wq' in r.stdout and 'BF16' in r.stdout

def test_cli_refuses_bad_file(tmp_path):
    p = tmp_path / 'bad.gguf'; p.write_bytes(b'GGUF' + struct.pack('<IQQ', 3, 0, 1 << 50))
    r = run_cli('inspect', str(p))
    assert r.returncode == 1 and 'FormatError' in r.stderr and 'max_kv' in r.stderr
    assert run_cli('nope').returncode == 2

def test_manifest_smollm2(smollm2):
    from gradus.cli import main
    import io, contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf): assert main(['inspect', str(smollm2)]) == 0
    out = buf.getvalue()
    assert 'architecture  llama' in out and '(49152, 576)' in out and '49152 tokens, 48900 merges' in out
