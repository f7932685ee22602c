"""Fuzzing the GGUF and safetensors readers with a seeded mutator: truncations, bit flips, crafted length fields and
random JSON headers. Every case must end in a result or `FormatError`, quickly, within a memory bound."""
import json, struct, sys, time, tracemalloc
from pathlib import Path
import numpy as np, pytest
from gradus import gguf as G, safetensors as st
from gradus.safetensors import FormatError
sys.path.insert(0, str(Path(__file__).parent))
import _gguf_build as B

CAPS = dict(max_read=1 << 20, max_array=4096, max_string=4096)
HUGE = [0, 1, 255, 1 << 31, 1 << 32, 1 << 60, (1 << 64) - 1]

def base_gguf():
    rng = np.random.default_rng(0)
    kvs = [B.kv_str('general.architecture', 'toy'), B.kv_u32('toy.block_count', 2),
           B.kv_str_array('tokenizer.ggml.tokens', ['a', 'b', 'Ġc', '<s>']), B.s('f') + struct.pack('<If', 6, 1.5)]
    specs = [('q8', [64, 2], 8, 34, 32), ('q4', [32, 2], 2, 18, 32), ('q41', [32], 3, 20, 32), ('k4', [256], 12, 144, 256),
             ('k6', [256], 14, 210, 256), ('f', [8], 0, 4, 1), ('h', [4, 2], 1, 2, 1)]
    return B.build(kvs, B.random_tensors(rng, specs))[0]

def check(p, reader):
    t0 = time.perf_counter()
    try:
        g = reader(p)
        if isinstance(g, G.GGUFFile):
            for name in g.tensors:
                try: g.dequantize(name)
                except FormatError: pass
            G.manifest(p, **CAPS)
        ok = 1
    except FormatError: ok = 0
    assert time.perf_counter() - t0 < 2.0, f"case took {time.perf_counter() - t0:.2f} s"
    return ok

def mutations(base, rng, n):
    for i in range(n):
        b = bytearray(base)
        kind = i % 4
        if kind == 0: b = b[:rng.integers(0, len(b))]
        elif kind == 1:
            for _ in range(rng.integers(1, 8)):
                j = rng.integers(0, min(len(b), 400)); b[j] ^= 1 << rng.integers(0, 8)
        elif kind == 2:
            j = rng.integers(4, min(len(b), 400) - 8)
            b[j:j + 8] = struct.pack('<Q', HUGE[rng.integers(len(HUGE))])
        else:
            j = rng.integers(0, len(b)); b[j:j + rng.integers(1, 16)] = rng.integers(0, 256, rng.integers(0, 16), dtype=np.uint8).tobytes()
        yield bytes(b)

def test_fuzz_gguf(tmp_path):
    base = base_gguf()
    p = tmp_path / 'f.gguf'
    p.write_bytes(base)
    g = G.open_gguf(p, **CAPS)
    for name in g.tensors: g.dequantize(name)                          # warm-up: numba compile/cache load is not timed
    assert check(p, lambda q: G.open_gguf(q, **CAPS)) == 1       # the unmutated file is admitted
    rng = np.random.default_rng(1234)
    admitted = 0
    for blob in mutations(base, rng, 3000):
        p.write_bytes(blob)
        admitted += check(p, lambda q: G.open_gguf(q, **CAPS))
    assert 0 < admitted < 3000          # both outcomes happen: the mutator reaches past the first check

def test_fuzz_gguf_allocation_bounded(tmp_path):
    "Crafted length fields never allocate more than the caps allow (traced by tracemalloc)."
    base = base_gguf()
    p = tmp_path / 'a.gguf'
    rng = np.random.default_rng(99)
    tracemalloc.start()
    try:
        for j in range(8, 200, 4):
            for v in (1 << 40, 1 << 60, (1 << 64) - 1):
                b = bytearray(base); b[j:j + 8] = struct.pack('<Q', v); p.write_bytes(bytes(b))
                tracemalloc.reset_peak()
                check(p, lambda q: G.open_gguf(q, **CAPS))
                assert tracemalloc.get_traced_memory()[1] < 4 * CAPS['max_read'], (j, v)
    finally: tracemalloc.stop()

def st_base(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / 'b.safetensors'
    st.save_safetensors(p, {'a': rng.standard_normal((3, 4)).astype(np.float32), 'b.0': np.arange(5, dtype=np.int64),
                            'c': np.ones(3, np.float16)}, metadata={'k': 'v'})
    return p.read_bytes()

def random_json(rng, depth=0):
    r = rng.integers(0, 9 if depth < 3 else 6)
    if r == 0: return int(rng.choice([-1, 0, 1, 7, 1 << 40, 1 << 70]))
    if r == 1: return float(rng.standard_normal())
    if r == 2: return str(rng.choice(['F32', 'BF16', 'I8', 'X', '', 'data_offsets']))
    if r == 3: return None
    if r == 4: return bool(rng.integers(2))
    if r == 5: return [int(rng.integers(-2, 40)) for _ in range(rng.integers(0, 4))]
    if r == 6: return [random_json(rng, depth + 1) for _ in range(rng.integers(0, 3))]
    return {str(rng.choice(['dtype', 'shape', 'data_offsets', '__metadata__', 'w'])): random_json(rng, depth + 1)
            for _ in range(rng.integers(0, 4))}

def test_fuzz_safetensors(tmp_path):
    base = st_base(tmp_path)
    p = tmp_path / 'f.safetensors'
    rng = np.random.default_rng(4321)
    admitted = 0
    for blob in mutations(base, rng, 2000):
        p.write_bytes(blob)
        admitted += check(p, st.load_safetensors)
    assert 0 < admitted < 2000
    for i in range(1000):            # structurally random headers
        hdr = {'w': {'dtype': random_json(rng), 'shape': random_json(rng), 'data_offsets': random_json(rng)}}
        if i % 3 == 0: hdr = random_json(rng)
        if i % 5 == 0: hdr = {'w': {'dtype': 'F32', 'shape': [int(rng.integers(0, 4))], 'data_offsets': [int(rng.integers(-1, 12)), int(rng.integers(0, 20))]}}
        h = json.dumps(hdr).encode()
        p.write_bytes(struct.pack('<Q', len(h)) + h + bytes(int(rng.integers(0, 24))))
        check(p, st.load_safetensors)
