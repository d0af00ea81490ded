"""``block``: block-by-block with a carried state (Lightning Attention 2's block form).

For blocks of C tokens, in order, with S the Dk x Dv state after the previous blocks:

    O_c[t] = gamma^(t+1) q_t S + sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s
    S     <- gamma^C S + sum_s gamma^(C-1-s) k_s^T v_s

Work O(N C (Dk + Dv) + N Dk Dv), memory O(N (Dk + Dv) + C^2 + Dk Dv) per (batch, head).

On a CUDA device (fp32/fp16/bf16, Dk and Dv <= 256) it runs ``block.cu``: one CTA per (batch,
head, tile of value columns), blocks of C = 32 tokens, fp32 FMAs on CUDA cores (the tensor-core
form of the same algorithm is the chunk method).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decay import LogDecay

import functools

from ..autotune.answers import tuned_config
from ..autotune.space import Config, Limits, Problem, Space
from ..jit import dtype_code, get_function, launch
from ._launch import FWD_POINTERS, fwd_args, operands
from ._torch_common import inter_chunk, intra_chunk, state_update, zero_state
from .scan import MAX_DIM, kernel_supports  # noqa: F401  (same limits as the scan kernel)

SOURCE = "block.cu"
_KMAX = (32, 64, 128, 256)
_C = 32

#: Tokens per block of the torch path.
BLOCK = 64


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                  initial_state: Optional[torch.Tensor], need_state: bool):
    state = zero_state(q, v, initial_state)
    outs = []
    for c0 in range(0, q.shape[-2], BLOCK):
        qc, kc, vc = (x[:, :, c0:c0 + BLOCK] for x in (q, k, v))
        outs.append(intra_chunk(qc, kc, vc, log_decay) + inter_chunk(qc, state, log_decay))
        state = state_update(state, kc, vc, log_decay)
    return torch.cat(outs, dim=-2), (state if need_state else None)


def kernel_config(dtype: torch.dtype, dk: int, dv: int) -> tuple[int, int, int, int, int]:
    """Template arguments (DT, KMAX, BV, C, NT) of ``rtk_block_fwd``."""
    kmax = next(c for c in _KMAX if c >= dk)
    bv = 32 if dv <= 32 else 64
    return dtype_code(dtype), kmax, bv, _C, 256


def all_configs() -> list[tuple[int, int, int, int, int]]:
    return sorted({kernel_config(dt, km, dv) for dt in (torch.float32, torch.float16, torch.bfloat16)
                   for km in _KMAX for dv in (32, 64)})


def name_expression(config: tuple[int, ...]) -> str:
    return "rtk_block_fwd<" + ", ".join(str(c) for c in config) + ">"


def smem_bytes(kmax: int, bv: int, c: int) -> int:
    """Dynamic shared memory of ``rtk_block_fwd`` (mirrors rtk_block_smem in block.cu)."""
    return 4 * (2 * c * (kmax + 1) + c * bv + c * (c + 1) + kmax * bv + c)


def _tune_check(p: Problem, config: dict, limits: Limits) -> Optional[str]:
    kmax = kernel_config(p.torch_dtype, p.dk, p.dv)[1]
    if config["bv"] > 32 and p.dv <= 32:
        return "BV wider than Dv"
    need = smem_bytes(kmax, config["bv"], _C)
    return f"needs {need} B of shared memory, the GPU gives {limits.max_smem}" if need > limits.max_smem else None


#: The autotuner's space (rtkernels.autotune): the tile of value columns BV.
TUNE_SPACE = Space(params={"bv": (32, 64)}, default=lambda p, limits: {"bv": kernel_config(p.torch_dtype, p.dk, p.dv)[2]},
                   check=_tune_check)


@functools.lru_cache(maxsize=None)
def _launch_config(dtype: torch.dtype, dk: int, dv: int, tuned: Optional[tuple] = None) -> tuple[str, int, int]:
    config = kernel_config(dtype, dk, dv)
    if tuned:
        config = (config[0], config[1], dict(tuned)["bv"], *config[3:])
    _, kmax, bv, c, nt = config
    return name_expression(config), bv, smem_bytes(kmax, bv, c), nt


def tuned_launch(config: Config, problem: Problem, limits: Limits, *, vec: bool = True,
                 exact: bool = True) -> tuple[str, int, int, int]:
    """The autotuner's adapter: a config of :data:`TUNE_SPACE` (sorted ``(name, value)`` pairs) ->
    (name expression, BV, dynamic shared memory, threads) of ``rtk_block_fwd``. ``vec`` and
    ``exact`` do not concern this kernel."""
    return _launch_config(problem.torch_dtype, problem.dk, problem.dv, config or None)


def instances() -> dict[str, list[str]]:
    """Every template instance this method can ask for, by source (the CI compile test)."""
    return {SOURCE: [name_expression(c) for c in all_configs()]}


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool, fp32_precision: str = "exact") -> Optional[torch.Tensor]:
    """The block kernel (``fp32_precision`` does not concern it: fp32 FMAs)."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    q, k, v, s0, final = operands(q, k, v, initial_state, need_state)
    dev = q.device.index
    name, bv, smem, nt = _launch_config(q.dtype, dk, dv, tuned_config("block", dev, q.dtype, b * h, n, dk, dv) or None)
    fn = get_function(SOURCE, name, dev, dynamic_smem=smem)
    launch(fn, (b * h, -(-dv // bv), 1), (nt, 1, 1), fwd_args(q, k, v, out, log_decay, s0, final, scale),
           dev, shared_mem=smem, pointers=FWD_POINTERS)
    return final
