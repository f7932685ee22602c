"""Fuzzing the GGUF and safetensors readers with a seeded mutator: truncations, bit flips, crafted
length fields and random JSON headers. Every case must end in a result or `FormatError` within a
bound on its work (bytes read and read calls, proportional to the file size) and memory; a timer
only a real hang reaches guards the loop. No verdict depends on how fast the machine is."""
import builtins, contextlib, json, signal, struct, sys, time, tracemalloc
from pathlib import Path
import numpy as np, pytest
from gradus.formats import gguf as G, safetensors as st
from gradus.errors import FormatError
sys.path.insert(0, str(Path(__file__).parent))
import _gguf_build as B

CAPS = dict(max_read=1 << 20, max_array=4096, max_string=4096)
HUGE = [0, 1, 255, 1 << 31, 1 << 32, 1 << 60, (1 << 64) - 1]
HANG_S = 120     # seconds: no case comes near this on any machine; only a real hang reaches it

def base_gguf():
    rng = np.random.default_rng(0)
    kvs = [B.kv_str('general.architecture', 'toy'), B.kv_u32('toy.block_count', 2),
           B.kv_str_array('tokenizer.ggml.tokens', ['a', 'b', 'Ġc', '<s>']),
           B.s('f') + struct.pack('<If', 6, 1.5)]
    specs = [('q8', [64, 2], 8, 34, 32), ('q4', [32, 2], 2, 18, 32), ('q41', [32], 3, 20, 32),
             ('k4', [256], 12, 144, 256), ('k6', [256], 14, 210, 256), ('f', [8], 0, 4, 1),
             ('h', [4, 2], 1, 2, 1)]
    return B.build(kvs, B.random_tensors(rng, specs))[0]

class _Counted:
    "A binary file whose reads are counted into `work` (bytes and calls)."
    def __init__(self, f, work): self.f, self.work = f, work
    def read(self, n=-1):
        b = self.f.read(n)
        self.work['bytes'] += len(b); self.work['reads'] += 1
        return b
    def __getattr__(self, name): return getattr(self.f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()

@contextlib.contextmanager
def counted_reads(work):
    "Route the readers' `open` through `_Counted` (the modules look `open` up as a global)."
    def _open(path, mode='r', *a, **k): return _Counted(builtins.open(path, mode, *a, **k), work)
    mods = (G, st)
    for m in mods: m.open = _open
    try: yield work
    finally:
        for m in mods: del m.open

@contextlib.contextmanager
def hang_guard(seconds=HANG_S):
    "Fail the case if it runs `seconds` of real time: a hang, not a slow machine."
    if not hasattr(signal, 'setitimer'): yield; return
    def _alarm(*_): raise TimeoutError(f"case still running after {seconds} s: a hang")
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try: yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0); signal.signal(signal.SIGALRM, old)

def check(p, reader):
    """Run one case: admit (and for GGUF decode every tensor and print the manifest). Returns 1 if
    admitted, 0 if refused with FormatError. Asserts the work is bounded by the file size: each of
    the (at most three) passes over the file reads each byte at most once, in at most one call per
    byte plus one per tensor and key."""
    size = p.stat().st_size
    with counted_reads({'bytes': 0, 'reads': 0}) as work, hang_guard():
        try:
            g = reader(p)
            if isinstance(g, G.GGUFFile):
                for name in g.tensors:
                    try: g.dequantize(name)
                    except FormatError: pass
                G.manifest(p, **CAPS)
            ok = 1
        except FormatError: ok = 0
    assert work['bytes'] <= 3 * size, f"read {work['bytes']} bytes of a {size}-byte file"
    assert work['reads'] <= 3 * (size + 64), f"{work['reads']} read calls on a {size}-byte file"
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
            j = rng.integers(0, len(b))
            junk = rng.integers(0, 256, rng.integers(0, 16), dtype=np.uint8).tobytes()
            b[j:j + rng.integers(1, 16)] = junk
        yield bytes(b)

def test_fuzz_gguf(tmp_path):
    base = base_gguf()
    p = tmp_path / 'f.gguf'
    p.write_bytes(base)
    g = G.open_gguf(p, **CAPS)
    for name in g.tensors: g.dequantize(name)                   # warm-up: numba compile/cache load
    assert check(p, lambda q: G.open_gguf(q, **CAPS)) == 1      # the unmutated file is admitted
    rng = np.random.default_rng(1234)
    admitted = 0
    for blob in mutations(base, rng, 3000):
        p.write_bytes(blob)
        admitted += check(p, lambda q: G.open_gguf(q, **CAPS))
    assert 0 < admitted < 3000    # both outcomes happen: the mutator reaches past the first check

def test_fuzz_gguf_allocation_bounded(tmp_path):
    "Crafted length fields never allocate more than the caps allow (traced by tracemalloc)."
    base = base_gguf()
    p = tmp_path / 'a.gguf'
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
    st.save_safetensors(p, {'a': rng.standard_normal((3, 4)).astype(np.float32),
                            'b.0': np.arange(5, dtype=np.int64), 'c': np.ones(3, np.float16)},
                        metadata={'k': 'v'})
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
    keys = ['dtype', 'shape', 'data_offsets', '__metadata__', 'w']
    return {str(rng.choice(keys)): random_json(rng, depth + 1) for _ in range(rng.integers(0, 4))}

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
        hdr = {'w': {'dtype': random_json(rng), 'shape': random_json(rng),
                     'data_offsets': random_json(rng)}}
        if i % 3 == 0: hdr = random_json(rng)
        if i % 5 == 0:
            offs = [int(rng.integers(-1, 12)), int(rng.integers(0, 20))]
            hdr = {'w': {'dtype': 'F32', 'shape': [int(rng.integers(0, 4))], 'data_offsets': offs}}
        h = json.dumps(hdr).encode()
        p.write_bytes(struct.pack('<Q', len(h)) + h + bytes(int(rng.integers(0, 24))))
        check(p, st.load_safetensors)

def test_verdicts_do_not_depend_on_the_clock(tmp_path, monkeypatch):
    """A machine so busy that every clock reading is ten seconds later than the last changes no
    verdict: the cases are bounded by their work, not timed."""
    clock = iter(range(0, 10 ** 9, 10))
    for name in ('perf_counter', 'monotonic', 'time'):
        monkeypatch.setattr(time, name, lambda: float(next(clock)))
    p = tmp_path / 'c.gguf'; base = base_gguf()
    p.write_bytes(base)
    assert check(p, lambda q: G.open_gguf(q, **CAPS)) == 1
    for blob in mutations(base, np.random.default_rng(7), 40):
        p.write_bytes(blob); check(p, lambda q: G.open_gguf(q, **CAPS))

def test_work_bound_catches_a_rereading_reader(tmp_path):
    "The work bound can fail: a reader that reads the file four times over is caught."
    p = tmp_path / 'r.safetensors'; p.write_bytes(st_base(tmp_path))
    def greedy(q):
        for _ in range(4): st.load_safetensors(q)
    with pytest.raises(AssertionError, match='bytes of a'): check(p, greedy)
