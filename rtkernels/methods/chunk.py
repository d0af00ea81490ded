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

fp32 inputs run ``rtk_chunk_fwd_f32`` in the same file: the same algorithm and warp roles on TF32
tensor cores (mma.sync m16n8k8, fp32 tiles in shared memory). ``fp32_precision="exact"`` splits
every operand x into hi = tf32(x) and lo = tf32(x - hi) and forms each product as
hi*lo' + lo*hi' + hi*hi' (3xTF32: about fp32 accuracy); ``"tf32"`` uses
one TF32 product (relative error ~1e-3, faster). fp64 inputs run the torch path.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decay import LogDecay
import torch.nn.functional as F

import functools

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
    if q.shape[-1] > MAX_DIM or v.shape[-1] > MAX_DIM:
        return False
    if q.dtype == torch.float32:  # when a configuration fits the device's shared memory
        limit = _smem_limit(q.device.index) if q.is_cuda else SMEM_LIMIT_SM90
        return f32_config(q.shape[-1], v.shape[-1], limit) is not None
    return q.dtype in (torch.float16, torch.bfloat16)


def kernel_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, ctas: int = 0, sms: int = 1,
                  exact: bool = True, smem_limit: int = 0) -> tuple:
    """Template arguments (DT, KMAX, BV, VEC, MINB) of ``rtk_chunk_fwd`` for a grid of ``ctas``
    CTAs on a GPU with ``sms`` multiprocessors. For float32: (0, KMAX, BV, STAGES, EXACT, VEC,
    MINB) of ``rtk_chunk_fwd_f32`` (see :func:`f32_config`), or None when no configuration fits
    ``smem_limit`` bytes of shared memory per CTA (0: the limit of an H100/H200)."""
    if dtype == torch.float32:
        tile = f32_config(dk, dv, smem_limit or SMEM_LIMIT_SM90)
        return None if tile is None else (dtype_code(dtype), *tile, exact, vec, 1)
    kmax = 64 if dk <= 64 else 128 if dk <= 128 else 256
    bv = 32 if kmax == 256 or dv <= 32 else 64
    minb = 1 if ctas <= sms else 2
    return dtype_code(dtype), kmax, bv, vec, minb


#: Kernels of chunk.cu that take no template arguments.
EXTRA_KERNELS = ("rtk_chunk_seg_scan",)


def all_configs() -> list[tuple]:
    return sorted({kernel_config(dt, dk, dv, vec, ctas) for dt in (torch.float16, torch.bfloat16)
                   for dk in (64, 128, 256) for dv in (32, 64) for vec in (False, True) for ctas in (1, 2)}
                  | _f32_configs())


def name_expression(config: tuple) -> str:
    if config[0] == dtype_code(torch.float32):
        return "rtk_chunk_fwd_f32<" + ", ".join(str(c).lower() for c in config[1:]) + ">"
    return "rtk_chunk_fwd<" + ", ".join(str(c).lower() for c in config) + ">"


def smem_bytes(kmax: int, bv: int, dtype: torch.dtype = torch.bfloat16, stages: int = 2) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd`` (mirrors rtk_chunk_smem in chunk.cu), or for
    float32 of ``rtk_chunk_fwd_f32`` with ``stages`` stages (mirrors rtk_chunk_f32_smem)."""
    c = CHUNK_KERNEL
    if dtype == torch.float32:
        return 4 * (stages * (2 * c * (kmax + 4) + c * (bv + 4)) + kmax * (bv + 8))
    return 2 * (2 * (2 * c * (kmax + 8) + c * (bv + 8)) + kmax * (bv + 8)) + 32


# ---- float32: tiles that fit the device's shared memory ------------------------------------------

#: Largest dynamic shared memory per CTA (opt-in) of sm_90 (H100/H200) and of sm_100.
SMEM_LIMIT_SM90 = 227 * 1024
#: The same for sm_80 / sm_87 (A100, Orin) and for sm_86 / sm_89 / sm_120 (consumer GPUs, L40S).
SMEM_LIMITS_OTHER = (163 * 1024, 99 * 1024)


def f32_config(dk: int, dv: int, smem_limit: int) -> Optional[tuple[int, int, int]]:
    """(KMAX, BV, STAGES) of ``rtk_chunk_fwd_f32`` for these head sizes: KMAX the smallest of 64,
    128, 256 that holds Dk; 64 value columns per CTA (32 when Dv <= 32 or KMAX = 256), two stages
    of q/k/v tiles. Where that does not fit ``smem_limit`` bytes: 32 value columns, then a single
    stage. None when nothing fits (e.g. KMAX = 256 below ~180 KB)."""
    kmax = 64 if dk <= 64 else 128 if dk <= 128 else 256
    bv = 32 if kmax == 256 or dv <= 32 else 64
    for tile in ((bv, 2), (32, 2), (bv, 1), (32, 1)):
        if smem_bytes(kmax, tile[0], torch.float32, tile[1]) <= smem_limit:
            return kmax, *tile
    return None


def _f32_configs() -> set[tuple]:
    """Every float32 instance kernel_config can ask for on the devices of SMEM_LIMIT_*."""
    out = set()
    for limit in (SMEM_LIMIT_SM90, *SMEM_LIMITS_OTHER):
        for dk in (64, 128, 256):
            for dv in (32, 64):
                for vec in (False, True):
                    for exact in (False, True):
                        c = kernel_config(torch.float32, dk, dv, vec, exact=exact, smem_limit=limit)
                        if c is not None:
                            out.add(c)
    return out


@functools.lru_cache(maxsize=None)
def _smem_limit(dev: int) -> int:
    """Largest dynamic shared memory per CTA (opt-in) of device ``dev``, in bytes."""
    props = torch.cuda.get_device_properties(dev)
    limit = getattr(props, "shared_memory_per_block_optin", 0)
    if not limit:
        import cupy

        limit = cupy.cuda.Device(dev).attributes["MaxSharedMemoryPerBlockOptin"]
    return int(limit)


def _aligned(x: torch.Tensor) -> bool:
    """16-byte aligned base and rows (the kernels' cp.async path)."""
    s = x.stride()
    per16 = 16 // x.element_size()
    return x.data_ptr() % 16 == 0 and s[0] % per16 == 0 and s[1] % per16 == 0 and s[2] % per16 == 0


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _launch_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int, dev: int,
                   exact: bool = True) -> tuple[str, int, int, int]:
    if dtype == torch.float32:
        config = kernel_config(dtype, dk, dv, vec, exact=exact, smem_limit=_smem_limit(dev))
        _, kmax, bv, stages = config[:4]
        return name_expression(config), bv, smem_bytes(kmax, bv, dtype, stages), 256
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


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool, fp32_precision: str = "exact") -> Optional[torch.Tensor]:
    """One fused pass, or with few (batch, head, value-tile) CTAs the split-sequence strategy:
    a states-only pass per segment, a scan over the segment states, and the fused pass per segment
    starting from its state. ``fp32_precision`` ("exact" or "tf32") selects the float32 kernel's
    mode; 16-bit inputs ignore it."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    q, k, v, s0, final = operands(q, k, v, initial_state, need_state)
    vec = _aligned(q) and _aligned(k) and _aligned(v)
    dev = q.device.index
    bh = b * h
    exact = fp32_precision != "tf32"
    if q.dtype == torch.float32:
        bv = _launch_config(q.dtype, dk, dv, vec, bh, dev, exact)[1]
    else:
        bv = kernel_config(q.dtype, dk, dv, vec)[2]
    tiles = -(-dv // bv)
    nseg = force_segments or segments_for(bh * tiles, n, _sm_count(dev))
    seg_len = -(-n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL
    nseg = -(-n // seg_len)
    name, _, smem, threads = _launch_config(q.dtype, dk, dv, vec, bh * nseg, dev, exact)
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
