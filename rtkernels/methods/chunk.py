"""``chunk``: the chunked form, every chunk at once (the flagship's algorithm).

With chunks of C tokens and S_c the state entering chunk c:

    O_c[t]  = gamma^(t+1) q_t S_c + sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s
    S_{c+1} = gamma^C S_c + sum_s gamma^(C-1-s) k_s^T v_s

Only non-negative powers of gamma appear, so it is safe for every gamma in (0, 1] and any N.
The torch path computes every chunk's masked product and own state in batched products, then
scans the chunk states. Work O(N C (Dk + Dv) + N Dk Dv), memory O(N (Dk + Dv) + N Dk Dv / C).

On a CUDA device, fp16 and bf16 inputs with Dk, Dv <= 256 run ``chunk.cu``: one fused kernel on
tensor cores (mma.sync m16n8k16, fp32 accumulation, fp32 state in registers), one CTA per
(batch, head, tile of value columns) walking chunks of 64 tokens, the next chunk loaded with
cp.async while the current one is computed; four warps compute the outputs while four others
update the state. Memory beyond inputs and output: none.
fp32 and fp64 inputs run the torch path (for now).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decay import LogDecay
import torch.nn.functional as F

import functools

from ..autotune import tuned_config
from ..autotune.space import Limits, Problem, Space
from ..runtime import dtype_code, get_function, launch
from ._launch import fwd_args, operands
from ._torch_common import block_state, inter_chunk, intra_chunk, state_update, zero_state

SOURCE = "chunk.cu"
#: Largest Dk and Dv the kernel takes.
MAX_DIM = 256
CHUNK_KERNEL = 64  # tokens per chunk of the kernel (8 warps: 4 output warps x 16 rows, 4 state warps)

#: Tokens per chunk of the torch path.
CHUNK = 64


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    nc = -(-n // CHUNK)
    # Zero rows appended at the end change no real output; the final state is taken before them.
    qc, kc, vc = (F.pad(x, (0, 0, 0, nc * CHUNK - n)).view(b, h, nc, CHUNK, x.shape[-1])
                  for x in (q, k, v))
    own = block_state(kc, vc, log_decay)                        # [B, H, nc, Dk, Dv]
    carry = torch.exp(log_decay * CHUNK).view(-1, 1, 1)
    state = zero_state(q, v, initial_state)
    entering = []
    for c in range(nc):
        entering.append(state)
        if c + 1 < nc:
            state = carry * state + own[:, :, c]
    states = torch.stack(entering, dim=2)                       # S_c for every chunk
    o = intra_chunk(qc, kc, vc, log_decay) + inter_chunk(qc, states, log_decay)
    o = o.reshape(b, h, nc * CHUNK, dv)[:, :, :n]
    final = None
    if need_state:
        last = (nc - 1) * CHUNK
        final = state_update(state, k[:, :, last:], v[:, :, last:], log_decay)
    return o, final


def kernel_supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM


def kernel_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, ctas: int = 0, sms: int = 1) -> tuple:
    """Template arguments (DT, KMAX, BV, VEC, MINB) of ``rtk_chunk_fwd`` for a grid of ``ctas``
    CTAs on a GPU with ``sms`` multiprocessors."""
    kmax = 64 if dk <= 64 else 128 if dk <= 128 else 256
    bv = 32 if kmax == 256 or dv <= 32 else 64
    minb = 1 if ctas <= sms else 2
    return dtype_code(dtype), kmax, bv, vec, minb


#: Kernels of chunk.cu that take no template arguments.
EXTRA_KERNELS = ("rtk_chunk_seg_scan",)


def all_configs() -> list[tuple]:
    return sorted({kernel_config(dt, dk, dv, vec, ctas) for dt in (torch.float16, torch.bfloat16)
                   for dk in (64, 128, 256) for dv in (32, 64) for vec in (False, True) for ctas in (1, 2)})


def name_expression(config: tuple) -> str:
    return "rtk_chunk_fwd<" + ", ".join(str(c).lower() for c in config) + ">"


def smem_bytes(kmax: int, bv: int) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd`` (mirrors rtk_chunk_smem in chunk.cu)."""
    c = CHUNK_KERNEL
    return 2 * (2 * (2 * c * (kmax + 8) + c * (bv + 8)) + kmax * (bv + 8)) + 32


def _aligned(x: torch.Tensor) -> bool:
    s = x.stride()
    return x.data_ptr() % 16 == 0 and s[0] % 8 == 0 and s[1] % 8 == 0 and s[2] % 8 == 0


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _launch_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int, dev: int) -> tuple[str, int, int, int]:
    bv = kernel_config(dtype, dk, dv, vec)[2]
    config = kernel_config(dtype, dk, dv, vec, bh * -(-dv // bv), _sm_count(dev))
    return name_expression(config), bv, smem_bytes(config[1], bv), 256


#: Number of sequence segments to use, overriding the heuristic (None: heuristic). For tests and
#: tuning; the autotuner will own this choice.
force_segments: Optional[int] = None


def segments_for(bh_tiles: int, n: int, sms: int) -> int:
    """The split-sequence heuristic: when the (batch, head, value-tile) CTAs fill at most half the
    multiprocessors, split the sequence into segments of at least 8 chunks, as many as fit in one
    wave of two CTAs per multiprocessor (the extra states pass costs less than idle
    multiprocessors; a second, partial wave costs more). Measured on an H200 at (1, 32, 16384,
    128) bf16: 1 segment 0.95 ms, 4 segments 0.51 ms, 5 segments (a partial second wave) 0.77 ms."""
    if 2 * bh_tiles > sms:
        return 1
    return max(1, min(2 * sms // bh_tiles, n // (8 * CHUNK_KERNEL)))


def _tune_default(p: Problem, limits: Limits) -> dict:
    """Today's heuristic (``kernel_config`` + ``segments_for``) as a tuning config."""
    dtype = p.torch_dtype
    bv = kernel_config(dtype, p.dk, p.dv, True)[2]
    tiles = -(-p.dv // bv)
    nseg = segments_for(p.bh * tiles, p.n, limits.sms)
    nseg = -(-p.n // (-(-p.n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL))
    minb = kernel_config(dtype, p.dk, p.dv, True, p.bh * nseg * tiles, limits.sms)[4]
    return {"bv": bv, "minb": minb, "segments": nseg}


def _tune_check(p: Problem, config: dict, limits: Limits) -> Optional[str]:
    kmax = kernel_config(p.torch_dtype, p.dk, p.dv, True)[1]
    bv, nseg = config["bv"], config["segments"]
    if kmax == 256 and bv > 32:
        return "KMAX 256 with BV 64 needs more registers than a thread has"
    if bv > 32 and p.dv <= 32:
        return "BV wider than Dv"
    if smem_bytes(kmax, bv) > limits.max_smem:
        return f"needs {smem_bytes(kmax, bv)} B of shared memory, the GPU gives {limits.max_smem}"
    seg_len = -(-p.n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL
    if nseg > 1 and -(-p.n // seg_len) != nseg:
        return f"N = {p.n} gives fewer than {nseg} segments"
    if nseg > 1 and seg_len < 4 * CHUNK_KERNEL:
        return "segments shorter than 4 chunks"
    return None


#: The autotuner's space (rtkernels.autotune): tile width BV, MINB (launch bounds) and the number
#: of sequence segments; KMAX follows Dk and VEC the operands' alignment.
TUNE_SPACE = Space(params={"bv": (32, 64), "minb": (1, 2), "segments": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)},
                   default=_tune_default, check=_tune_check)


@functools.lru_cache(maxsize=1024)
def tuned_launch(config: tuple, dtype: torch.dtype, dk: int, dv: int, vec: bool) -> tuple[str, int, int, int, int]:
    """The autotuner's adapter: a tuned config (sorted ``(name, value)`` pairs of TUNE_SPACE) ->
    (name expression, BV, dynamic shared memory, threads, segments)."""
    c = dict(config)
    kmax = kernel_config(dtype, dk, dv, vec)[1]
    template = (dtype_code(dtype), kmax, c["bv"], vec, c["minb"])
    return name_expression(template), c["bv"], smem_bytes(kmax, c["bv"]), 256, c["segments"]


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool) -> Optional[torch.Tensor]:
    """One fused pass, or with few (batch, head, value-tile) CTAs the split-sequence strategy:
    a states-only pass per segment, a scan over the segment states, and the fused pass per segment
    starting from its state."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    q, k, v, s0, final = operands(q, k, v, initial_state, need_state)
    vec = _aligned(q) and _aligned(k) and _aligned(v)
    dev = q.device.index
    bh = b * h
    tuned = tuned_config("chunk", dev, q.dtype, bh, n, dk, dv)  # None: no store entry
    if tuned:
        name, bv, smem, threads, nseg = tuned_launch(tuned, q.dtype, dk, dv, vec)
        nseg = force_segments or nseg
        tiles = -(-dv // bv)
    else:
        bv = kernel_config(q.dtype, dk, dv, vec)[2]
        tiles = -(-dv // bv)
        nseg = force_segments or segments_for(bh * tiles, n, _sm_count(dev))
    seg_len = -(-n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL
    nseg = -(-n // seg_len)
    if not tuned:
        name, _, smem, threads = _launch_config(q.dtype, dk, dv, vec, bh * nseg, dev)
    fn = get_function(SOURCE, name, dev, dynamic_smem=smem)
    grid = (bh, tiles, nseg)
    args = fwd_args(q, k, v, out, log_decay, s0, final, scale)
    if nseg == 1:
        launch(fn, grid, (threads, 1, 1), (*args, seg_len, 0), dev, shared_mem=smem)
        return final
    local = torch.empty(nseg, bh, dk, dv, dtype=torch.float32, device=q.device)
    s_in = torch.empty_like(local)
    lg = log_decay.tensor(torch.float32)
    first = (*args[:5], 0, local.data_ptr(), *args[7:])  # no initial state, segment states out
    launch(fn, grid, (threads, 1, 1), (*first, seg_len, 1), dev, shared_mem=smem)
    scan_fn = get_function(SOURCE, "rtk_chunk_seg_scan", dev)
    total = bh * dk * dv
    launch(scan_fn, (min(-(-total // 256), 4096), 1, 1), (256, 1, 1),
           (local.data_ptr(), s_in.data_ptr(), 0 if s0 is None else s0.data_ptr(),
            0 if final is None else final.data_ptr(), lg.data_ptr(), nseg, bh, h, dk * dv, seg_len,
            n - (nseg - 1) * seg_len), dev)
    third = (*args[:5], s_in.data_ptr(), 0, *args[7:])  # each segment from its entering state
    launch(fn, grid, (threads, 1, 1), (*third, seg_len, 0), dev, shared_mem=smem)
    return final
