# The generated backward of one small layer: trace, differentiate, check.
import numpy as np
import gradus as gd
from gradus.core import tensor as T

def f(x, w):
    "A scalar from one tanh layer: the sum of squared activations."
    return T.sum(T.tanh(x @ w) ** 2)

rng = np.random.default_rng(0)
x = rng.normal(size=(4, 3)).astype(np.float32)   # (B, D_in)
w = rng.normal(size=(3, 2)).astype(np.float32)   # (D_in, D_out)

print("1. the traced graph of f:")
print(gd.trace(f, x, w))
print()
print("2. the code grad(f, argnums=1) compiled (forward, then backward):")
print(gd.show_code(gd.grad(f, argnums=1), x, w))
print()
h = np.tanh(x @ w)                           # (B, D_out)
by_hand = x.T @ (2 * h * (1 - h * h))        # dL/dw = xᵀ (2h ⊙ (1 − h²))
gw = gd.grad(f, argnums=1)(x, w)
print("3. generated gradient = chain rule by hand",
      "(float32, rtol 1e-5):", np.allclose(gw, by_hand, rtol=1e-5, atol=1e-6))
