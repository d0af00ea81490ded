"""Scratch (CPU, no rtkernels import): why dL/dlog(gamma) is not taken from the finished gradients.

With G_i = i log(gamma), dL/dG_i = q_i . dq_i - k_i . dk_i, so dL/dlog(gamma) would be
sum_i i (q_i . dq_i - k_i . dk_i): one dot per row in each pass, no second state. Both sums grow
with the position i while their difference grows with the distance i - j, so the 16-bit state
copies' rounding in dq and dk is multiplied by about N / distance. This emulates that form with the
intra-chunk pairs exact (as the kernels have them) and the inter-chunk parts from 16-bit copies,
centred positions or not, next to the Z split with Z kept in 16 bits (today's 128-wide pass), and
prints the largest error relative to |dL/dlog(gamma)| over three random problems of N tokens.

    python bench/profiling/dlog_global_positions.py [N]
"""
import math
import sys

import torch

from dlog_split_check import dense_grad  # the fp64 reference
from dlog_split_precision import F32, chunk_bounds, copy16, intra, z_form


def global_form(q, k, v, g, s0, G, gamma, scale, C, dt, centred=True):
    """sum_i p_i Dq_i - sum_j p_j Dk_j + (N - 1 - K) <G, S_N> + (1 + K) <s0, A_0> + intra, where
    Dq_i, Dk_j are row i's and key j's inter-chunk sums (state copies in 16 bits) and p = i - K."""
    gm = torch.tensor(gamma, dtype=F32)
    n = q.shape[0]
    K = (n - 1) / 2 if centred else 0.0
    bounds = chunk_bounds(n, C)
    S, total = s0.clone(), torch.zeros(())
    for lo, hi in bounds:
        L, t = hi - lo, torch.arange(hi - lo, dtype=F32)
        dq = scale * (q[lo:hi] * ((gm ** (t + 1))[:, None] * (g[lo:hi] @ copy16(S, dt).T))).sum(1)
        total += ((lo + t - K) * dq).sum()
        S = gm ** L * S + ((gm ** (L - 1 - t))[:, None] * k[lo:hi]).T @ v[lo:hi]
    total += (n - 1 - K) * (G * S).sum()
    A = G.clone()
    for lo, hi in reversed(bounds):
        L, t = hi - lo, torch.arange(hi - lo, dtype=F32)
        dk = (gm ** (hi - 1 - (lo + t)))[:, None] * (v[lo:hi] @ copy16(A, dt).T)
        total -= ((lo + t - K) * (k[lo:hi] * dk).sum(1)).sum()
        total += intra(q, k, v, g, lo, hi, gm, scale)
        A = gm ** L * A + scale * ((gm ** (t + 1))[:, None] * q[lo:hi]).T @ g[lo:hi]
    return float(total + (1 + K) * (s0 * A).sum())


def main() -> None:
    torch.manual_seed(1)
    n, dk, dv, C = int(sys.argv[1]) if len(sys.argv) > 1 else 512, 64, 64, 64
    scale = 1 / math.sqrt(dk)
    for dt in (F32, torch.bfloat16, torch.float16):
        print(str(dt).replace("torch.", ""))
        for gamma in (1e-6, 0.5, 0.9, 0.99, 0.999, 1.0):
            errs = {"z16": [], "centred": [], "plain": []}
            for _ in range(3):
                q, k, v, g = (torch.randn(n, d).to(dt).float() for d in (dk, dk, dv, dv))
                s0, G = torch.randn(dk, dv) * 0.1, torch.randn(dk, dv) * 0.1
                want = dense_grad(*(x.double() for x in (q, k, v, g, s0, G)), gamma, scale)
                got = {"z16": z_form(q, k, v, g, s0, G, gamma, scale, C, dt, z16=True),
                       "centred": global_form(q, k, v, g, s0, G, gamma, scale, C, dt),
                       "plain": global_form(q, k, v, g, s0, G, gamma, scale, C, dt, centred=False)}
                for name, x in got.items():
                    errs[name].append(abs(x - want) / abs(want))
            print(f"  gamma {gamma:<6g} Z kept in 16 bits {max(errs['z16']):.1e}, global positions "
                  f"{max(errs['plain']):.1e}, centred {max(errs['centred']):.1e}")


if __name__ == "__main__":
    main()
