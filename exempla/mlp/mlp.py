"""A 100-step MLP training run written out step by step: explicit optimizer state, no loop helper.

Three interleaved spirals (3 classes, 512 points), an MLP 2 -> 32 -> 32 -> 3 with tanh, softmax
cross-entropy, minibatches of 64, gradients clipped to global norm 0.5, AdamW (weight decay 0.01 on
the matrices only) under a warmup-cosine schedule (peak 3e-2, 10 warmup steps, floor 1e-3). The same
run is made in float32 (the real one) and float64; tests/test_mlp_reference.py replays it with a
hand-written numpy forward and backward pass.

Run: python exempla/mlp/mlp.py
"""
import numpy as np
import gradus as gd
from gradus.learn import loss, nn, optim, random, train
from gradus.core import tensor as T

SEED, STEPS, BATCH, SIZES = 0, 100, 64, (2, 32, 32, 3)
PEAK_LR, WARMUP, FLOOR_LR, WEIGHT_DECAY, CLIP = 3e-2, 10, 1e-3, 0.01, 0.5


def data(n=512):
    "Three interleaved noisy spirals: x (n, 2) float64, labels (n,) int64."
    r = random.rng(random.key(SEED + 1))
    c = r.integers(0, 3, n)
    s = r.uniform(0.1, 1.0, n)
    a = 4 * s + c * 2 * np.pi / 3 + r.normal(0, 0.15, n)
    return np.stack([s * np.cos(a), s * np.sin(a)], 1), c


def batch_indices(step, n=512):
    "The rows of step `step`'s minibatch: (BATCH,) int64, drawn from the key of that step."
    return random.rng(random.fold_in(random.key(SEED + 2), step)).integers(0, n, BATCH)


def init_params(dtype):
    "Glorot-uniform weights and zero biases, drawn in float64 from the run's key, cast to `dtype`."
    return nn.mlp_init(random.key(SEED), list(SIZES), dtype=dtype)


def objective(params, x, y):
    "Mean cross-entropy (nats) of the tanh MLP on a batch."
    return loss.cross_entropy(nn.mlp(params, x, T.tanh), y)


def run(dtype=np.float32, steps=STEPS, verbose=False):
    """Train for `steps` steps in `dtype`; returns (params, per-step batch losses, final full-data
    loss)."""
    x, y = data()
    x = x.astype(dtype)
    params = init_params(dtype)
    schedule = optim.warmup_cosine(PEAK_LR, WARMUP, steps, floor=FLOOR_LR)
    opt = optim.adamw(schedule, weight_decay=WEIGHT_DECAY, mask=optim.decay_mask)
    state = opt.init(params)
    value_and_grad = gd.value_and_grad(objective)
    losses = []
    for t in range(steps):
        idx = batch_indices(t)
        value, grads = value_and_grad(params, x[idx], y[idx])
        grads, norm = optim.clip_by_global_norm(grads, CLIP)
        params, state = opt.update(grads, state, params)
        losses.append(float(value))
        if verbose and (t % 10 == 0 or t == steps - 1):
            print(f"  step {t:3d}  batch loss {float(value):.6f}  grad norm {norm:.4f}  "
                  f"lr {opt.learning_rate(t):.2e}")
    final = float(objective(params, x, y))
    return params, losses, final


def main():
    _, _, f32 = run(np.float32, verbose=True)
    params, _, f64 = run(np.float64)
    x, y = data()
    acc = train.accuracy(nn.mlp(params, x, T.tanh), y)
    print(f"final full-data loss after {STEPS} steps: float32 {f32:.9f}  float64 {f64:.12f}  "
          f"relative difference {abs(f32 - f64) / f64:.1e}  (float64 accuracy {acc:.3f})")


if __name__ == '__main__':
    main()
