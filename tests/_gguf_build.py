"""Test helper: write small GGUF files byte by byte from the spec (independent of gradus and of
gguf-py's writer)."""
import struct
import numpy as np

def s(x: str) -> bytes:
    b = x.encode()
    return struct.pack('<Q', len(b)) + b


# GGUF value types and one value written by hand (spec: ggml docs/gguf.md)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = \
    range(13)
FMT = {UINT8: 'B', INT8: 'b', UINT16: 'H', INT16: 'h', UINT32: 'I', INT32: 'i', FLOAT32: 'f',
       BOOL: '?', UINT64: 'Q', INT64: 'q', FLOAT64: 'd'}


def value(vtype, v) -> bytes:
    "One GGUF value of type `vtype`; an ARRAY's `v` is `(element type, items)`."
    if vtype == STRING: return s(v)
    if vtype == ARRAY:
        etype, items = v
        return struct.pack('<IQ', etype, len(items)) + b''.join(value(etype, x) for x in items)
    return struct.pack('<' + FMT[vtype], v)


def kv_u32(k, v): return s(k) + struct.pack('<II', 4, v)
def kv_str(k, v): return s(k) + struct.pack('<I', 8) + s(v)
def kv_str_array(k, vals):
    return s(k) + struct.pack('<IIQ', 9, 8, len(vals)) + b''.join(s(v) for v in vals)

def build(kvs, tensors, version=3, alignment=32, n_kv=None, n_tensors=None, pad=True):
    """kvs: list of encoded kv bytes; tensors: list of (name, ne (ggml order), type, data bytes).
    Returns (file bytes, offset of the tensor-info section)."""
    head = b'GGUF' + struct.pack('<IQQ', version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b''.join(kvs)
    info_at = len(head)
    infos, data, off = b'', b'', 0
    for name, ne, t, blob in tensors:
        dims = b''.join(struct.pack('<Q', d) for d in ne)
        infos += s(name) + struct.pack('<I', len(ne)) + dims + struct.pack('<IQ', t, off)
        blob += b'\0' * (-len(blob) % alignment)
        data += blob; off += len(blob)
    hdr = head + infos
    if pad: hdr += b'\0' * (-len(hdr) % alignment)
    return hdr + data, info_at

# Q4_1, Q5_1, Q4_K: d and m/dmin; Q6_K: d last
F16_FIELDS = {3: [0, 2], 7: [0, 2], 12: [0, 2], 14: [208]}

def random_tensors(rng, specs):
    """specs: list of (name, ne, type, type_size, block_size) -> tensors with random bytes and
    finite f16 scale fields."""
    out = []
    for name, ne, t, ts, bs in specs:
        nb = int(np.prod(ne)) // bs
        blob = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
        for o in (F16_FIELDS.get(t, [0]) if bs > 1 else []):
            f16 = rng.standard_normal(nb).astype(np.float16)
            blob[:, o:o + 2] = f16.view(np.uint8).reshape(nb, 2)
        if t in (0, 1, 30):   # plain floats: finite values
            dt = {0: np.float32, 1: np.float16, 30: np.float32}[t]
            blob = rng.standard_normal(nb).astype(dt).view(np.uint8)
            if t == 30: blob = blob.reshape(nb, 4)[:, 2:]
        out.append((name, ne, t, blob.tobytes()))
    return out
