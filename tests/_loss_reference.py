"""Independent references for the losses: exact decimal arithmetic (Python's `decimal`, 80
significant digits), written from the definitions, sharing no code with `gradus.learn.loss`.

Each function takes float arrays (any float dtype; each value is read exactly) and returns Python
`Decimal`s: the value and the gradient of the *sum* over rows/elements (divide by the count for a
mean)."""
from decimal import Context, Decimal, localcontext

import numpy as np

# no traps: exp overflows to Infinity and underflows to 0
CTX = Context(prec=80, Emin=-10**17, Emax=10**17, traps=[])
NAN, INF = Decimal('NaN'), Decimal('Infinity')


def dec(v):
    "The exact decimal value of a float (±inf kept)."
    return Decimal(float(v))


def ln1p(t):
    "log(1 + t) for 0 <= t, keeping relative accuracy when t is tiny (series) or huge."
    with localcontext(CTX):
        if t == 0: return Decimal(0)
        if t.adjusted() < -30:
            return t - t * t / 2 + t * t * t / 3       # error below t**4 < 1e-120 t
        return (1 + t).ln()


def ce_row(z, y):
    """`-log softmax(z)[y]` of one row of logits and its gradient `softmax(z) - onehot(y)`, exactly.

    Written with a reference point `r`, the largest finite logit: `p_j = e_j / Σe` with `e_j =
    exp(z_j - r)` (one e_j is 1, the rest is the tail). Returns `(loss, [g_j])`; NaN for a row
    without a finite logit."""
    with localcontext(CTX):
        d = [dec(v) for v in z]
        finite = [v for v in d if v.is_finite()]
        if not finite: return NAN, [NAN] * len(d)
        r = max(finite)
        k = d.index(r)
        e = [(v - r).exp() if v.is_finite() else Decimal(0) for v in d]
        tail = sum(e[j] for j in range(len(d)) if j != k)
        loss = ln1p(tail) - (d[y] - r) if d[y].is_finite() else INF
        s = 1 + tail
        g = [e[j] / s for j in range(len(d))]
        g[y] = -sum(e[j] for j in range(len(d)) if j != y) / s       # p_y - 1 without cancellation
        return loss, g


def ce_condition(z, y):
    """The error a faithful float computation may make, per unit roundoff: for the value, `L + |z_y
    - r| + Σ p_k |z_k - r|`; for each gradient entry, `|g_j| (1 + |z_j - r| + Σ p_k |z_k - r|)` (the
    target entry uses the largest |z_j - r| among the other classes). Differences from `r` count as
    the problem's data, so two equal logits of 1e4 must give ln 2 to a few ulps."""
    loss, g = ce_row(z, y)
    with localcontext(CTX):
        d = [dec(v) for v in z]
        r = max(v for v in d if v.is_finite())
        p = [abs(gj) for gj in g]
        p[y] = abs(g[y] + 1)
        dist = [abs(v - r) if v.is_finite() else Decimal(0) for v in d]
        spread = sum(pk * dk for pk, dk in zip(p, dist))
        val = (loss if loss.is_finite() else 0) + dist[y] + spread
        other = max([dist[j] for j in range(len(d)) if j != y and p[j] > 0], default=Decimal(0))
        gc = [abs(g[j]) * (1 + (other if j == y else dist[j]) + spread) for j in range(len(d))]
        return float(val), np.array([float(c) for c in gc])


def bce(x, t):
    """`-t log σ(x) - (1 - t) log(1 - σ(x))` and its derivatives `(σ(x) - t, -x)`, exactly, for one
    element. Uses `log(1 + e^x) = x + log(1 + e^-x)`; ±inf logits give the limits."""
    with localcontext(CTX):
        xd, td = dec(x), dec(t)
        if xd.is_infinite():
            pos = xd > 0
            w = 1 - td if pos else td                      # weight of |x| in the loss
            loss = INF if w > 0 else Decimal(0)
            return loss, ((1 - td) if pos else -td), None
        a = -abs(xd)
        e = a.exp()                                         # exp(-|x|) <= 1
        lin = xd * (1 - td) if xd > 0 else -xd * td
        loss = lin + ln1p(e)
        sig_minus_t = (1 - td) - e / (1 + e) if xd > 0 else e / (1 + e) - td
        return loss, sig_minus_t, -xd
