# The smallest useful gradus program: fit a line with a generated gradient.
import numpy as np
import gradus as gd
from gradus.core import ops

rng = np.random.default_rng(0)
x = rng.normal(size=(200, 2))                       # (N, 2) inputs
w_true, b_true = np.array([2.0, -3.0]), 0.5
y = x @ w_true + b_true + 0.01 * rng.normal(size=200)  # (N,) noisy targets

def loss(params):
    "Mean squared error of the line `x @ w + b`: a pure function."
    return ops.mean((x @ params['w'] + params['b'] - y) ** 2)

params = {'w': np.zeros(2), 'b': np.zeros(())}
value_and_grad = gd.value_and_grad(loss)  # traced and compiled on 1st call
for step in range(100):
    value, grads = value_and_grad(params)
    params = gd.tree_map(lambda p, g: p - 0.1 * g, params, grads)

print(f"loss after 100 steps: {float(value):.6f}")
print(f"fitted w: {np.round(params['w'], 3)}   true w: {w_true}")
print(f"fitted b: {float(params['b']):.3f}           true b: {b_true}")
print("gradient vs float64 finite differences:",
      gd.check_grads(loss, (params,)) <= 1)
