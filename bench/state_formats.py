"""The measurement that chose the 8-bit state format (docs/performance.md, "Choosing the 8-bit
format"): candidate formats simulated in torch (float32, values rounded to each map's nearest
value, or stochastically), on the same tests for every candidate.

    python bench/state_formats.py              # the LAMB and LARS tables
    python bench/state_formats.py --quick      # a 512 x 512 weight instead of 1024 x 1024

Columns: the accuracy test of fusedopt/tools/lowp_accuracy.py (relative distance of a 50-step
run's movement from full state's, worst of 2 seeds, noise-only and signal+noise gradients); for
LAMB the zero-point test (one element per 256 with gradient 1, the others 1e-6: φ against full
state's), outliers (one element per 256 1e4 and 3e4 times the others: movement error of all
elements) and the decay of half of each block (the stored v after a 10x drop of half of each
block's gradients, against full state's); for LARS the others' movement error beside outliers
(1e4, 3e4). A candidate is a map for each moment, what the first moment stores (``m``, or the
direction ``d = m / (√v + ε)``), and whether the step uses the stored values (as the trust ratio
needs) or the unrounded ones (as the peers do).
"""
from __future__ import annotations

import argparse
import math

import torch


# ------------------------------------------------------------------------------ maps
class Table:
    """A map given by its magnitudes in [0, 1] (relative to the block's largest |x|), to the
    nearest value or stochastically between the two around it; ``signed``: a sign and these."""

    def __init__(self, mags, signed=True):
        self.mags = torch.tensor(sorted(set(float(m) for m in mags)), dtype=torch.float32)
        self.mid = (self.mags[1:] + self.mags[:-1]) / 2
        self.signed = signed

    def __call__(self, x, block, gen=None):
        n = x.numel()
        xb = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block)
        a = xb.abs().amax(1, keepdim=True)
        r = torch.where(a > 0, xb.abs() / a, torch.zeros_like(xb)).clamp(max=1)
        if gen is None:
            y = self.mags[torch.bucketize(r, self.mid)]
        else:
            hi = torch.bucketize(r, self.mags).clamp(max=len(self.mags) - 1)
            lo = (hi - 1).clamp(min=0)
            up, down = self.mags[hi], self.mags[lo]
            p = torch.where(up > down, (r - down) / (up - down), torch.zeros_like(r))
            y = torch.where(torch.rand(r.shape, generator=gen) < p, up, down)
        return (torch.where(xb < 0, -y, y) * a).reshape(-1)[:n]


def minifloat(ebits, mbits, zero=True, subnormal=False):
    vals = [2.0 ** e * (1 + j / 2 ** mbits) for e in range(-(2 ** ebits) + 1, 1)
            for j in range(2 ** mbits)]
    if subnormal:
        vals += [2.0 ** (-(2 ** ebits) + 1) * j / 2 ** mbits for j in range(1, 2 ** mbits)]
    top = max(vals)
    vals = sorted(v / top for v in vals)
    return ([0.0] if zero else []) + vals[-(127 if zero else 256):]


def dynamic(base, signed=True):
    """The decades of ``base`` below 1, 2^(6-t) parts (signed; twice that unsigned) in decade t,
    each at its part's mean; bitsandbytes' dynamic map is base 10."""
    vals = [0.0, 1.0]
    for t in range(7):
        parts = 2 ** (6 - t) * (1 if signed else 2)
        lo, hi = base ** -(t + 1), base ** -t
        edges = [lo + (hi - lo) * k / parts for k in range(parts + 1)]
        vals += [(u + w) / 2 for u, w in zip(edges, edges[1:])]
    return vals[:128] if signed else vals


class Bits:
    """A root map by the float bit pattern, linear between the block's largest and its smallest
    nonzero value (at most 24 octaves down), 254 steps of a power of 2 (fusedopt's root map)."""

    signed = False

    def __call__(self, x, block, gen=None):
        n = x.numel()
        b = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block).contiguous()
        b = b.view(torch.int32).to(torch.int64)
        top = b.amax(1, keepdim=True)
        low = torch.where(b > 0, b, torch.full_like(b, 1 << 40)).amin(1, keepdim=True)
        low = torch.maximum(torch.where(low == 1 << 40, top, low), top - (24 << 23))
        sh = sum(((top - low) > (254 << k)).to(torch.int64) for k in range(21))
        r = ((1 << sh) >> 1 if gen is None else
             (torch.rand(b.shape, generator=gen, dtype=torch.float64) * (1 << sh)).to(torch.int64))
        k = ((top - b + r) >> sh).clamp(max=254)
        y = (top - (k << sh)).clamp(min=0).to(torch.int32).view(torch.float32)
        return torch.where(b == 0, 0.0, y).reshape(-1)[:n]


MAPS = {
    "E4M3": Table(minifloat(4, 3)), "E2M5": Table(minifloat(2, 5, subnormal=True)),
    "linear": Table([k / 127 for k in range(128)]), "dynamic (base 10)": Table(dynamic(10)),
    "dynamic (base 8)": Table(dynamic(8)), "dynamic (base 16)": Table(dynamic(16)),
    "root E4M4": Table(minifloat(4, 4, zero=False), signed=False),
    "root E3M5": Table(minifloat(3, 5, zero=False), signed=False),
    "root linear": Table([k / 256 for k in range(1, 257)], signed=False),
    "v dynamic (base 10)": Table(dynamic(10, signed=False), signed=False),
    "root bits": Bits(),
}


# ------------------------------------------------------------------------- optimizers
def lamb(fmt, w0, grad, steps=50, lr=1e-3, b1=0.9, b2=0.999, eps=1e-6, wd=0.01, seed=0):
    """LAMB (docs/math.md) with state in the candidate ``fmt`` (None: full): (final weight,
    stored v)."""
    w, e_prev = w0.clone().reshape(-1), 0.0
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    gen = torch.Generator().manual_seed(1000 + seed)
    for t in range(1, steps + 1):
        g = grad(t).reshape(-1)
        r1, r2 = 1 / (1 - b1 ** t), 1 / math.sqrt(1 - b2 ** t)
        e = eps / r2
        if fmt is None:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            u = m * r1 / (v.sqrt() * r2 + eps) + wd * w
        else:
            mm = m * (v + e_prev) if fmt["store"] == "d" else m
            vv = v * v if fmt["root"] else v
            mm = b1 * mm + (1 - b1) * g
            vv = b2 * vv + (1 - b2) * g * g
            sr = gen if fmt["sr"] else None
            if fmt["root"]:
                v = fmt["v"](vv.sqrt(), fmt["block"], sr)
                s = v
            else:
                v = fmt["v"](vv, fmt["block"], sr)
                s = v.sqrt()
            if fmt["store"] == "d":
                m = fmt["m"](mm / (s + e), fmt["block"])
                e_prev = e
                u = m * (r1 / r2) + wd * w
            elif fmt["stored_step"]:
                m = fmt["m"](mm, fmt["block"])
                u = m * r1 / (s * r2 + eps) + wd * w
            else:
                u = mm * r1 / (vv.sqrt() * r2 + eps) + wd * w
                m = fmt["m"](mm, fmt["block"])
        wn, un = float(w.norm()), float(u.norm())
        phi = 1.0 if wn == 0 or un == 0 else wn / un
        w = w - lr * phi * u
        last = (phi, v if fmt is None or not fmt["root"] else v * v)
    return w.view_as(w0), last


def lars(fmt, w0, grad, steps=50, lr=0.1, mu=0.9, wd=1e-4, kappa=1e-3, eps=1e-8, adapt=True,
         seed=0):
    w = w0.clone().reshape(-1)
    buf = torch.zeros_like(w)
    for t in range(1, steps + 1):
        g = grad(t).reshape(-1)
        wn, gn = float(w.norm()), float(g.norm())
        ratio = kappa * wn / (gn + wd * wn + eps) if adapt else 1.0
        buf = mu * buf + lr * ratio * (g + wd * w)
        step = buf
        if fmt is not None:
            buf = fmt["m"](buf, fmt["block"])
            if fmt["stored_step"]:
                step = buf
        w = w - step
    return w.view_as(w0)


def cand(m, v=None, store="m", root=True, sr=False, stored_step=True, block=256):
    return dict(m=MAPS[m], v=MAPS[v] if v else None, store=store, root=root, sr=sr,
                stored_step=stored_step, block=block)


LAMB = {
    "m E4M3, √v E4M4 SR (the earlier format)": cand("E4M3", "root E4M4", sr=True),
    "m E4M3, √v E4M4 to nearest": cand("E4M3", "root E4M4"),
    "peers' maps (dynamic m, dynamic v), u from stored": cand(
        "dynamic (base 10)", "v dynamic (base 10)", root=False),
    "peers' maps, u from the unrounded moments": cand(
        "dynamic (base 10)", "v dynamic (base 10)", root=False, stored_step=False),
    "m E2M5, √v E3M5": cand("E2M5", "root E3M5"),
    "m linear, √v by bits SR": cand("linear", "root bits", sr=True),
    "d E4M3, √v E4M4": cand("E4M3", "root E4M4", store="d"),
    "d linear, √v E3M5": cand("linear", "root E3M5", store="d"),
    "d linear, √v linear": cand("linear", "root linear", store="d"),
    "d linear, √v by bits, to nearest": cand("linear", "root bits", store="d"),
    "d linear, √v by bits SR (chosen)": cand("linear", "root bits", store="d", sr=True),
    "d linear, √v by bits SR, blocks of 128": cand("linear", "root bits", store="d", sr=True,
                                                  block=128),
    "d linear, √v by bits SR, blocks of 2048": cand("linear", "root bits", store="d", sr=True,
                                                   block=2048),
    "d dynamic (base 8), √v by bits SR": cand("dynamic (base 8)", "root bits", store="d",
                                              sr=True),
}
LARS = {
    "E4M3, step from stored (the earlier format)": cand("E4M3"),
    "dynamic (base 10, the peers'), step from stored": cand("dynamic (base 10)"),
    "dynamic (base 10), step from the unrounded buffer": cand("dynamic (base 10)",
                                                              stored_step=False),
    "linear, step from the unrounded buffer": cand("linear", stored_step=False),
    "E2M5, step from the unrounded buffer": cand("E2M5", stored_step=False),
    "dynamic (base 16), step from the unrounded buffer": cand("dynamic (base 16)",
                                                              stored_step=False),
    "dynamic (base 8), step from the unrounded buffer (chosen)": cand("dynamic (base 8)",
                                                                      stored_step=False),
}


# ------------------------------------------------------------------------------ tests
def gradients(shape, seed, scale=None, signal=False):
    gen0 = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=gen0)
    sig = torch.randn(shape, generator=gen0) * 0.3 if signal else None
    gen, cache = torch.Generator().manual_seed(seed + 1), {}

    def grad(t):
        if t not in cache:
            g = torch.randn(shape, generator=gen)
            g = g * scale if scale is not None else g
            cache[t] = g + sig if sig is not None else g
        return cache[t]
    return w0, grad


def rel(a, b):
    return float((b - a).norm() / a.norm())


def accuracy(run, fmt, shape, signal):
    errs = []
    for seed in (0, 1):
        w0, grad = gradients(shape, seed, signal=signal)
        full = run(None, w0, grad, seed=seed)
        full = full[0] if isinstance(full, tuple) else full
        got = run(fmt, w0, grad, seed=seed)
        got = got[0] if isinstance(got, tuple) else got
        errs.append(rel(full - w0, got - w0))
    return max(errs)


def outliers(run, fmt, factor, rest_only, **kw):
    n = 256 * 64
    scale = torch.ones(n)
    scale[::256] = factor
    w0, grad = gradients((n,), 0, scale=scale)
    a = run(None, w0, grad, **kw)
    b = run(fmt, w0, grad, **kw)
    a, b = (x[0] if isinstance(x, tuple) else x for x in (a, b))
    keep = scale == 1 if rest_only else torch.ones(n, dtype=torch.bool)
    return rel((a - w0)[keep], (b - w0)[keep])


def zero_point(fmt, tiny=1e-6):
    w0 = torch.randn(4096, generator=torch.Generator().manual_seed(7))
    gen, cache = torch.Generator().manual_seed(8), {}

    def grad(t):
        if t not in cache:
            g = torch.randn(4096, generator=gen) * tiny
            g[::256] = 1.0
            cache[t] = g
        return cache[t]
    return lamb(fmt, w0, grad, steps=5, wd=0.0)[1][0] / lamb(None, w0, grad, steps=5, wd=0.0)[1][0]


def decay_of_half(fmt, before=200, after=500):
    n = 8192
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(6))
    drop = (torch.arange(n) % 256) >= 128
    gen, cache = torch.Generator().manual_seed(5), {}

    def grad(t):
        if t not in cache:
            g = torch.randn(n, generator=gen)
            cache[t] = torch.where(drop & (t > before), g * 0.1, g)
        return cache[t]
    steps = before + after
    got = lamb(fmt, w0, grad, steps=steps, lr=1e-4)[1][1][drop].mean()
    return float(got / lamb(None, w0, grad, steps=steps, lr=1e-4)[1][1][drop].mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 512 x 512 weight")
    args = ap.parse_args()
    shape = (512, 512) if args.quick else (1024, 1024)
    print(f"LAMB, a {shape[0]} x {shape[1]} weight\n")
    print("| candidate | noise | signal+noise | φ / fp32 at 1e-6 | outliers 1e4 | 3e4 | "
          "v / fp32, half decays |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, fmt in LAMB.items():
        cols = [accuracy(lamb, fmt, shape, False), accuracy(lamb, fmt, shape, True)]
        cols += [zero_point(fmt), outliers(lamb, fmt, 1e4, False), outliers(lamb, fmt, 3e4, False),
                 decay_of_half(fmt)]
        print(f"| {name} | {cols[0]:.2e} | {cols[1]:.2e} | {cols[2]:.3f} | {cols[3]:.3f} | "
              f"{cols[4]:.3f} | {cols[5]:.3f} |", flush=True)
    print(f"\nLARS, a {shape[0]} x {shape[1]} weight (outliers: momentum SGD, lr 1e-4, the others' "
          "movement)\n")
    print("| candidate | noise | signal+noise | others beside 1e4 | 3e4 |\n|---|---:|---:|---:|---:|")
    for name, fmt in LARS.items():
        cols = [accuracy(lars, fmt, shape, False), accuracy(lars, fmt, shape, True),
                *(outliers(lars, fmt, f, True, lr=1e-4, adapt=False, wd=0.0) for f in (1e4, 3e4))]
        print(f"| {name} | {cols[0]:.2e} | {cols[1]:.2e} | {cols[2]:.3f} | {cols[3]:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
