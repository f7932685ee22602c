"""Fit y = 2*x0 - x1 + 0.5 by gradient descent through gradus.grad and print the learned values.

Run: python exempla/regression/regression.py
"""
import numpy as np
import gradus as gd
from gradus import tensor as T


def loss(params, x, y):
    "Mean squared error of the linear model x @ w + b; x: (n, 2) float32, y: (n,) float32."
    return T.mean((x @ params['w'] + params['b'] - y) ** 2)


def main(steps=200, lr=0.1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 2)).astype(np.float32)
    y = (2 * x[:, 0] - x[:, 1] + 0.5).astype(np.float32)
    params = {'w': np.zeros(2, np.float32), 'b': np.zeros((), np.float32)}
    value_and_grad = gd.value_and_grad(loss)
    for step in range(steps + 1):
        value, grads = value_and_grad(params, x, y)
        if step % 50 == 0: print(f"step {step:3d}  loss {float(value):.6f}")
        params = gd.tree_map(lambda p, g: p - lr * g, params, grads)
    w0, w1 = params['w']
    print(f"learned: w0={w0:.3f} w1={w1:.3f} b={float(params['b']):.3f}  (true: w0=2.000 w1=-1.000 b=0.500)")
    return params


if __name__ == '__main__':
    main()
