"""Scratch (CPU, no rtkernels import): the accuracy of dL/dlog(gamma) by today's W form and by the
proposed Z split (docs/design.md; bench/profiling/dlog_split_check.py checks the identity), each
emulated in float32 with the kernels' 16-bit copies of the states (S, W or Z, and the dk/dv pass's
adjoint state; fp16 copies scaled by a power of two as the kernels do) and fp32 scores, against
fp64 on the same 16-bit inputs. A third column keeps Z itself only in 16 bits (stepped from S's
16-bit copy and rounded after every step, as a pass would that holds no fp32 Z: design.md, "Next: a
128-wide Z dq pass"). Prints the largest
relative error over a few random problems of N tokens (default 512).

    python bench/profiling/dlog_split_precision.py [N]
"""
import math

import torch

from dlog_split_check import dense_grad  # the fp64 reference, autograd through the dense form

F32, F64 = torch.float32, torch.float64


def copy16(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """x as a 16-bit state copy holds it (fp16: times 2^e with max |x| 2^e near 2^14)."""
    if dt == F32:
        return x
    m = float(x.abs().max())
    if dt == torch.float16 and 0 < m < math.inf:
        e = math.floor(14 - math.log2(m))
        return (x * 2.0 ** e).to(dt).float() * 2.0 ** -e
    return x.to(dt).float()


def chunk_bounds(n, C):
    return [(lo, min(lo + C, n)) for lo in range(0, n, C)]


def intra(q, k, v, g, lo, hi, gm, scale):
    t = torch.arange(hi - lo, dtype=F32)
    lag = t[:, None] - t[None, :]
    p = scale * torch.where(lag >= 0, gm ** lag.clamp(min=0), torch.zeros(())) * (g[lo:hi] @ v[lo:hi].T)
    return (lag.clamp(min=0) * p * (q[lo:hi] @ k[lo:hi].T)).sum()


def w_form(q, k, v, g, s0, G, gamma, scale, C, dt):
    """Today's DLOG dq pass: S and W carried forward, their copies against g, intra from fp32 scores."""
    gm = torch.tensor(gamma, dtype=F32)
    S, W, total = s0.clone(), torch.zeros_like(s0), torch.zeros(())
    for lo, hi in chunk_bounds(q.shape[0], C):
        L, t = hi - lo, torch.arange(hi - lo, dtype=F32)
        f = gm ** (t + 1)
        total += scale * (q[lo:hi] * ((f * (t + 1))[:, None] * (g[lo:hi] @ copy16(S, dt).T)
                                      + f[:, None] * (g[lo:hi] @ copy16(W, dt).T))).sum()
        total += intra(q, k, v, g, lo, hi, gm, scale)
        wk = gm ** (L - 1 - t)
        W = gm ** L * (W + L * S) + ((L - 1 - t) * wk)[:, None].mul(k[lo:hi]).T @ v[lo:hi]
        S = gm ** L * S + (wk[:, None] * k[lo:hi]).T @ v[lo:hi]
    return float(total + (G * W).sum())


def z_form(q, k, v, g, s0, G, gamma, scale, C, dt, z16=False):
    """The Z split: dq pass (S and Z copies, weights t and C, G at the last chunk), dk/dv pass
    (adjoint copy, edge weights, intra from fp32 scores), <S0, dS0>. ``z16``: Z is stored in 16
    bits only, stepped from the 16-bit copy of S and rounded after each step."""
    gm = torch.tensor(gamma, dtype=F32)
    bounds = chunk_bounds(q.shape[0], C)
    S, Z, total = s0.clone(), torch.zeros_like(s0), torch.zeros(())
    for c, (lo, hi) in enumerate(bounds):
        L, t = hi - lo, torch.arange(hi - lo, dtype=F32)
        f = gm ** (t + 1)
        total += scale * (q[lo:hi] * ((f * t)[:, None] * (g[lo:hi] @ copy16(S, dt).T)
                                      + (C * f)[:, None] * (g[lo:hi] @ copy16(Z, dt).T))).sum()
        if c == len(bounds) - 1:
            total += (G * (gm ** L * (C * Z + (L - 1) * S))).sum()
        if z16:  # stepped from the S copy, then rounded: what a pass holding no fp32 Z can do
            Z = copy16(gm ** L * (Z + copy16(S, dt)), dt)
        else:
            Z = gm ** L * (Z + S)
        S = gm ** L * S + ((gm ** (L - 1 - t))[:, None] * k[lo:hi]).T @ v[lo:hi]
    A = G.clone()  # dL/d(state after the chunk's last token)
    for c in range(len(bounds) - 1, -1, -1):
        lo, hi = bounds[c]
        L, t = hi - lo, torch.arange(hi - lo, dtype=F32)
        dk_late = (gm ** (hi - 1 - (lo + t)))[:, None] * (v[lo:hi] @ copy16(A, dt).T)
        w = (L - 1 - t) if c == len(bounds) - 1 else (L - t)
        total += (w * (k[lo:hi] * dk_late).sum(1)).sum()
        total += intra(q, k, v, g, lo, hi, gm, scale)
        A = gm ** L * A + scale * ((gm ** (t + 1))[:, None] * q[lo:hi]).T @ g[lo:hi]
    return float(total + (s0 * A).sum())


def main() -> None:
    import sys

    torch.manual_seed(1)
    n, dk, dv, C = int(sys.argv[1]) if len(sys.argv) > 1 else 512, 32, 48, 64
    scale = 1 / math.sqrt(dk)
    for dt in (F32, torch.bfloat16, torch.float16):
        print(str(dt).replace("torch.", ""), "(float32: the emulation's own error)" if dt == F32 else "")
        for gamma in (1e-6, 0.5, 0.9, 0.99, 0.999, 1.0):
            errs = {"W": [], "Z": [], "Z16": []}
            for _ in range(3):
                q, k, v, g = (torch.randn(n, d).to(dt).float() for d in (dk, dk, dv, dv))
                s0, G = torch.randn(dk, dv) * 0.1, torch.randn(dk, dv) * 0.1
                want = dense_grad(*(x.double() for x in (q, k, v, g, s0, G)), gamma, scale)
                for name, got in (("W", w_form(q, k, v, g, s0, G, gamma, scale, C, dt)),
                                  ("Z", z_form(q, k, v, g, s0, G, gamma, scale, C, dt)),
                                  ("Z16", z_form(q, k, v, g, s0, G, gamma, scale, C, dt, z16=True))):
                    errs[name].append(abs(got - want) / abs(want))
            print(f"  gamma {gamma:<6g} largest relative error: W form {max(errs['W']):.1e}, Z split "
                  f"{max(errs['Z']):.1e}, Z kept in 16 bits {max(errs['Z16']):.1e}")


if __name__ == "__main__":
    main()
