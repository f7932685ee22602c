"""Mutation harness: does the suite notice realistic one-line bugs?

Each mutant is a bug of a kind autodiff and ML libraries have shipped, written as exact-string
replacements. It is applied to the exported module *and* to the exported cells of the notebook the
module comes from (the notebook is the source, and nbval runs the notebook's own definitions), in a
copy of the repository under a temporary directory; the working tree is never touched. Then each of
the mutant's test targets runs on its own (`pytest -x -q`, a timeout per run), with `PYTHONPATH`
pointing at the copy, and a markdown table records which targets killed it.

    python tools/mutants.py --list               # the mutants: id, module file, notebooks
    python tools/mutants.py --check              # every target string present exactly once?
    python tools/mutants.py                      # every mutant (and baselines), table to --out
    python tools/mutants.py --only softmax-axis rope-pairing --timeout 120

A mutant names its module by its dotted path below gradus (`core.ops` is gradus/core/ops.py); the
notebooks it is exported from are read from the module's cell markers (`# %% ../../nbs/core/
03_ops.ipynb`): a lesson and a companion may both export into one module.

Too slow for CI (minutes per mutant on two cores); see tools/mutants.md for the receipt.
"""
import argparse, json, os, re, shlex, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SKIP = ('.venv', '.git', 'docs', '__pycache__', 'runs', '.hypothesis', '_docs', '_proc',
        '.ipynb_checkpoints', '*.egg-info')


class Mutant(NamedTuple):
    id: str          # a short name, used by --only
    kind: str        # the bug, in words
    module: str      # 'core.ops', gradus/core/ops.py; its notebooks are read from its cell markers
    edits: tuple     # ((old, new), ...): exact strings, each present once in module and notebooks;
                     # `old` may be a tuple of alternatives (the first present once is used)
    targets: tuple   # pytest arguments, one run each: 'tests/x.py::test_y', 'tests/x.py -k z',
                     # or '{nb}' (the module's notebook under nbval)


M = Mutant
MUTANTS = [
    # --- tensor: primitives, VJP rules, composites (nbs/core/02_tensor) ---
    M('softmax-axis', "softmax normalises along the last axis whatever `axis` is asked", 'core.ops',
      (("return e / sum(e, axis, keepdims=True)", "return e / sum(e, -1, keepdims=True)"),),
      ('tests/test_reference.py -k softmax', 'tests/test_oracle_layers.py -k softmax',
       'tests/test_oracle.py', 'tests/test_gradcheck.py', '{nb}')),
    M('softmax-no-max', "softmax without subtracting the row maximum (overflows for big logits)",
      'core.ops', ((("e = exp(x - stop_gradient(max(x, axis, keepdims=True)))",
                   "e = exp(x - _shift(x, normalize_axis(axis, x.ndim, 'softmax')))"),
                  "e = exp(x)"),),
      ('tests/test_numerics.py -k row_ops', 'tests/test_gradcheck.py', '{nb}')),
    M('logsumexp-no-max', "log-sum-exp without the max shift", 'core.ops',
      (("out = _log_sum_exp(x - m, axes) + m", "out = _log_sum_exp(x, axes)"),),
      ('tests/test_numerics.py -k row_ops', 'tests/test_gradcheck.py', '{nb}')),
    M('gelu-constant', "tanh-GELU constant 0.044715 changed to 0.0447", 'core.ops',
      (("GELU_A = math.sqrt(2 / math.pi), 0.044715", "GELU_A = math.sqrt(2 / math.pi), 0.0447"),),
      ('tests/test_reference.py -k unary', 'tests/test_numerics.py -k gelu', 'tests/test_oracle.py',
       '{nb}')),
    M('matmul-vjp-transpose', "matmul VJP multiplies by b instead of b transposed", 'core.tensor',
      (("matmul(ct2, swapaxes(b2, -1, -2))", "matmul(ct2, b2)"),),
      ('tests/test_gradcheck.py', 'tests/test_oracle.py', '{nb}')),
    M('reduction-vjp-keepdims', "sum/max VJP forgets to restore the reduced axes (keepdims) "
      "before broadcasting the cotangent back", 'core.tensor',
      (("if keepdims: return ct", "if True: return ct"),),
      ('tests/test_gradcheck.py', 'tests/test_oracle.py', '{nb}')),
    M('tanh-vjp', "tanh VJP uses 1 - y instead of 1 - y²", 'core.tensor',
      (("(ct * (1 - out * out),)", "(ct * (1 - out),)"),),
      ('tests/test_gradcheck.py', 'tests/test_oracle.py', '{nb}')),
    M('divide-vjp-sign', "d(x/y)/dy loses its minus sign", 'core.tensor',
      (("_unbroadcast(negative(ct) * out / y, y)", "_unbroadcast(ct * out / y, y)"),),
      ('tests/test_gradcheck.py', 'tests/test_oracle.py', '{nb}')),
    M('scatter-add-overwrites', "gather VJP writes repeated indices once instead of summing them "
      "(the `g[idx] += ct` numpy bug)", 'core.ops',
      (("np.add.reduceat(u[order], starts, axis=0)", "u[order][starts]"),),
      ('tests/test_gradcheck.py', 'tests/test_nn.py', '{nb}')),
    # --- shape (nbs/core/01_shape) ---
    M('reduce-to-shape-lead', "reduce_to_shape forgets the offset of the added leading axes",
      'core.shape', (("tuple(lead + i for i, n in enumerate(shape) if n == 1",
                 "tuple(i for i, n in enumerate(shape) if n == 1"),),
      ('tests/test_shape.py', 'tests/test_gradcheck.py', '{nb}')),
    M('reduce-to-shape-keepdims', "reduce_to_shape keeps the summed leading axes (keepdims, no "
      "reshape): a bias gradient of shape (1, n) for a bias of shape (n,)", 'core.shape',
      (("g.sum(axis=axes, keepdims=True).reshape(shape) if axes",
        "g.sum(axis=axes, keepdims=True) if axes"),),
      ('tests/test_shape.py', 'tests/test_gradcheck.py', '{nb}')),
    # --- autograd (nbs/core/07_autograd) ---
    M('grad-cache-ignores-dtype', "compiled-gradient cache keyed on shapes only, not dtypes",
      'core.cache', (("leaves.append(leaf); key += (leaf.dtype, tuple(leaf.shape))",
                      "leaves.append(leaf); key += (tuple(leaf.shape),)"),
                     ("leaves.append(c); key.append(c.dtype); key.append(c.shape)",
                      "leaves.append(c); key.append(c.shape)")),
      ('tests/test_transforms.py', 'tests/test_oracle_layers.py -k two_dtypes',
       'tests/test_gradcheck.py', '{nb}')),
    M('fanout-overwrites', "backward pass overwrites instead of summing the cotangents of a value "
      "used twice", 'core.autograd',
      (("ct[var.n] = g if var.n not in ct else T.add(ct[var.n], g)", "ct[var.n] = g"),),
      ('tests/test_gradcheck.py', 'tests/test_oracle.py', '{nb}')),
    # --- loss (nbs/learn/09_loss) ---
    M('ce-no-max', "cross-entropy without subtracting the row maximum", 'learn.loss',
      (("return z - T.where(T.isfinite(m), m, np.zeros((), z.dtype))", "return z"),),
      ('tests/test_loss.py', '{nb}')),
    M('ignore-index-count', "cross_entropy with ignore_index averages over all positions, not the "
      "kept ones", 'learn.loss', (("T.maximum(T.sum(T.cast(keep, acc)), 1.0)", "max(n, 1)"),),
      ('tests/test_loss.py', 'tests/test_oracle.py -k cross_entropy', '{nb}')),
    M('ce-vjp-drops-cotangent', "cross-entropy's custom VJP ignores the incoming cotangent",
      'learn.loss',
      (("return g * T.reshape(ct, (n, 1)), ", "return g, "),),
      ('tests/test_loss.py', 'tests/test_oracle.py -k cross_entropy', '{nb}')),
    # --- random (nbs/learn/10_random) ---
    M('fold-in-ignores-index', "fold_in(key, i) ignores i", 'learn.random',
      (("_philox(k, (0, i, 2, 0))", "_philox(k, (0, 0, 2, 0))"),),
      ('tests/test_nn.py', 'tests/test_train.py', '{nb}')),
    # --- nn (nbs/learn/11_nn) ---
    M('layernorm-eps-outside', "LayerNorm/RMSNorm add eps outside the square root", 'learn.nn',
      (("T.sqrt(ops.mean(u * u, -1, keepdims=True) + eps / s / s)",
        "(T.sqrt(ops.mean(u * u, -1, keepdims=True)) + eps / s / s)"),),
      ('tests/test_nn.py', 'tests/test_reference.py -k layer_norm', '{nb}')),
    M('rmsnorm-axis', "the norms take the mean square over every axis, not the feature axis",
      'learn.nn',
      (("T.sqrt(ops.mean(u * u, -1, keepdims=True) + eps / s / s)",
        "T.sqrt(ops.mean(u * u, None, keepdims=True) + eps / s / s)"),),
      ('tests/test_nn.py', 'tests/test_reference.py -k rms_norm', '{nb}')),
    M('dropout-not-rescaled', "inverted dropout forgets to scale the kept units by 1/(1 - rate)",
      'learn.nn', (("T.where(keep, x * (1.0 / (1.0 - rate)), ", "T.where(keep, x, "),),
      ('tests/test_nn.py', 'tests/test_reference.py -k dropout', '{nb}')),
    # --- optim (nbs/learn/12_optim) ---
    M('adam-no-bias-correction', "Adam without bias correction", 'learn.optim',
      (("c1, c2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)", "c1, c2 = 1.0, 1.0"),),
      ('tests/test_optim.py', 'tests/test_mlp_reference.py', '{nb}')),
    M('adamw-decay-on-gradient', "AdamW's weight decay added to the gradient (L2, coupled) instead "
      "of decoupled", 'learn.optim',
      (("hyper = (b1, b2, c1, c2, eps, weight_decay if dec else 0.0, lr_t)",
        "hyper = (b1, b2, c1, c2, eps, 0.0, lr_t); g = g + weight_decay * p * dec"),),
      ('tests/test_optim.py', 'tests/test_mlp_reference.py', '{nb}')),
    M('adam-eps-inside-sqrt', "Adam's eps inside the square root", 'learn.optim',
      (("(np.sqrt(v / c2) + eps)", "np.sqrt(v / c2 + eps)"),),
      ('tests/test_optim.py', 'tests/test_mlp_reference.py', '{nb}')),
    M('warmup-off-by-one', "linear warmup starts at lr 0 (step t, not t + 1)", 'learn.optim',
      (("peak * min(1.0, (t + 1) / warmup_steps)", "peak * min(1.0, t / warmup_steps)"),),
      ('tests/test_optim.py', 'tests/test_mlp_reference.py', '{nb}')),
    M('global-norm-no-sqrt', "global gradient norm without the square root", 'learn.optim',
      (("return math.sqrt(sum(_squares(x) for x in tree_leaves(tree)))",
        "return sum(_squares(x) for x in tree_leaves(tree))"),),
      ('tests/test_optim.py', 'tests/test_mlp_reference.py', '{nb}')),
    # --- train (nbs/learn/13_train) ---
    M('targets-not-shifted', "language-model targets equal the inputs (not shifted by one)",
      'learn.train', (("return w[:, :-1], w[:, 1:]", "return w[:, :-1], w[:, :-1]"),),
      ('tests/test_train.py', '{nb}')),
    # --- attention (nbs/transformer/14_attention) ---
    M('causal-mask-off-by-one', "causal mask lets each query see one future key",
      'transformer.attention',
      (("m = kpos <= qpos", "m = kpos <= qpos + 1"),),
      ('tests/test_attention.py -k causal_mask', 'tests/test_decode.py -k causal_mask', '{nb}')),
    M('rope-pairing', "RoPE pairs features the other way (interleaved vs rotate-half swapped)",
      'transformer.attention', (("    if interleaved:", "    if not interleaved:"),),
      ('tests/test_attention.py -k rope', 'tests/test_llama.py -k rope_pairing', '{nb}')),
    M('gqa-tiling', "GQA maps query head h to key/value head h % n_kv (tiling) instead of "
      "h // group (repeating)", 'transformer.attention',
      (("q = _heads(q, b, t, n_kv, group, hd)",
        "q = T.transpose(q.reshape(b, t, group, n_kv, hd), (0, 3, 2, 1, 4))"),
       ("y = T.transpose(y, (0, 3, 1, 2, 4))", "y = T.transpose(y, (0, 3, 2, 1, 4))")),
      ('tests/test_attention.py -k multi_head', '{nb}')),
    M('attention-scale', "attention scores scaled by 1/d instead of 1/sqrt(d)",
      'transformer.attention',
      (("1.0 / math.sqrt(d) if scale is None", "1.0 / d if scale is None"),),
      ('tests/test_attention.py -k sdpa', 'tests/test_decode.py -k gpt', '{nb}')),
    # --- gpt (nbs/transformer/15_gpt) ---
    M('kv-cache-positions', "cached decoding adds position embeddings from 0, not from `pos`",
      'transformer.gpt', (("params['wpe'][pos:pos + t]", "params['wpe'][:t]"),),
      ('tests/test_decode.py -k gpt', 'nbs/lm/23_decode.ipynb', '{nb}')),
    # --- engine: the numba decode kernels of Part II (nbs/lm/26_engine) ---
    M('llama-gqa-kernel', "decode kernel maps query head h to kv head h % n_kv (tiling) instead of "
      "h // group", 'lm.engine',
      (("_attend_head(qkv[o : o + D], ck[h // group], cv[h // group]",
        "_attend_head(qkv[o : o + D], ck[h % ck.shape[0]], cv[h % ck.shape[0]]"),),
      ('tests/test_llama.py -k decode_parity', '{nb}')),
    M('llama-rmsnorm-eps-kernel', "decode kernel's RMSNorm adds eps outside the square root",
      'lm.engine', (("np.sqrt(ss / f32(x.shape[0]) + f32(eps))",
                  "(np.sqrt(ss / f32(x.shape[0])) + f32(eps))"),),
      ('tests/test_llama.py -k decode_parity', '{nb}')),
    # --- safetensors (nbs/formats/17_safetensors) ---
    M('safetensors-offset', "safetensors data buffer read one byte early", 'formats.safetensors',
      (("base, buf = 8 + n, size - 8 - n", "base, buf = 7 + n, size - 7 - n"),),
      ('tests/test_formats.py -k safetensors', 'tests/test_train.py -k checkpoint', '{nb}')),
    # --- quants (nbs/formats/18_quants) ---
    M('q4_0-nibble-order', "Q4_0 quantizer packs the nibbles in the other order", 'formats.quants',
      (("q = q[:, :16] | (q[:, 16:] << 4)", "q = q[:, 16:] | (q[:, :16] << 4)"),),
      ('tests/test_formats.py -k quantize', '{nb}')),
    M('q4-matvec-nibble-order', "Q4 mat-vec pairs low nibbles with the second half of x",
      'formats.quants',
      (("a[j] += d * ((np.float32(qs[j] & 15) - off) * x[j])",
        "a[j] += d * ((np.float32(qs[j] & 15) - off) * x[j + 16])"),),
      ('tests/test_formats.py -k qmatvec', '{nb}')),
    M('q8_0-scale-f32', "Q8_0 reference decoder reads the scale as float32, not float16",
      'formats.quants',
      (("def _ref_q8_0(b): return _f16(b[:, 0:2])[:, None]",
        "def _ref_q8_0(b): return np.ascontiguousarray(b[:, 0:4]).view('<f4')"),),
      ('tests/test_formats.py -k "dequantize or kernel"', '{nb}')),
    M('f16-subnormal', "float16 decoder's subnormal exponent off by one", 'formats.quants',
      (("* _POW2[max(e, 1)]", "* _POW2[max(e, 0)]"),),
      ('tests/test_formats.py -k "dequantize or kernel"', '{nb}')),
    # --- gguf (nbs/formats/19_gguf) ---
    M('gguf-shape-order', "GGUF dims kept in ggml order (fastest first), not reversed to numpy's",
      'formats.gguf', (("tuple(reversed(ne))", "tuple(ne)"),),
      ('tests/test_formats.py -k gguf', '{nb}')),
    M('gguf-alignment', "GGUF tensor data assumed to start right after the header (alignment "
      "ignored)", 'formats.gguf',
      (("data_offset = -(-header_end // alignment) * alignment", "data_offset = header_end"),),
      ('tests/test_formats.py -k gguf', '{nb}')),
    # --- tokenizer (nbs/formats/21_tokenizer) ---
    M('bpe-merge-rank', "BPE applies the highest-rank (latest) merge first", 'formats.tokenizer',
      (("r < best", "r > best"),),
      ('tests/test_tokenizer.py', '{nb}')),
    # --- sampling (nbs/lm/22_sampling) ---
    M('top-p-off-by-one', "top-p keeps one token too few (the prefix before the one reaching p)",
      'lm.sampling', (("np.searchsorted(np.cumsum(prob[order]), p)) + 1",
                  "np.searchsorted(np.cumsum(prob[order]), p))"),),
      ('tests/test_decode.py -k top_p', '{nb}')),
]


def module_file(tree, module):
    "gradus/core/ops.py in `tree` for the module 'core.ops'."
    return tree / 'gradus' / (module.replace('.', '/') + '.py')


def notebooks_of(tree, module):
    """The notebooks the module is exported from, relative to `tree` ('nbs/core/03_ops.ipynb'), in
    the order of its cells: nbdev marks each exported cell with `# %% <path to notebook> #<id>`."""
    mod = module_file(tree, module)
    found = []
    for rel in re.findall(r'^# %% (\S+\.ipynb)\b', mod.read_text(), re.M):
        path = (mod.parent / rel).resolve().relative_to(tree.resolve()).as_posix()
        if path not in found: found.append(path)
    if not found:
        raise LookupError(f"{mod.relative_to(tree)} has no cell markers naming a notebook")
    return found


def notebook_of(tree, module):
    "The module's first notebook, the lesson (`{nb}` in a target)."
    return notebooks_of(tree, module)[0]


def exported_cells(nb):
    "Code cells of notebook json `nb` whose first directive exports them."
    def exported(c):
        src = ''.join(c['source']).lstrip()
        return c['cell_type'] == 'code' and re.match(r'#\|\s*export', src)
    return [c for c in nb['cells'] if exported(c)]


def concrete(edits, text):
    "`edits` with each `old` given as a tuple of alternatives resolved to the first found once."
    pick = lambda old: next((o for o in old if text.count(o) == 1), old[0])
    return [(pick(old) if isinstance(old, tuple) else old, new) for old, new in edits]


def locate(tree, m):
    "Problems with the targets of `m` in `tree`: none when each is in module and notebooks once."
    problems, mod = [], module_file(tree, m.module)
    name = mod.relative_to(tree).as_posix()
    if not mod.exists(): return [f"{name} is missing"]
    text = mod.read_text()
    try: nb_paths = notebooks_of(tree, m.module)
    except LookupError as e: return [str(e)]
    cells = [c for p in nb_paths for c in exported_cells(json.loads((tree / p).read_text()))]
    nb_text = '\n'.join(''.join(c['source']) for c in cells)
    for old, _ in concrete(m.edits, text):
        if text.count(old) != 1: problems.append(f"{text.count(old)}x in {name}: {old!r}")
        if nb_text.count(old) != 1:
            problems.append(f"{nb_text.count(old)}x in exported cells of "
                            f"{' + '.join(nb_paths)}: {old!r}")
    return problems


def apply(tree, m):
    """Apply `m` to the module and its notebooks in `tree`; returns {path: (original bytes, stat)}
    to restore."""
    mod = module_file(tree, m.module)
    nb_files = [tree / p for p in notebooks_of(tree, m.module)]
    saved = {p: (p.read_bytes(), p.stat()) for p in (mod, *nb_files)}
    text = mod.read_text()
    edits = concrete(m.edits, text)
    for old, new in edits: text = text.replace(old, new)
    mod.write_text(text)
    for nb_file in nb_files:
        nb = json.loads(nb_file.read_text())
        for c in exported_cells(nb):
            src = ''.join(c['source'])
            for old, new in edits: src = src.replace(old, new)
            c['source'] = src.splitlines(keepends=True)
        nb_file.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    later = time.time() + 5           # a new mtime: no stale bytecode or numba cache can match
    for p in saved: os.utime(p, (later, later))
    return saved


def restore(saved):
    "Put the original bytes back with their original mtimes (so numba's caches stay valid)."
    for p, (data, st) in saved.items():
        p.write_bytes(data)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def copy_tree(dest):
    "A copy of the repository at `dest`, without the venv, git, docs and caches."
    if dest.exists(): shutil.rmtree(dest)
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*SKIP), symlinks=True)
    return dest


def run_target(tree, target, nb, timeout):
    "Run one pytest target in `tree`: ('pass' | 'killed' | 'timeout' | 'absent', first failure, s)."
    args = shlex.split(target.replace('{nb}', nb or ''))
    if not (tree / args[0].split('::')[0]).exists(): return 'absent', args[0], 0.0
    env = {**os.environ, 'PYTHONPATH': str(tree), 'PYTHONDONTWRITEBYTECODE': '1',
           'GRADUS_DATA': os.environ.get('GRADUS_DATA', str(ROOT.parent / 'shared' / 'data')),
           'MPLBACKEND': 'Agg', 'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1',
           'NUMBA_NUM_THREADS': '1'}
    cmd = [sys.executable, '-m', 'pytest', '-x', '-q', '--no-header', '-p', 'no:cacheprovider',
           '-n', '0', *args]   # one process: a target is small, and -x stops at its first failure
    if not args[0].endswith('.ipynb'):   # nbval's imports cost seconds a run: none for .py files
        cmd[4:4] = ['-o', 'addopts=', '-p', 'no:nbval']
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try: out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL); p.communicate()
        return 'timeout', f'> {timeout} s', time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if p.returncode in (0, 5): return 'pass', '', dt          # 5: nothing collected (all skipped)
    first = next((ln.split(' - ')[0] for ln in out.splitlines()
                  if ln.startswith(('FAILED ', 'ERROR '))), out.strip().splitlines()[-1:] or ['?'])
    return 'killed', (first if isinstance(first, str) else first[0]), dt


def short(failure):
    "A failing test id without the noise: 'FAILED tests/test_x.py::test_y[p]' -> 'test_y[p]'."
    f = failure.replace('FAILED ', '').replace('ERROR ', '')
    if f.startswith('nbs/'): return f.split('::')[-1].replace('ipynb::', '')
    return f.split('::')[-1]


def label(target, nb):
    return target.replace('{nb}', nb or '{nb}').replace('tests/', '')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--list', action='store_true',
                    help='list the mutants (id, module file, notebooks, bug) and exit')
    ap.add_argument('--check', action='store_true', help='only check the target strings')
    ap.add_argument('--only', nargs='*', help='mutant ids to run (default: all)')
    ap.add_argument('--timeout', type=int, default=240, help='seconds per pytest run')
    ap.add_argument('--tree', default=None, help='where to copy the repository (default: temp dir)')
    ap.add_argument('--out', default=None, help='markdown file for the table (default: print only)')
    ap.add_argument('--no-baseline', action='store_true', help='skip the unmutated run of targets')
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.only or m.id in a.only]
    if a.only and len(chosen) != len(a.only):
        sys.exit(f"unknown mutant ids: {sorted(set(a.only) - {m.id for m in MUTANTS})}")
    if a.list:
        for m in chosen:
            try: nbs = ' + '.join(notebooks_of(ROOT, m.module))
            except (LookupError, OSError) as e: nbs = f'({e})'
            print(f"{m.id:26} {module_file(ROOT, m.module).relative_to(ROOT)}  {nbs}\n"
                  f"{'':26} {m.kind}")
        print(f"{len(chosen)} mutants")
        sys.exit(0)
    if a.check:
        bad = {m.id: locate(ROOT, m) for m in chosen}
        for i, probs in bad.items():
            print(f"{'ok  ' if not probs else 'FAIL'} {i}"
                  + ''.join(f"\n       {p}" for p in probs))
        print(f"{sum(not p for p in bad.values())}/{len(bad)} mutants have their targets")
        sys.exit(1 if any(bad.values()) else 0)

    tree = copy_tree(Path(a.tree or tempfile.mkdtemp(prefix='gradus-mutants-')) / 'repo')
    load = subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()
    print(f"copy of {ROOT} at {tree}; {len(chosen)} mutants; uptime: {load}", flush=True)
    runnable = []
    for m in chosen:
        probs = locate(tree, m)
        if probs: print(f"SKIP {m.id}: target vanished: {'; '.join(probs)}", flush=True)
        else: runnable.append(m)
    # A target that kills a mutant is run once unmutated right after (tree restored): if it fails
    # there too, the kill is void and the target is skipped for later mutants. Targets that never
    # kill need no baseline: passing under a mutant already shows they pass.
    baseline, rows, t_start = {}, [], time.perf_counter()
    for m in runnable:
        nb = notebook_of(tree, m.module)
        saved = apply(tree, m)
        try:
            res = []
            for t in m.targets:
                key = t.replace('{nb}', nb)
                if baseline.get(key, ('pass',))[0] != 'pass':
                    res.append((t, 'broken at baseline', baseline[key][1], 0.0)); continue
                res.append((t, *run_target(tree, t, nb, a.timeout)))
        finally: restore(saved)
        if not a.no_baseline:
            for i, (t, status, f, dt) in enumerate(res):
                key = t.replace('{nb}', nb)
                if status not in ('killed', 'timeout'): continue
                if key not in baseline:
                    baseline[key] = run_target(tree, t, nb, a.timeout)
                    print(f"  baseline {key}: {baseline[key][0]} {baseline[key][1]} "
                          f"({baseline[key][2]:.0f} s)", flush=True)
                if baseline[key][0] != 'pass':
                    res[i] = (t, 'broken at baseline', baseline[key][1], dt)
        kills = [r for r in res if r[1] == 'killed']
        print(f"{m.id}: killed by {len(kills)}/{len(res)} "
              + '; '.join(f"{label(t, nb)}={s}{' (' + short(f) + ')' if f else ''} {dt:.0f}s"
                          for t, s, f, dt in res), flush=True)
        rows.append((m, nb, res))
    load = subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()
    table = render(rows, time.perf_counter() - t_start, [m for m in chosen if m not in runnable])
    table += f"\nuptime at the end: {load}\n"
    print(table)
    if a.out: Path(a.out).write_text(table)


def render(rows, seconds, vanished):
    "The markdown table and score."
    lines = ['| mutant | module | bug | killed by (first failing test) | survived | kills |',
             '|---|---|---|---|---|---|']
    for m, nb, res in rows:
        killed = [f"`{label(t, nb)}` ({short(f)})" for t, s, f, _ in res if s == 'killed']
        other = [f"`{label(t, nb)}`" + ('' if s == 'pass' else f" ({s})")
                 for t, s, f, _ in res if s != 'killed']
        lines.append(f"| `{m.id}` | {m.module} | {m.kind} | {'<br>'.join(killed) or '**none**'} | "
                     f"{'<br>'.join(other) or '-'} | {len(killed)} |")
    n = len(rows)
    k1 = sum(any(s == 'killed' for _, s, _, _ in res) for _, _, res in rows)
    k2 = sum(sum(s == 'killed' for _, s, _, _ in res) >= 2 for _, _, res in rows)
    lines += ['', f"Score: {k1}/{n} mutants killed; {k2}/{n} killed by at least two independent "
              f"targets. {seconds / 60:.1f} min."]
    if vanished:
        lines.append(f"Not run (target string vanished): {', '.join(m.id for m in vanished)}.")
    return '\n'.join(lines) + '\n'


if __name__ == '__main__':
    main()
