"""One training step (forward, backward, AdamW) of the Shakespeare GPT: gradus vs PyTorch eager.

Same model (nanoGPT's CPU Shakespeare-char configuration: block 64, batch 12, 4 layers, 4 heads,
width 128, vocabulary 65, tied head), same optimizer settings, same thread count, measured in one
run. PyTorch is used only when it is importable (it is not a gradus dependency). Prints both medians
and their ratio.

Run: python exempla/benchmarks/gpt_step.py [--threads N] [--steps 30]
"""
import argparse, os, platform, time
import numpy as np


def gradus_step_fn(cfg, seed=0):
    import gradus as gd
    from gradus import gpt, random, optim, loss as L
    mcfg = gpt.GPTConfig(cfg['vocab'], cfg['block'], cfg['layers'], cfg['heads'], cfg['width'])
    params = gpt.init(random.key(seed), mcfg)
    opt = optim.adamw(1e-3, betas=(0.9, 0.99), weight_decay=0.1, mask=optim.decay_mask)
    state = {'params': params, 'opt': opt.init(params)}
    vg = gd.value_and_grad(lambda p, x, y: L.cross_entropy(gpt.apply(p, x, mcfg), y))
    def step(x, y):
        loss, g = vg(state['params'], x, y)
        g, _ = optim.clip_by_global_norm(g, 1.0)
        state['params'], state['opt'] = opt.update(g, state['opt'], state['params'])
        return float(loss)
    return step


def torch_step_fn(cfg, seed=0):
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F
    torch.manual_seed(seed)
    C, H, V, Tb = cfg['width'], cfg['heads'], cfg['vocab'], cfg['block']

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(C), tnn.LayerNorm(C)
            self.qkv, self.proj = tnn.Linear(C, 3 * C), tnn.Linear(C, C)
            self.fc, self.fc2 = tnn.Linear(C, 4 * C), tnn.Linear(4 * C, C)
        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
            future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            att = att.masked_fill(future, float('-inf')).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate='tanh'))

    class GPT(tnn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = tnn.Embedding(V, C), tnn.Embedding(Tb, C)
            self.blocks = tnn.ModuleList(Block() for _ in range(cfg['layers']))
            self.ln_f = tnn.LayerNorm(C)
        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks: x = b(x)
            logits = self.ln_f(x) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, V), targets.view(-1))

    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{'params': decay, 'weight_decay': 0.1}, {'params': rest, 'weight_decay': 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), foreach=True)
    def step(x, y):
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())
    return step


def median_ms(step, batches, warmup=3):
    for x, y in batches[:warmup]: step(x, y)
    ts = []
    for x, y in batches[warmup:]:
        t0 = time.perf_counter(); step(x, y); ts.append(time.perf_counter() - t0)
    return 1000 * float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--threads', type=int, default=os.cpu_count())
    ap.add_argument('--steps', type=int, default=30)
    a = ap.parse_args()
    from threadpoolctl import threadpool_limits
    threadpool_limits(a.threads)
    cfg = dict(vocab=65, block=64, batch=12, layers=4, heads=4, width=128)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 65, (12, 64)), rng.integers(0, 65, (12, 64)))
               for _ in range(a.steps + 3)]
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} threads={a.threads} "
          f"numpy={np.__version__}")
    g = median_ms(gradus_step_fn(cfg), batches)
    print(f"gradus  median {g:7.1f} ms/step (value_and_grad compiled + clip + AdamW)")
    try:
        import torch
    except ImportError:
        print("torch not importable: no comparator this run"); return
    torch.set_num_threads(a.threads)
    t = median_ms(torch_step_fn(cfg), batches)
    print(f"torch   median {t:7.1f} ms/step (PyTorch {torch.__version__} eager, "
          f"{torch.get_num_threads()} threads)")
    print(f"ratio gradus/torch: {g / t:.2f}x")


if __name__ == '__main__':
    main()
