"""Fit y = 2*x0 - x1 + 0.5 by minibatch SGD (batches of 8); print each epoch's loss and the fit.

Run: python exempla/regression/regression.py
"""
import numpy as np
import gradus as gd
from gradus.learn import loss, nn, optim, random, train


def model(params, x):
    "The linear model `x @ w + b`: x (n, 2) float32 -> (n, 1) float32."
    return nn.linear(params, x)


def objective(params, x, y):
    "Mean squared error of the model on a batch; y (n, 1) float32."
    return loss.mse(model(params, x), y)


def main(epochs=10, batch_size=8, lr=0.05, seed=0, verbose=True):
    k_data, k_init, k_shuffle = random.split(random.key(seed), 3)
    x = random.rng(k_data).standard_normal((256, 2)).astype(np.float32)
    y = (2 * x[:, :1] - x[:, 1:] + 0.5).astype(np.float32)   # (256, 1): the shape the model outputs
    params = nn.linear_init(k_init, 2, 1)
    opt = optim.sgd(lr)
    state = opt.init(params)
    value_and_grad = gd.value_and_grad(objective)
    for epoch in range(epochs):
        losses = []
        for xb, yb in train.batches(random.fold_in(k_shuffle, epoch), (x, y), batch_size):
            value, grads = value_and_grad(params, xb, yb)
            params, state = opt.update(grads, state, params)
            losses.append(float(value))
        if verbose: print(f"epoch {epoch + 1:2d}  mean batch loss {np.mean(losses):.3e}")
    (w0,), (w1,) = params['w']
    b = params['b'][0]
    if verbose:
        print(f"learned: w0={w0:.3f} w1={w1:.3f} b={b:.3f}  (true: w0=2.000 w1=-1.000 b=0.500)  "
              f"after {int(state['step'])} SGD steps of batch {batch_size}")
    return params


if __name__ == '__main__':
    main()
