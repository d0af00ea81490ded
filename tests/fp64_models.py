"""fp64 models for the GPU tests, written independently of the library (torch operations only).

* :func:`masked` -- the masked N x N product with an optional extra exponent per (i, j): the exact
  operator (``extra=None``) or a *mutant*, e.g. a kernel whose chunk carry multiplies the state
  by gamma^(C+1) instead of gamma^C. Every contribution of key j to row i then carries
  ``extra[i, j]`` more factors of gamma (:func:`carry_extra` and friends build them), so the
  mutant's output is a masked product too, and a test can measure how far it is from the truth
  with its own error metric and prove that its tolerance is below that distance.
* :func:`masked_grads` / :func:`masked_log_decay_grad` -- the backward of the same operator in the
  form the kernel backward computes it (three passes of the operator, forward and reversed token
  order), exact or with per-pass mutant exponents.
* :func:`blockwise` -- the recurrence in fp64 blocks on the GPU (the state carried from block to
  block), differentiable: references for sequences where an N x N mask does not fit.
* :func:`decode_step` -- a decode step against a pool of states, token by token.
* :func:`sampled_rows` -- exact fp64 rows ``o_i`` (or, reversed, ``sum_{i>=j}``) for a few sampled
  positions of a very long sequence, by the closed form, streaming over the tokens.

Decay factors are per-head ``[H]`` fp64 tensors in (0, 1]; only non-negative powers are formed.
Inputs are ``[B, H, N, D]`` (bhnd) in any float dtype and are read in fp64.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

F64 = torch.float64


def _log(gamma: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.log(gamma.to(device, F64))


def _power_mask(lg: torch.Tensor, dist: torch.Tensor, weight_by_exponent: bool = False) -> torch.Tensor:
    """``[H, N, N]``: gamma_h^dist where dist >= 0 (times dist with ``weight_by_exponent``), else 0
    (a select, so no power with a negative exponent is ever formed)."""
    d = dist.to(F64)
    p = torch.exp(lg.view(-1, 1, 1) * d.clamp(min=0))
    if weight_by_exponent:
        p = p * d.clamp(min=0)
    return torch.where(d >= 0, p, torch.zeros((), dtype=F64, device=p.device))


def _distance(n: int, device: torch.device, extra: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N, N]`` exponent i - j (+ extra[i, j]) on and below the diagonal, -1 above it."""
    i = torch.arange(n, device=device)
    dist = i[:, None] - i[None, :]
    if extra is not None:
        dist = torch.where(dist >= 0, dist + extra.to(device), dist)
    return dist


def masked(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, gamma: torch.Tensor, scale: float = 1.0,
           extra: Optional[torch.Tensor] = None, reverse: bool = False) -> torch.Tensor:
    """fp64 ``out_i = scale sum_{j<=i} gamma^(i-j+extra[i,j]) (a_i . b_j) c_j`` for ``[B, H, N, D]``
    inputs; with ``reverse`` the sum runs over j >= i with exponent j-i (+ extra[j, i]): the
    operator on the reversed sequence, as the kernel backward's dk and dv passes compute it.
    Work O(B H N^2 D), memory O(H N^2) per batch."""
    dev = a.device
    n = a.shape[2]
    lg = _log(gamma, dev)
    mask = _power_mask(lg, _distance(n, dev, extra))  # [H, N, N], row i, column j <= i
    if reverse:
        mask = mask.transpose(-1, -2)
    out = torch.empty(a.shape[0], a.shape[1], n, c.shape[3], dtype=F64, device=dev)
    for bi in range(a.shape[0]):  # one batch at a time bounds the N x N temporaries
        s = a[bi].to(F64) @ b[bi].to(F64).transpose(-1, -2)
        out[bi] = (s * mask) @ c[bi].to(F64)
    return out * scale


def final_state(k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, extra_to_end: Optional[torch.Tensor] = None,
                step: int = 1 << 17) -> torch.Tensor:
    """fp64 ``S_N = sum_j gamma^(N-1-j+extra_to_end[j]) k_j^T v_j``, ``[B, H, Dk, Dv]``, streaming
    over the tokens ``step`` at a time per (batch, head) (memory O(step D), any N)."""
    b, h, n, dk = k.shape
    lg = _log(gamma, k.device)
    out = torch.zeros(b, h, dk, v.shape[3], dtype=F64, device=k.device)
    for j0 in range(0, n, step):
        j1 = min(n, j0 + step)
        dist = torch.arange(n - 1 - j0, n - 1 - j1, -1, device=k.device, dtype=F64)
        if extra_to_end is not None:
            dist = dist + extra_to_end[j0:j1].to(k.device, F64)
        w = torch.exp(lg.view(-1, 1) * dist)
        for bi in range(b):
            out[bi] += (k[bi, :, j0:j1].to(F64) * w[..., None]).transpose(-1, -2) @ v[bi, :, j0:j1].to(F64)
    return out


# ------------------------------------------------------------------------------- mutants --- #
# A mutant is (extra, extra_to_end): the extra exponents of each contribution to the outputs
# (``[N, N]``, used on and below the diagonal) and to the final state (``[N]``, or None when the
# state is computed elsewhere). Each function below models one plausible wrong power in one place
# of a blocked computation (blocks of ``block`` tokens: the chunk, or the segment of the split
# strategy, or one token for a scan), as the kernels are built: the state entering block c is
# published to the outputs of block c, and the carry gamma^len multiplies the old state when the
# next block's keys are added to it.

def carry_extra(n: int, block: int, device="cuda") -> torch.Tensor:
    """The number of block boundaries between j and i: a power that is off by one at every
    boundary a contribution crosses (the scan kernel's per-token step gamma^2, block = 1)."""
    i = torch.arange(n, device=device)
    return i[:, None] // block - i[None, :] // block


def state_carry(n: int, block: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The state update's carry gamma^(len+1) instead of gamma^len: the state entering block c has
    been carried c - c_j - 1 times since block c_j added key j, the final state c_last - c_j times."""
    i = torch.arange(n, device=device)
    c = i // block
    return (c[:, None] - c[None, :] - 1).clamp(min=0), (c[-1] - c)


def output_factor(n: int, block: int, device="cuda") -> tuple[torch.Tensor, None]:
    """The outputs' factor on the state, gamma^(t+2) q_t S instead of gamma^(t+1): one extra power
    for every key of an earlier block; the state is unaffected."""
    i = torch.arange(n, device=device)
    c = i // block
    return (c[None, :] < c[:, None]).long(), None


def key_weight(n: int, block: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The key weights of the state update, gamma^(len-s) instead of gamma^(len-1-s): one extra
    power for every key, once it is in the state (earlier blocks' outputs, the final state)."""
    i = torch.arange(n, device=device)
    c = i // block
    return (c[None, :] < c[:, None]).long(), torch.ones(n, dtype=torch.long, device=device)


def in_reverse(extra: torch.Tensor) -> torch.Tensor:
    """A mutant of a pass that walks the tokens from N-1 down to 0 (the kernel backward's dk and dv
    passes), given as ``extra`` in that pass's own positions: the ``[N, N]`` matrix indexed
    [i, j] (i >= j, token order) that :func:`masked` with ``reverse=True`` takes. Token x sits at
    position N-1-x of the pass, so the pair (i, j) is the pass's pair (N-1-j, N-1-i)."""
    return extra.flip(0, 1).T


def token_step(n: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """A scan's step gamma^2 S instead of gamma S: every power doubled (outputs and state)."""
    i = torch.arange(n, device=device)
    return carry_extra(n, 1, device), (n - 1 - i)


def segment_carry(n: int, seg_len: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The split strategy's carry between segments (the scan over the segments' states, or the
    fold of the states pass's slots) gamma^(len+1) instead of gamma^len: a key of segment s_j
    reaches segment s_i with s_i - s_j - 1 extra factors, the final state with s_last - s_j - 1."""
    i = torch.arange(n, device=device)
    s = i // seg_len
    return (s[:, None] - s[None, :] - 1).clamp(min=0), (s[-1] - s - 1).clamp(min=0)


def states_pass_carry(n: int, seg_len: int, block: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """A wrong chunk carry inside the split strategy's states-only pass (the state each segment but
    the last ends with): key j of an earlier segment reaches row i, and the final state, with one
    extra factor per chunk boundary between j and the end of j's segment; keys of i's own segment
    and of the last segment are unaffected."""
    i = torch.arange(n, device=device)
    seg = i // seg_len
    seg_last = torch.clamp((seg + 1) * seg_len, max=n) - 1
    inside = seg_last // block - i // block  # chunk boundaries from token j to its segment's end
    out = torch.where(seg[:, None] > seg[None, :], inside[None, :], torch.zeros_like(inside)[None, :])
    return out, torch.where(seg < seg[-1], inside, torch.zeros_like(inside))


def segment_length(n: int, segments: int, chunk: int = 64) -> int:
    """The tokens of one segment when ``n`` tokens are split into ``segments`` (whole chunks each)."""
    return -(-n // (segments * chunk)) * chunk


# -------------------------------------------------------------------------- the backward --- #

def masked_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, gamma: torch.Tensor,
                 scale: float = 1.0, extra_fwd: Optional[torch.Tensor] = None,
                 extra_rev: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``L = sum_i g_i . o_i`` (no initial state, no state gradient) in fp64, as the
    three passes of the kernel backward: dq = F(g, v, k) in token order, dk = R(v, g, q) and
    dv = R(k, q, g) reversed. ``extra_fwd`` / ``extra_rev``: mutant exponents of the forward and
    reversed passes (None: the exact gradient, which equals autograd through the forward)."""
    dq = masked(g, v, k, gamma, scale, extra_fwd)
    # reversed: out_j = sum_{i >= j} gamma^(i-j+extra[i, j]) (a_j . b_i) c_i
    dk = masked(v, g, q, gamma, scale, extra_rev, reverse=True)
    dv = masked(k, q, g, gamma, scale, extra_rev, reverse=True)
    return dq, dk, dv


def masked_log_decay_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          gamma: torch.Tensor, scale: float = 1.0,
                          extra: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[H]`` fp64 dL/dlog(gamma) of ``L = sum_i g_i . o_i``: scale sum over batches and pairs
    j <= i of e gamma^e (q_i . k_j)(g_i . v_j) with e = i - j (+ extra[i, j]: the derivative of a
    mutant that uses its wrong powers consistently)."""
    dev = q.device
    n = q.shape[2]
    w = _power_mask(_log(gamma, dev), _distance(n, dev, extra), weight_by_exponent=True)
    total = torch.zeros(q.shape[1], dtype=F64, device=dev)
    for bi in range(q.shape[0]):
        qk = q[bi].to(F64) @ k[bi].to(F64).transpose(-1, -2)
        gv = g[bi].to(F64) @ v[bi].to(F64).transpose(-1, -2)
        total += (qk * gv * w).sum((-1, -2))
    return total * scale


# ------------------------------------------------------------------------ long sequences --- #

def blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, scale: float = 1.0,
              initial_state: Optional[torch.Tensor] = None, block: int = 256
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state) in fp64 by blocks of ``block`` tokens with the ``[B, H, Dk, Dv]`` state
    carried across (O_c[t] = gamma^(t+1) q_t S + masked block product; S <- gamma^L S + sum_s
    gamma^(L-1-s) k_s^T v_s). Differentiable with respect to every tensor argument (autograd keeps
    O(N / block) states). Work O(N block D + N Dk Dv), on the inputs' device."""
    b, h, n, dk = q.shape
    dev = q.device
    lg = _log(gamma, dev)  # differentiable: a decay that requires grad gets its gradient
    state = (torch.zeros(b, h, dk, v.shape[3], dtype=F64, device=dev) if initial_state is None
             else initial_state.to(F64))
    outs = []
    for c0 in range(0, n, block):
        qc, kc, vc = (x[:, :, c0:c0 + block].to(F64) for x in (q, k, v))
        ln = qc.shape[2]
        t = torch.arange(ln, device=dev, dtype=F64)
        mask = _power_mask(lg, t[:, None] - t[None, :])                      # [H, L, L]
        inter = torch.exp(lg.view(-1, 1) * (t + 1))[..., None]              # [H, L, 1]
        outs.append(((qc @ kc.transpose(-1, -2)) * mask) @ vc + inter * (qc @ state))
        to_end = torch.exp(lg.view(-1, 1) * (ln - 1 - t))[..., None]        # [H, L, 1]
        state = torch.exp(lg * ln).view(-1, 1, 1) * state + (kc * to_end).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2) * scale, state


def sampled_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, gamma: torch.Tensor, rows: Sequence[int],
                 scale: float = 1.0, reverse: bool = False, initial_state: Optional[torch.Tensor] = None,
                 step: int = 1 << 17) -> torch.Tensor:
    """Exact fp64 rows of the operator for the positions ``rows`` of a long sequence, ``[B, H, R, Dc]``:
    ``scale (gamma^(i+1) a_i S_0 + sum_{j<=i} gamma^(i-j) (a_i . b_j) c_j)`` (``reverse``: the sum
    over j >= i with gamma^(j-i), no initial state), streaming over the tokens ``step`` at a time
    (memory O(step (D + R)) per (batch, head), work O(N R D)). The reference for the sampled rows
    of the long-sequence tests: it shares nothing with a chunked computation."""
    dev = a.device
    n = a.shape[2]
    lg = _log(gamma, dev)
    idx = torch.as_tensor(list(rows), device=dev, dtype=torch.long)
    out = torch.zeros(a.shape[0], a.shape[1], len(rows), c.shape[3], dtype=F64, device=dev)
    lo, hi = (int(idx.min()), n) if reverse else (0, int(idx.max()) + 1)
    for bi in range(a.shape[0]):
        for hi_ in range(a.shape[1]):
            ar = a[bi, hi_, idx].to(F64)                                     # [R, D]
            acc = torch.zeros(len(rows), c.shape[3], dtype=F64, device=dev)
            for j0 in range(lo, hi, step):
                j = torch.arange(j0, min(hi, j0 + step), device=dev)
                dist = (j[:, None] - idx[None, :]) if reverse else (idx[None, :] - j[:, None])   # [J, R]
                w = torch.where(dist >= 0, torch.exp(lg[hi_] * dist.clamp(min=0).to(F64)),
                                torch.zeros((), dtype=F64, device=dev))
                scores = b[bi, hi_, j0:j0 + len(j)].to(F64) @ ar.T               # [J, R]
                acc += (scores * w).T @ c[bi, hi_, j0:j0 + len(j)].to(F64)
            if initial_state is not None and not reverse:
                acc += torch.exp(lg[hi_] * (idx + 1).to(F64))[:, None] * (ar @ initial_state[bi, hi_].to(F64))
            out[bi, hi_] = acc
    return out * scale


def log_decay_grad_long(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, gamma: torch.Tensor,
                        scale: float = 1.0, block: int = 2048) -> torch.Tensor:
    """``[H]`` fp64 dL/dlog(gamma) of ``L = sum_i g_i . o_i`` for a long sequence, from two fp64
    blockwise passes: d o_i / dlog(gamma) = sum_j (i-j) gamma^(i-j) (q_i . k_j) v_j
    = i o_i - F(q, k, j v_j)_i, so dL/dlog(gamma) = sum_i g_i . (i o_i - F(q, k, j v)_i)
    (the subtraction loses about log10(N) of fp64's 16 digits). Memory O(B H (N/block) Dk Dv)
    beyond one block; no N x N matrix."""
    n = q.shape[2]
    with torch.no_grad():
        total = torch.zeros(q.shape[1], dtype=F64, device=q.device)
        for bi in range(q.shape[0]):
            for hh in range(q.shape[1]):
                sl = (slice(bi, bi + 1), slice(hh, hh + 1))
                qs, ks, vs, gs = (x[sl] for x in (q, k, v, g))
                gam = gamma.to(q.device, F64)[hh:hh + 1]
                o, _ = blockwise(qs, ks, vs, gam, scale, block=block)
                pos = torch.arange(n, device=q.device, dtype=F64).view(1, 1, n, 1)
                jo, _ = blockwise(qs, ks, vs.to(F64) * pos, gam, scale, block=block)
                total[hh] += (gs.to(F64) * (pos * o - jo)).sum()
        return total


def decode_step(q, k, v, pool, gamma, scale, indices, layout="bhnd"):
    """A decode step against a pool of states, token by token in fp64 on q's device:
    ``(output in layout, pool after the step)``. Sequence b advances row ``indices[b]`` (None: row
    b; a sequence, list or tensor of ints) by S <- gamma S + k_t^T v_t, o_t = scale q_t S; a row
    outside [0, S) is padding (zero output, no row touched)."""
    if layout == "bnhd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.double() for x in (q, k, v))
    new = pool.to(q.device, torch.float64).clone()
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.float64, device=q.device)
    g = torch.as_tensor(gamma).to(q.device, torch.float64).view(-1, 1, 1)
    rows = range(q.shape[0]) if indices is None else (indices.tolist() if torch.is_tensor(indices) else indices)
    for b, row in enumerate(rows):
        if not 0 <= row < new.shape[0]:
            continue
        state = new[row]
        for t in range(q.shape[2]):
            state = g * state + k[b, :, t, :, None] * v[b, :, t, None, :]
            out[b, :, t] = scale * torch.einsum("hk,hkv->hv", q[b, :, t], state)
        new[row] = state
    return (out if layout == "bhnd" else out.transpose(1, 2)), new
