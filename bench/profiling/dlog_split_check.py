"""Scratch (CPU, fp64, no rtkernels import): checks the "Z split" of dL/dlog(gamma) that
docs/design.md proposes for the backward, against autograd through a dense reference.

One head, tokens 0..N-1 in consecutive chunks (any lengths; t_c the first token of chunk c, L_c its
length), a_ij = (q_i . k_j)(g_i . v_j) with g = dL/do, loss L = sum_i g_i . o_i + <G, S_{N-1}>, the
initial state S0 a token at position -1. For a pair j < i in different chunks,
i - j = (i - t_{c_i}) + (t_{c_j + 1} - j) + (the lengths of the chunks strictly between), so

    dL/dlog(gamma) = intra + EA + MID + EB + <S0, dS0> + TG,

every weight non-negative:
- intra: sum over pairs in one chunk of (i - j) gamma^(i-j) a_ij (the dk/dv pass holds both
  score matrices of a chunk);
- EA: sum_i (i - t_{c_i}) q_i . dq_i', dq_i' the part of dq_i from earlier chunks (dq pass);
- MID: scale sum_i gamma^(i - t_{c_i}) q_i Z_{c_i} g_i^T with Z_0 = 0,
  Z_{c+1} = gamma^(L_c) (Z_c + L_c P_c), P_c = sum_{j < t_c} gamma^(t_c - j) k_j^T v_j
  + gamma^(t_c + 1) S0: W's step without its second weighted product of k and v;
- EB: sum_j w_j k_j . dk_j', dk_j' the part of dk_j from later chunks and from G, w_j =
  t_{c_j + 1} - j, or N - 1 - j in the last chunk (dk/dv pass);
- TG: gamma^(L_l - 1) <G, Z_l + (L_l - 1) P_l> for the last chunk l.

Both chunk grids are checked: from token 0 (the dq pass's today) and ending at token N-1 (the
reversed dk/dv pass's), which the two passes must share.

    python bench/profiling/dlog_split_check.py
"""
import torch

F64 = torch.float64


def dense_grad(q, k, v, g, s0, G, gamma, scale):
    """dL/dlog(gamma) by autograd through the masked N x N product."""
    a = torch.tensor(gamma, dtype=F64).log().requires_grad_()
    n = q.shape[0]
    pos = torch.arange(n, dtype=F64)
    lag = pos[:, None] - pos[None, :]
    mask = torch.where(lag >= 0, torch.exp(a * lag.clamp(min=0)), torch.zeros((), dtype=F64))
    o = scale * ((q @ k.T) * mask) @ v + scale * torch.exp(a * (pos + 1))[:, None] * (q @ s0)
    s_end = (torch.exp(a * (n - 1 - pos))[:, None] * k).T @ v + torch.exp(a * n) * s0
    (d,) = torch.autograd.grad((g * o).sum() + (G * s_end).sum(), a)
    return float(d)


def split_grad(q, k, v, g, s0, G, gamma, scale, bounds):
    """The same derivative as the sum of the split's six terms over the chunks ``bounds`` (a list
    of (start, end) covering 0..N-1 in order; any lengths)."""
    n = q.shape[0]
    pw = lambda e: torch.as_tensor(gamma, dtype=F64) ** torch.as_tensor(e, dtype=F64)  # noqa: E731
    tok = torch.arange(n)
    chunk = torch.empty(n, dtype=torch.long)
    for c, (lo, hi) in enumerate(bounds):
        chunk[lo:hi] = c
    start = torch.tensor([bounds[c][0] for c in chunk.tolist()])
    nxt = torch.tensor([bounds[c][1] for c in chunk.tolist()])
    nc = len(bounds)
    lag = (tok[:, None] - tok[None, :]).to(F64)
    causal_w = torch.where(lag >= 0, pw(lag.clamp(min=0)), torch.zeros((), dtype=F64))
    a = (q @ k.T) * (g @ v.T)
    same = chunk[:, None] == chunk[None, :]
    intra = scale * (torch.where(same, lag, torch.zeros((), dtype=F64)) * causal_w * a).sum()
    P = [(pw(lo - tok[:lo])[:, None] * k[:lo]).T @ v[:lo] + pw(lo + 1) * s0 for lo, _ in bounds]
    # Z_c = sum_{m<c} len_m gamma^(t_c - t_m) P_m: Z <- gamma^L (Z + L P), W's step without its product
    Z = [torch.zeros_like(s0)]
    for c in range(nc - 1):
        L = bounds[c][1] - bounds[c][0]
        Z.append(pw(L) * (Z[c] + L * P[c]))
    off = pw(tok - start)  # gamma^(i - t_{c_i})
    dq_early = scale * off[:, None] * torch.stack([g[i] @ P[int(chunk[i])].T for i in range(n)])
    ea = ((tok - start).to(F64) * (q * dq_early).sum(1)).sum()
    mid = scale * sum(off[i] * (q[i] @ Z[int(chunk[i])] @ g[i]) for i in range(n))
    later = tok[:, None] >= nxt[None, :]  # [i, j]: i in a chunk after j's
    dk_late = scale * ((torch.where(later, causal_w, torch.zeros((), dtype=F64)) * (g @ v.T)).T @ q)
    dk_late = dk_late + pw(n - 1 - tok)[:, None] * (v @ G.T)
    w = torch.where(chunk == nc - 1, n - 1 - tok, nxt - tok).to(F64)
    eb = (w * (k * dk_late).sum(1)).sum()
    ds0 = scale * (pw(tok + 1)[:, None] * q).T @ g + pw(n) * G
    t_l = bounds[-1][0]
    L_l = n - t_l
    tg = pw(L_l - 1) * (G * (Z[-1] + (L_l - 1) * P[-1])).sum()
    return float(intra + ea + mid + eb + (s0 * ds0).sum() + tg)


def grid(n, C, end_aligned):
    """Chunks of C from token 0 (the last one short), or ending at token N-1 (the first short)."""
    if not end_aligned:
        return [(lo, min(lo + C, n)) for lo in range(0, n, C)]
    first = (n - 1) % C + 1
    return [(0, first)] + [(lo, lo + C) for lo in range(first, n, C)]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [(1, 64, 8, 5, 0.9, 0.3), (63, 64, 8, 5, 0.99, 1.0), (64, 64, 6, 7, 0.5, 0.7), (65, 64, 6, 7, 0.999, 1.0),
             (200, 64, 5, 3, 0.97, 0.3), (300, 16, 4, 6, 1.0, 0.5), (257, 32, 4, 4, 1e-6, 1.0), (130, 8, 3, 3, 0.8, 2.0)]
    for n, C, dk, dv, gamma, scale in cases:
        for with_s0 in (False, True):
            for with_g in (False, True):
                q, k = (torch.randn(n, dk, dtype=F64, generator=gen) for _ in range(2))
                v, g = (torch.randn(n, dv, dtype=F64, generator=gen) for _ in range(2))
                s0, G = (torch.randn(dk, dv, dtype=F64, generator=gen) * on for on in (with_s0, with_g))
                want = dense_grad(q, k, v, g, s0, G, gamma, scale)
                for end_aligned in (False, True):
                    got = split_grad(q, k, v, g, s0, G, gamma, scale, grid(n, C, end_aligned))
                    assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (n, C, gamma, with_s0, with_g, want, got)
        print(f"N {n:4d} C {C:2d} Dk {dk} Dv {dv} gamma {gamma:g}: split = autograd ({want:.6g}), both chunk grids")


if __name__ == "__main__":
    main()
