"""An independent float32 numpy Gemma 3 (text decoder) for testing `gradus.lm.models`.

Written from the architecture's description, sharing no code with gradus: the GGUF is read with the
`gguf` package's `GGUFReader` and every tensor decoded with `gguf.quants.dequantize`. The forward is
the one described by the Gemma 3 technical report (Gemma Team, 2025) and by Hugging Face's
`Gemma3ForCausalLM`, on the tensors as llama.cpp's converter wrote them:

- token embedding times √dim (`Gemma3TextScaledWordEmbedding`; llama.cpp's gemma3 graph scales by
  `sqrtf(n_embd)`), then per block: RMSNorm -> attention -> RMSNorm (post) -> residual add,
  RMSNorm -> GeGLU MLP -> RMSNorm (post) -> residual add; final RMSNorm; logits through the tied
  embedding, with no soft-capping (Gemma 3 dropped Gemma 2's; `final_logit_softcapping=None`);
- RMSNorm `x / √(mean(x²) + ε) · g` with the stored gain `g`: the converter stored `1 + w` for
  Gemma's `(1 + w)` parameterisation (`Gemma3Model.modify_tensors` adds 1 to every `*norm.weight`);
- attention: each query and key head RMSNormed over its 256 features (`q_norm`, `k_norm`), then
  rotated by RoPE pairing feature `i` with `i + d/2` (rotate-half; llama.cpp's gemma3 RoPE type is
  NEOX and its converter does not permute Gemma's Q/K rows), scores scaled by
  `query_pre_attn_scalar ** -0.5`, which is the head size (256) in the 270M's config as in
  every Gemma 3 but the 27B (llama.cpp: `1/√n_embd_head_k`), softmax over the visible keys, one
  KV head shared by the 4 query heads;
- five local layers to one global (`sliding_window_pattern = 6`: layer `i` is global when
  `(i + 1) % 6 == 0`; llama.cpp `set_swa_pattern(6)`); a local layer's query at position `p` sees
  keys at positions `p - W < k <= p` (W = 512 from the file) and rotates with base 10,000
  (`rope_local_base_freq`; llama.cpp `rope_freq_base_train_swa`); a global layer sees all keys
  `k <= p` and rotates with the file's base (1e6);
- MLP `down(gelu_tanh(gate(h)) * up(h))` (`hidden_activation = "gelu_pytorch_tanh"`; llama.cpp
  `LLM_FFN_GELU` + `LLM_FFN_PAR`).

The window is applied here by comparing absolute positions of every key kept so far (the cache
keeps all of them), not by dropping rows.
"""

import numpy as np

import gguf

GLOBAL_EVERY = 6
LOCAL_ROPE_BASE = 10000.0


def _field(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]].item()


def _gelu_tanh(x):
    c, a = np.float32(np.sqrt(2 / np.pi)), np.float32(0.044715)
    return 0.5 * x * (1 + np.tanh(c * (x + a * x**3)))


class Gemma3:
    """Float32 weights of every tensor in the file; `logits` of independent sequences and their
    greedy continuations, the sequences of a batch sharing each weight read."""

    def __init__(self, path, reader=None):
        "`reader`: a `gguf.GGUFReader` of `path` already made (tests/_models.reader), or None."
        self.reader = r = reader if reader is not None else gguf.GGUFReader(str(path))
        a = 'gemma3'
        key = lambda k: _field(r, f'{a}.{k}')
        self.n_layers, self.dim = key('block_count'), key('embedding_length')
        self.n_heads, self.n_kv = key('attention.head_count'), key('attention.head_count_kv')
        self.hd = key('attention.key_length')
        self.eps = np.float32(key('attention.layer_norm_rms_epsilon'))
        self.window, base = key('attention.sliding_window'), key('rope.freq_base')
        self.w = {
            t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            for t in r.tensors
        }
        self.is_global = [(i + 1) % GLOBAL_EVERY == 0 for i in range(self.n_layers)]
        half = np.arange(0, self.hd, 2, dtype=np.float64) / self.hd
        self.inv_freq = [
            np.tile((base if g else LOCAL_ROPE_BASE) ** -half, 2) for g in self.is_global
        ]  # (hd,): feature i and i + hd/2 share a frequency
        self.scale = np.float32(self.hd**-0.5)  # query_pre_attn_scalar = head size

    def rms(self, x, g):
        ms = (x.astype(np.float64) ** 2).mean(-1, keepdims=True).astype(np.float32)
        return x / np.sqrt(ms + self.eps) * g

    def rope(self, x, pos, layer):
        "Rotate-half RoPE of `x` (heads, T, hd) at absolute positions `pos` (T,)."
        ang = pos[:, None].astype(np.float64) * self.inv_freq[layer][None, :]  # (T, hd)
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        h = self.hd // 2
        other = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
        return x * cos + other * sin

    def new_state(self):
        "Per layer: every key, value kept so far, and their absolute positions."
        empty = np.zeros((self.n_kv, 0, self.hd), np.float32)
        return [[empty, empty, np.zeros(0, np.int64)] for _ in range(self.n_layers)]

    def attend(self, layer, q, k, v, pos, state):
        "q (H, T, hd), k and v (Hkv, T, hd) of positions `pos`, appended to `state[layer]`."
        s = state[layer]
        s[0], s[1] = np.concatenate([s[0], k], 1), np.concatenate([s[1], v], 1)
        s[2] = np.concatenate([s[2], pos])
        back = pos[:, None] - s[2][None, :]  # (T, n): how far back each kept key lies
        visible = back >= 0
        if not self.is_global[layer]:
            visible &= back < self.window
        rep = self.n_heads // self.n_kv
        K, V = np.repeat(s[0], rep, 0), np.repeat(s[1], rep, 0)  # (H, n, hd)
        z = np.where(visible, (q * self.scale) @ K.transpose(0, 2, 1), -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        out = (p / p.sum(-1, keepdims=True)).astype(np.float32) @ V  # (H, T, hd)
        return out.transpose(1, 0, 2).reshape(len(pos), self.n_heads * self.hd)

    def hidden(self, batch):
        """Final normed hidden states [(T_j, dim)] of `batch = [(ids, state, first position)]`."""
        w, E = self.w, self.w['token_embd.weight']
        ids = [np.asarray(b[0], np.int64) for b in batch]
        ends = np.cumsum([len(t) for t in ids])
        spans = [(e - len(t), e) for t, e in zip(ids, ends)]
        x = E[np.concatenate(ids)] * np.float32(np.sqrt(self.dim))
        for i in range(self.n_layers):
            b = f'blk.{i}.'
            h = self.rms(x, w[b + 'attn_norm.weight'])
            Q, K, V = (h @ w[b + f'attn_{n}.weight'].T for n in 'qkv')
            outs = []
            for (_, state, p0), (lo, hi) in zip(batch, spans):
                T, pos = hi - lo, np.arange(p0, p0 + hi - lo)
                q = Q[lo:hi].reshape(T, self.n_heads, self.hd).transpose(1, 0, 2)
                k = K[lo:hi].reshape(T, self.n_kv, self.hd).transpose(1, 0, 2)
                v = V[lo:hi].reshape(T, self.n_kv, self.hd).transpose(1, 0, 2)
                q = self.rope(self.rms(q, w[b + 'attn_q_norm.weight']), pos, i)
                k = self.rope(self.rms(k, w[b + 'attn_k_norm.weight']), pos, i)
                outs.append(self.attend(i, q, k, v, pos, state))
            a = np.concatenate(outs) @ w[b + 'attn_output.weight'].T
            x = x + self.rms(a, w[b + 'post_attention_norm.weight'])
            h = self.rms(x, w[b + 'ffn_norm.weight'])
            m = _gelu_tanh(h @ w[b + 'ffn_gate.weight'].T) * (h @ w[b + 'ffn_up.weight'].T)
            x = x + self.rms(m @ w[b + 'ffn_down.weight'].T, w[b + 'post_ffw_norm.weight'])
        x = self.rms(x, w['output_norm.weight'])
        return [x[lo:hi] for lo, hi in spans]

    def logits(self, rows):
        "Logits (n, vocab) of hidden states (n, dim) through the tied embedding."
        return rows @ self.w['token_embd.weight'].T

    def run(self, prompts, n_new):
        """For each prompt (1-D ids, from position 0): `(last-position logits (vocab,), its n_new
        greedy tokens)`. The prompts run together, then their greedy steps side by side."""
        states = [self.new_state() for _ in prompts]
        hs = self.hidden([(p, s, 0) for p, s in zip(prompts, states)])
        last = self.logits(np.stack([h[-1] for h in hs]))  # (n_prompts, vocab)
        first, outs = last.copy(), [[] for _ in prompts]
        for step in range(n_new):
            for o, z in zip(outs, last):
                o.append(int(np.argmax(z)))
            if step == n_new - 1:
                break
            batch = [([o[-1]], s, len(p) + step) for o, s, p in zip(outs, states, prompts)]
            last = self.logits(np.concatenate(self.hidden(batch)))
        return [(z, o) for z, o in zip(first, outs)]
