"""A literate, notebook-first autodiff and deep-learning stack on numpy, from dtypes to a quantized language model.

```python
from gradus.errors import DTypeError
from gradus.errors import ShapeError
from gradus.errors import TracerError
from gradus.core.pytree import (tree_flatten, tree_unflatten, tree_map, tree_leaves,
                           tree_flatten_with_path, keystr, tree_to_dict, tree_from_dict)
from gradus.core.graph import jit, trace
from gradus.core.autograd import (grad, value_and_grad, vjp, jvp, custom_vjp, check_grads,
                             GradCheckError, show_code)
from gradus.core import tensor, ops  # ops gives tracers x[i] and x.mean()
```

Modules:

- `gradus.core.graph`: `trace` runs a function once on tracers and records a small graph IR (inputs, equations of primitives, outputs); `eval_graph` replays it; `dce` removes what no output needs; `simplify` writes sums as BLAS products before compiling; `compile_graph` writes the graph as Python source over numpy and `exec`s it; `jit` caches one compiled graph per argument signature, found by a flat key. The autograd notebook builds its transforms on these.
- `gradus.core.ops`: The ops built on `tensor`'s primitives: basic indexing and gather (`getitem`, `take`) with their scatter VJPs, `concatenate`/`stack`; `PRIMITIVES`, the closed set, and the proofs over it (the same errors eagerly and traced, the dot-product test of every VJP rule); composites made stable (`mean`, `var`, `logsumexp`, `log_softmax`, `softmax`, `sigmoid`, `softplus`, `gelu`).
- `gradus.core.pytree`: Parameters are nested dicts, lists and tuples of arrays; transforms work on flat lists. A pytree is flattened into its leaves and a `TreeDef` that rebuilds it (`tree_flatten`/`tree_unflatten`, or one generated expression, `tree_unflattener`), mapped leaf by leaf (`tree_map`), and named by paths (`keystr`, `tree_to_dict`/`tree_from_dict`, the one naming convention of checkpoints and safetensors files).
- `gradus.formats.tokenizer`: A character tokenizer for small experiments, and the byte-level BPE tokenizer of the GPT-2 family built from a GGUF file's metadata: pre-tokenizers (GPT-2, SmolLM2, Llama 3, Qwen2), merges, chat templates rendered within a budget; `from_gguf` builds it, or SentencePiece BPE (`gradus.formats.spm`).
- `gradus.jobs.cli`: One console entry point, `gradus`, with a subcommand per job: `gradus shakespeare` trains the character-level GPT (the main job); `gradus inspect FILE` prints the manifest of a GGUF or safetensors file; `gradus generate "prompt"` runs a GGUF language model (SmolLM2 by default) and `gradus chat` talks with one.
- `gradus.lm.chat`: `gradus generate "prompt"` and `gradus chat`: choose a model (`--model`, `--gguf`), run it on the fused decode kernels where they apply and on the models' cached forward elsewhere, stream the text, and in a chat keep the KV cache from one turn to the next so that each turn prefills only its own tokens.
- `gradus.lm.decode`: The KV cache (fixed capacity, absolute positions, fails closed on a gap or an overflow, sliding-window layers); `generate`, which drives any model's `step(tokens, pos)` with the sampler of `gradus.lm.sampling` and streams text; the decode-parity harness; the GPT as a model to decode.
- `gradus.lm.engine`: One token at a time, as one parallel region whose workers claim rows from atomic counters: the row kernels of `qkernels` (int8 activations as llama.cpp, four rows per pass) in five stages per layer, a decode step proved against `models.apply`, `stepper` for `decode.generate` (and the `gradus generate` and `gradus chat` commands of `gradus.lm.chat`).
- `gradus.lm.models`: Decoder-only language models run from GGUF files: hyperparameters from the metadata, weights kept in their block formats, one forward built from the training blocks (`nn.rms_norm`, RoPE, grouped-query attention) whose options cover two families, Llama (SmolLM2-135M) and Gemma 3 (270M); `from_gguf`, `apply`, and a cached `stepper` for `decode.generate`. The fast Llama decode kernels are the next notebook's (`engine`).
- `gradus.lm.qkernels`: The numba building blocks of the decode step: activations rounded to int8 blocks as llama.cpp does, row kernels that read Q4_0, Q4_1 and Q8_0 blocks in place four rows per pass, `qmatvec` proved against `dense(W) @ x`, and the LLVM intrinsics numba lacks (float16 scales, prefetch, atomics).
- `gradus.scale.lowering`: `to_jax(f, *example_args)`: the graph gradus traces for `f` (forward, generated backward, the whole training step) run by one JAX rule per primitive; data-parallel training over a device mesh (`jax.jit` with `NamedSharding`, and `shard_map` with `pmean`); the same step across processes.
- `gradus.transformer.gpt`: The nanoGPT-shaped GPT: token and learned position embeddings, pre-LayerNorm blocks with causal multi-head attention, a GELU MLP of 4× width, a final LayerNorm, and an output head tied to the token embedding. `init(key, config)`, `apply(params, tokens, config)`, and `apply_cached`, the same forward over a KV cache."""

__version__ = "0.0.1"
"""A literate, notebook-first autodiff and deep-learning stack on numpy: from dtypes and shapes to a
generated backward pass, a GPT trained on Shakespeare, and a quantized language model run from its
GGUF file."""

# AUTOGENERATED! DO NOT EDIT! File to edit: ../nbs/index.ipynb.

# %% auto #0
__all__ = []

# %% ../nbs/index.ipynb #cc77f746
from .errors import DTypeError
from .errors import ShapeError
from .errors import TracerError
from .core.pytree import (tree_flatten, tree_unflatten, tree_map, tree_leaves,
                           tree_flatten_with_path, keystr, tree_to_dict, tree_from_dict)
from .core.graph import jit, trace
from .core.autograd import (grad, value_and_grad, vjp, jvp, custom_vjp, check_grads,
                             GradCheckError, show_code)
from .core import tensor, ops  # ops gives tracers x[i] and x.mean()
