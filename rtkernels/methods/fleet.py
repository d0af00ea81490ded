"""``fleet``: FleetAttention, rank by rank (LeetDecoding's FleetAttention method).

(Q K^T) ⊙ M = sum_r diag(q_{:,r}) L_gamma diag(k_{:,r}), so for each rank r = 0 .. Dk-1 a
discounted prefix sum of the value rows

    y_{i,r} = gamma y_{i-1,r} + k_{i,r} v_i           (a Dv-vector per rank)
    o_i     = scale * sum_r q_{i,r} y_{i,r}

The ranks and value columns are independent; the sum over r is a fixed-order reduction.
Work O(N Dk Dv), memory O(N (Dk + Dv) + C Dk Dv) per (batch, head). The torch path runs the
prefix sums C tokens at a time as a product with the C x C decay matrix L_gamma.

On a CUDA device (fp32/fp16/bf16, Dk and Dv <= 256) the ranks run in tiles of ``RANK_TILE`` on
separate CTAs (the state-scan kernel of ``scan.cu``, each CTA scanning its ranks' prefix sums for a
tile of value columns), and ``fleet.cu`` adds the tiles' partial outputs in a fixed order: no
atomics, the same bits on every run. The workspace is fp32 ``[Dk / RANK_TILE, B, H, N, Dv]``.
With Dk <= RANK_TILE there is one tile and the kernel is the scan kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decay import LogDecay

from ..autotune.answers import tuned_config
from ..autotune.space import Config, Limits, Problem, Space
from ..jit import dtype_code, get_function, launch
from . import scan
from ._torch_common import causal_apply, causal_decay_matrix, decay_powers, zero_state

SOURCE = "fleet.cu"
#: State rows (ranks) per CTA of the kernel path.
RANK_TILE = 64

#: Tokens per step of the torch path (its memory is C * Dk * Dv per (batch, head)).
BLOCK = 16


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    y = zero_state(q, v, initial_state).reshape(b, h, 1, dk * dv)  # row r of the state is y_r
    outs = []
    for c0 in range(0, n, BLOCK):
        qc, kc, vc = (x[:, :, c0:c0 + BLOCK] for x in (q, k, v))
        c = qc.shape[-2]
        x = (kc[..., :, None] * vc[..., None, :]).reshape(b, h, c, dk * dv)  # k_{s,r} v_s
        y_all = causal_apply(causal_decay_matrix(log_decay, c), x) + decay_powers(log_decay, c, start=1) * y
        outs.append(torch.einsum("bhtr,bhtrd->bhtd", qc, y_all.view(b, h, c, dk, dv)))
        y = y_all[:, :, -1:]
    state = y.reshape(b, h, dk, dv) if need_state else None
    return torch.cat(outs, dim=-2), state


kernel_supports = scan.kernel_supports
MAX_DIM = scan.MAX_DIM  # the scan kernel's limit on Dk and Dv


def all_configs() -> list[tuple[int]]:
    return [(dtype_code(dt),) for dt in (torch.float32, torch.float16, torch.bfloat16)]


def name_expression(config: tuple[int, ...]) -> str:
    return f"rtk_fleet_reduce<{config[0]}>"


#: The autotuner's space (rtkernels.autotune): state rows (ranks) per CTA.
TUNE_SPACE = Space(params={"rank_tile": (32, 64, 128)},
                   default=lambda p, limits: {"rank_tile": RANK_TILE},
                   check=lambda p, c, limits: "no more rows than Dk" if c["rank_tile"] > max(32, p.dk) else None)


def tuned_launch(config: Config, problem: Problem, limits: Limits, *, vec: bool = True,
                 exact: bool = True) -> int:
    """The autotuner's adapter: a config of :data:`TUNE_SPACE` (sorted ``(name, value)`` pairs) ->
    the rank tile (state rows per CTA of the scan kernel). ``vec`` and ``exact`` do not concern it."""
    return dict(config)["rank_tile"]


def instances() -> dict[str, list[str]]:
    """Every template instance this method can ask for, by source: the reduction here and the scan
    kernel's instances (the CI compile test)."""
    return {SOURCE: [name_expression(c) for c in all_configs()], **scan.instances()}


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool, fp32_precision: str = "exact") -> Optional[torch.Tensor]:
    """Rank tiles on separate CTAs, then the fixed-order reduction over tiles (``fp32_precision``
    does not concern them: fp32 FMAs)."""
    tuned = tuned_config("fleet", q.get_device(), q.dtype, q.shape[0] * q.shape[1], q.shape[2], q.shape[3],
                         v.shape[3])
    partial, final = scan.launch_state_scan(q, k, v, log_decay, scale, out, initial_state, need_state,
                                            rank_tile=dict(tuned)["rank_tile"] if tuned else RANK_TILE)
    if partial is not None:
        tiles, bh, n, dv = partial.shape
        dev = q.device.index
        fn = get_function(SOURCE, name_expression((dtype_code(q.dtype),)), dev)
        total = bh * n * dv
        blocks = min(-(-total // 256), 65535)
        args = (partial.data_ptr(), out.data_ptr(), tiles, bh, q.shape[1], n, dv, scale, *out.stride()[:3])
        launch(fn, (blocks, 1, 1), (256, 1, 1), args, dev, pointers=2)  # partial, out; then rtk_fleet_shape
    return final
