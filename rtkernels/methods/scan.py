"""``scan``: the sequential state scan (LeetDecoding's causal_dot_product method).

    S_i = gamma S_{i-1} + k_i^T v_i,      o_i = scale * q_i S_i       (S: Dk x Dv, fp32)

Work O(N Dk Dv), memory O(Dk Dv) beyond inputs and output, but N sequential steps.
On a CUDA device with CuPy, fp32/fp16/bf16 inputs with Dk, Dv <= 256 run the ``scan.cu`` kernel
(one CTA per batch, head and tile of value columns, state in registers, fp32 throughout);
float64 inputs, larger heads and CPU tensors run the torch path below.
"""

from __future__ import annotations

from typing import Optional

import functools

import torch

from ..decay import LogDecay

from ..autotune.answers import tuned_config
from ..autotune.space import Config, Limits, Problem, Space
from ..jit import dtype_code, get_function, launch
from ._launch import FWD_POINTERS, fwd_args, operands
from ._torch_common import zero_state

SOURCE = "scan.cu"
#: Largest Dk and Dv the kernel takes.
MAX_DIM = 256
_KMAX = (32, 64, 128, 256)


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                  initial_state: Optional[torch.Tensor], need_state: bool):
    """Token by token; gamma * S is formed as S + (gamma - 1) S with gamma - 1 = expm1(log gamma)."""
    b, h, n, _ = q.shape
    state = zero_state(q, v, initial_state)
    dm1 = torch.expm1(log_decay).view(-1, 1, 1)
    o = torch.empty(b, h, n, v.shape[-1], dtype=q.dtype, device=q.device)
    for i in range(n):
        state = state + dm1 * state + k[:, :, i, :, None] * v[:, :, i, None, :]
        o[:, :, i] = (q[:, :, i, None, :] @ state)[:, :, 0]
    return o, (state if need_state else None)


def kernel_config(dtype: torch.dtype, rows: int) -> tuple[int, int, int, int, int]:
    """Template arguments (DT, KMAX, BV, T, NT) of ``rtk_scan_fwd`` for ``rows`` state rows per CTA."""
    kmax = next(c for c in _KMAX if c >= rows)
    t = 8 if kmax == 256 else 16
    nt = 256 if kmax >= 128 else 128
    return dtype_code(dtype), kmax, 32, t, nt


def static_smem_bytes(kmax: int, bv: int, t: int, nt: int) -> int:
    """Static shared memory of ``rtk_scan_fwd`` (sq, sk, sv, spart in scan.cu)."""
    return 4 * (2 * t * kmax + t * bv + (nt // bv) * t * (bv + 1))


def _tune_default(p: Problem, limits: Limits) -> dict:
    """Today's heuristic (``kernel_config``) as a tuning config."""
    _, _, _, t, nt = kernel_config(p.torch_dtype, p.dk)
    return {"t": t, "nt": nt}


def _tune_valid(kmax: int, t: int, nt: int, static_limit: int = 48 * 1024) -> Optional[str]:
    bv = 32
    if nt % bv or kmax % (nt // bv):
        return f"{nt} threads do not split {kmax} state rows"
    if static_smem_bytes(kmax, bv, t, nt) > static_limit:
        return f"needs {static_smem_bytes(kmax, bv, t, nt)} B of static shared memory"
    return None


def _tune_check(p: Problem, config: dict, limits: Limits) -> Optional[str]:
    if config["nt"] > limits.max_threads:
        return f"{config['nt']} threads per CTA"
    return _tune_valid(kernel_config(p.torch_dtype, p.dk)[1], config["t"], config["nt"], limits.static_smem)


#: The autotuner's space (rtkernels.autotune): tokens per staged group T and threads per CTA NT;
#: KMAX follows Dk, BV is 32.
TUNE_SPACE = Space(params={"t": (8, 16), "nt": (128, 256)}, default=_tune_default, check=_tune_check)


def all_configs() -> list[tuple[int, int, int, int, int]]:
    """Every template instance :func:`kernel_config` or :data:`TUNE_SPACE` can ask for (the CI
    compile test uses it)."""
    dts = (torch.float32, torch.float16, torch.bfloat16)
    tuned = {(dtype_code(dt), km, 32, t, nt) for dt in dts for km in _KMAX for t in TUNE_SPACE.params["t"]
             for nt in TUNE_SPACE.params["nt"] if _tune_valid(km, t, nt) is None}
    return sorted({kernel_config(dt, km) for dt in dts for km in _KMAX} | tuned)


def name_expression(config: tuple[int, ...]) -> str:
    return "rtk_scan_fwd<" + ", ".join(str(c) for c in config) + ">"


def kernel_supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.dtype in (torch.float32, torch.float16, torch.bfloat16) and \
        q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM


def launch_state_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                      scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                      need_state: bool, rank_tile: int = MAX_DIM,
                      tuned: Optional[tuple] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Launch ``rtk_scan_fwd`` on ``[B, H, N, D]`` views (any strides, unit stride along D).

    The Dk state rows are split into tiles of at most ``rank_tile`` rows, one CTA each. With one
    tile the kernel writes ``out``; with several it returns ``(partial, final_state)`` where
    ``partial`` is the fp32 ``[tiles, B*H, N, Dv]`` workspace of per-tile outputs (unscaled) for
    the fleet reduction. Returns ``(None, final_state)`` otherwise. ``tuned``: a config of
    :data:`TUNE_SPACE` (sorted pairs) instead of the heuristic's T and NT.
    """
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    q, k, v, s0, final = operands(q, k, v, initial_state, need_state)
    name, kmax, bv, nt = _launch_config(q.dtype, dk, rank_tile, tuned or None)
    tiles = -(-dk // kmax)
    dev = q.device.index
    fn = get_function(SOURCE, name, dev)
    partial = torch.empty(tiles, b * h, n, dv, dtype=torch.float32, device=q.device) if tiles > 1 else None
    args = (*fwd_args(q, k, v, out, log_decay, s0, final, scale), 0 if partial is None else partial.data_ptr())
    launch(fn, (b * h, -(-dv // bv), tiles), (nt, 1, 1), args, dev, pointers=FWD_POINTERS)
    return partial, final


@functools.lru_cache(maxsize=None)
def _launch_config(dtype: torch.dtype, dk: int, rank_tile: int, tuned: Optional[tuple] = None) -> tuple[str, int, int, int]:
    tiles = -(-dk // rank_tile)
    config = kernel_config(dtype, -(-dk // tiles))
    if tuned:
        c = dict(tuned)
        config = (*config[:3], c["t"], c["nt"])
    return name_expression(config), config[1], config[2], config[4]


def tuned_launch(config: Config, problem: Problem, limits: Limits, *, vec: bool = True,
                 exact: bool = True) -> tuple[str, int, int, int]:
    """The autotuner's adapter: a config of :data:`TUNE_SPACE` (sorted ``(name, value)`` pairs) ->
    (name expression, KMAX, BV, threads) of ``rtk_scan_fwd`` with all Dk rows in one CTA. ``vec``
    and ``exact`` do not concern this kernel."""
    return _launch_config(problem.torch_dtype, problem.dk, MAX_DIM, config or None)


def instances() -> dict[str, list[str]]:
    """Every template instance this method can ask for, by source (the CI compile test)."""
    return {SOURCE: [name_expression(c) for c in all_configs()]}


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool, fp32_precision: str = "exact") -> Optional[torch.Tensor]:
    """All Dk state rows in one CTA per (batch, head, value tile): the sequential scan
    (``fp32_precision`` does not concern it: fp32 FMAs)."""
    tuned = tuned_config("scan", q.get_device(), q.dtype, q.shape[0] * q.shape[1], q.shape[2], q.shape[3],
                         v.shape[3])
    return launch_state_scan(q, k, v, log_decay, scale, out, initial_state, need_state, tuned=tuned)[1]
