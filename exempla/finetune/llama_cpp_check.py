"""llama.cpp reads gradus's adapter: the logits of llama.cpp (llama-cpp-python) with `lora_path`
set to the `adapter.gguf` that `gradus finetune` wrote, beside gradus's own adapted forward, as
close as llama.cpp's base logits are to gradus's base (llama.cpp rounds activations to int8
blocks, so neither pair agrees to float32).

    python exempla/finetune/llama_cpp_check.py OUT/adapter.gguf [--gguf BASE]

Needs `llama_cpp` (pip install llama-cpp-python builds it from source, 7-12 minutes on 2 cores);
not a test dependency. Prints the two deviations and the adapter's own effect on gradus's logits
(which the deviations must be far below, or the check could not fail)."""
import argparse
import numpy as np
from gradus.lm import adapters, chat, lora, models


def llama_cpp_logits(path, tokens, lora_path=None):
    "llama.cpp's float32 logits `(T, vocab)` of `tokens` for the model at `path` (with an adapter)."
    import llama_cpp
    kw = {} if lora_path is None else {'lora_path': str(lora_path)}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True,
                          verbose=False, **kw)
    llm.eval(list(map(int, tokens)))
    return np.array(llm.scores[:len(tokens)], np.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('adapter', help="an adapter GGUF written by gradus (gradus finetune's)")
    p.add_argument('--gguf', default=None, help='the base model (default: SmolLM2-135M-Instruct)')
    p.add_argument('--text', default='Enter MACBETH and BANQUO.\nMACBETH:\nSo foul and fair')
    a = p.parse_args(argv)
    m = chat.load(chat.model_path(path=a.gguf))
    ids = np.array(m.tokenizer.encode(a.text), np.int64)
    ad, lcfg = adapters.load_adapter(a.adapter, m.params, m.config)
    ours_base = models.forward(m.params, ids, m.config)
    ours_ad = models.forward(lora.attach(m.params, ad, lcfg), ids, m.config)
    theirs_base = llama_cpp_logits(m.path, ids)
    theirs_ad = llama_cpp_logits(m.path, ids, a.adapter)
    dev = lambda x, y: float(np.abs(x - y).max())
    print(f"{len(ids)} tokens; logits up to {np.abs(ours_base).max():.1f}")
    print(f"base:    max |llama.cpp - gradus| = {dev(theirs_base, ours_base):.4f}")
    print(f"adapted: max |llama.cpp - gradus| = {dev(theirs_ad, ours_ad):.4f}")
    print(f"the adapter's effect on gradus's logits: max |adapted - base| = "
          f"{dev(ours_ad, ours_base):.4f}")
    same = (theirs_ad.argmax(-1) == ours_ad.argmax(-1)).mean()
    print(f"next-token argmax agreement, adapted: {same:.0%}")


if __name__ == '__main__':
    main()
