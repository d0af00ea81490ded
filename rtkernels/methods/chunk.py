"""``chunk``: the chunked form, every chunk at once (the flagship's algorithm).

With chunks of C tokens and S_c the state entering chunk c:

    O_c[t]  = gamma^(t+1) q_t S_c + sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s
    S_{c+1} = gamma^L S_c + sum_s gamma^(L-1-s) k_s^T v_s      (L = C, the last chunk: what is left)

Only non-negative powers of gamma appear, so it is safe for every gamma in (0, 1] and any N.
The torch path computes every chunk's masked product and own state in batched products, then
scans the chunk states. Work O(N C (Dk + Dv) + N Dk Dv), memory O(N (Dk + Dv) + N Dk Dv / C).

On a CUDA device, fp16 and bf16 inputs with Dk, Dv <= 256 run ``chunk.cu``: one fused kernel on
tensor cores (mma.sync m16n8k16, fp32 accumulation, fp32 state in registers), one CTA per
(batch, head, tile of value columns) walking chunks of 64 tokens, the next chunk loaded with
cp.async while the current one is computed; four warps compute the outputs while four others
update the state. Memory beyond inputs and output: none, except with few (batch, head, value-tile)
CTAs: then the sequence is split into segments, ``rtk_chunk_states`` (a states-only kernel)
writes the state each segment but the last ends with (``[segments, B*H, Dk, Dv]`` fp32), and the
fused pass folds them into each segment's entering state.

fp32 inputs run ``rtk_chunk_fwd_f32`` in the same file: the same algorithm and warp roles on TF32
tensor cores (mma.sync m16n8k8, fp32 tiles in shared memory). ``fp32_precision="exact"`` splits
every operand x into hi = x truncated to tf32 and lo = x - hi (which the tensor cores read to TF32
precision) and forms each product as hi*lo' + lo*hi' + hi*hi' (3xTF32: about fp32 accuracy), with
8 state warps (:func:`f32_threads`); ``"tf32"`` uses one TF32 product (relative error ~1e-3,
faster) and 4 state warps. It takes the same arguments, so the launch
planner's split-sequence strategy (segments, ``rtk_chunk_seg_scan``) serves it too; it has no
wgmma variant, and its tile (BV, stages) follows the GPU's shared memory. fp64 inputs run the
torch path.
"""

from __future__ import annotations

from typing import Optional

import torch

import functools
import os

from ..autotune import tuned_config
from ..autotune.space import Limits, Problem, Space
from ..decay import LogDecay
from ..jit import dtype_code, get_function
from ._launch import fwd_tail, row_address, unit_stride
from ._torch_common import chunk_end_decays, inter_chunk, intra_chunk, scan_chunks, to_chunks, zero_state

SOURCE = "chunk.cu"
#: Largest Dk and Dv the kernel takes.
MAX_DIM = 256
CHUNK_KERNEL = 64  # tokens per chunk of the kernel (8 warps: 4 output warps x 16 rows, 4 state warps)

#: Tokens per chunk of the torch path.
CHUNK = 64


def torch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                  initial_state: Optional[torch.Tensor], need_state: bool):
    b, h, n, _ = q.shape
    qc, kc, vc = (to_chunks(x, CHUNK) for x in (q, k, v))      # [B, H, nc, C, D], zero-padded
    to_end, carry, _ = chunk_end_decays(log_decay, n, CHUNK)
    own = (kc * to_end).transpose(-1, -2) @ vc                  # sum_s gamma^(L-1-s) k_s^T v_s
    states, final = scan_chunks(zero_state(q, v, initial_state), own, carry)  # S_c for every chunk
    o = intra_chunk(qc, kc, vc, log_decay) + inter_chunk(qc, states, log_decay)
    return o.reshape(b, h, -1, v.shape[-1])[:, :, :n], (final if need_state else None)


def kernel_supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    if q.shape[-1] > MAX_DIM or v.shape[-1] > MAX_DIM:
        return False
    if q.dtype == torch.float32:  # when a configuration fits the device's shared memory
        limit = _smem_limit(q.device.index) if q.is_cuda else SMEM_LIMIT_SM90
        return f32_config(q.shape[-1], v.shape[-1], limit) is not None
    return q.dtype in (torch.float16, torch.bfloat16)


def _kmax(dk: int) -> int:
    """KMAX of both kernels: the smallest of 64, 128, 256 that holds Dk."""
    return 64 if dk <= 64 else 128 if dk <= 128 else 256


def kernel_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, ctas: int = 0, sms: int = 1,
                  wgmma: bool = False, bv: Optional[int] = None, exact: bool = True,
                  smem_limit: int = 0) -> Optional[tuple]:
    """Template arguments (DT, KMAX, BV, VEC, MINB, WG) of ``rtk_chunk_fwd`` for a grid of ``ctas``
    CTAs on a GPU with ``sms`` multiprocessors; ``wgmma``: the GPU runs sm_90a code (Hopper), so
    the wgmma output warpgroup is used where Dk <= 128; ``bv``: the value-tile width (the wgmma
    kernel takes 64 or 128).

    For float32: (DT, KMAX, BV, STAGES, EXACT, VEC, MINB) of ``rtk_chunk_fwd_f32`` (see
    :func:`f32_config`; ``bv`` given: that width, with the stages that fit), or None when no tile
    fits ``smem_limit`` bytes of shared memory per CTA (0: the limit of an H100/H200). It has no
    wgmma variant (``wgmma`` is ignored) and always takes MINB 1."""
    if dtype == torch.float32:
        tile = f32_config(dk, dv, smem_limit or SMEM_LIMIT_SM90, bv)
        return None if tile is None else (dtype_code(dtype), *tile, exact, vec, 1)
    kmax = _kmax(dk)
    wg = wgmma and kmax <= 128
    if wg:  # one CTA per SM: the wgmma kernel needs more than 128 registers a thread
        return dtype_code(dtype), kmax, bv or 64, vec, 1, True
    bv = bv or (32 if kmax == 256 or dv <= 32 else 64)
    return dtype_code(dtype), kmax, bv, vec, 1 if ctas <= sms else 2, False


def states_smem_bytes(kmax: int, bv: int, stages: int) -> int:
    """Dynamic shared memory of ``rtk_chunk_states`` (mirrors rtk_chunk_states_smem in chunk.cu)."""
    return 2 * stages * CHUNK_KERNEL * ((kmax + 8) + (bv + 8))


def states_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, smem_limit: int) -> tuple:
    """Template arguments (DT, KMAX, BV, VEC, STAGES) of ``rtk_chunk_states``, the states-only
    pass of the split-sequence strategy for 16-bit inputs: BV 128 where KMAX <= 128 (k read once
    for up to 128 value columns: the pass is bandwidth-bound), else 64 (registers); 4 chunk stages
    where they fit ``smem_limit`` bytes, else 2 (few instances to compile)."""
    kmax = _kmax(dk)
    bv = 128 if kmax <= 128 else 64
    stages = 4 if states_smem_bytes(kmax, bv, 4) <= smem_limit else 2
    return dtype_code(dtype), kmax, bv, vec, stages


def states_name(config: tuple) -> str:
    return "rtk_chunk_states<" + ", ".join(str(c).lower() for c in config) + ">"


def _states_configs() -> set[tuple]:
    return {states_config(dt, dk, 128, vec, limit) for dt in (torch.float16, torch.bfloat16)
            for dk in (64, 128, 256) for vec in (False, True) for limit in (SMEM_LIMIT_SM90, *SMEM_LIMITS_OTHER)}




def all_configs() -> list[tuple]:
    plain = {kernel_config(dt, dk, dv, vec, ctas, 1) for dt in (torch.float16, torch.bfloat16)
             for dk in (64, 128, 256) for dv in (32, 64) for vec in (False, True) for ctas in (1, 2)}
    wg = {kernel_config(dt, dk, 128, vec, 1, 1, True, bv) for dt in (torch.float16, torch.bfloat16)
          for dk in (64, 128) for vec in (False, True) for bv in (64, 128)}
    return sorted(plain | wg | _f32_configs())


def _is_f32(config: tuple) -> bool:
    return config[0] == dtype_code(torch.float32)


def name_expression(config: tuple) -> str:
    if _is_f32(config):
        return "rtk_chunk_fwd_f32<" + ", ".join(str(c).lower() for c in config[1:]) + ">"
    return "rtk_chunk_fwd<" + ", ".join(str(c).lower() for c in config) + ">"


def smem_bytes(kmax: int, bv: int, wg: bool = False) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd`` (mirrors rtk_chunk_smem in chunk.cu): two stages
    of q/k/v tiles, two 16-bit state copies (one for KMAX 256), and with ``wg`` two buffers of output
    rows."""
    c = CHUNK_KERNEL
    copies = 1 if kmax == 256 else 2
    if wg:  # 128-byte-swizzled tiles without padding, two output-row buffers (rows padded by 16
        # bytes), + slack to align the base to 1024 bytes
        return 2 * (2 * (2 * c * kmax + c * bv) + copies * kmax * bv + 2 * c * (bv + 8)) + 32 + 1024
    return 2 * (2 * (2 * c * (kmax + 8) + c * (bv + 8)) + copies * kmax * (bv + 8)) + 32


def f32_threads(exact: bool) -> int:
    """Threads of a ``rtk_chunk_fwd_f32`` CTA (rtk_chunk_f32_smem::THREADS): 4 output warps and 8
    state warps in the exact mode (its operand splits leave gaps a third warp per SM sub-partition
    fills), 4 in the TF32 mode."""
    return 384 if exact else 256


def f32_smem_bytes(kmax: int, bv: int, stages: int = 2) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd_f32`` with ``stages`` stages (mirrors
    rtk_chunk_f32_smem in chunk.cu): per stage the q, k and v tiles, then the fp32 state copy and
    the 8 q S pieces the state warps compute (16 x BV/4 floats each)."""
    c = CHUNK_KERNEL
    return 4 * (stages * (2 * c * (kmax + 4) + c * (bv + 4)) + kmax * (bv + 8) + 8 * 16 * (bv // 4))


def config_smem(config: tuple) -> int:
    """Dynamic shared memory of a :func:`kernel_config` template, either kernel."""
    if _is_f32(config):
        return f32_smem_bytes(config[1], config[2], config[3])
    return smem_bytes(config[1], config[2], config[5])


# ---- float32: tiles that fit the device's shared memory ------------------------------------------

#: Largest dynamic shared memory per CTA (opt-in) of sm_90 (H100/H200) and of sm_100.
SMEM_LIMIT_SM90 = 227 * 1024
#: The same for sm_80 / sm_87 (A100, Orin) and for sm_86 / sm_89 / sm_120 (consumer GPUs, L40S).
SMEM_LIMITS_OTHER = (163 * 1024, 99 * 1024)

#: Kernels of chunk.cu that take no template arguments, and the states-only kernel's instances.
EXTRA_KERNELS = ("rtk_chunk_seg_scan", *sorted(states_name(c) for c in _states_configs()))


def f32_stages(kmax: int, bv: int, smem_limit: int) -> Optional[int]:
    """Stages of q/k/v tiles of ``rtk_chunk_fwd_f32`` with this tile: 2 where they fit
    ``smem_limit`` bytes, else 1, else None."""
    return next((st for st in (2, 1) if f32_smem_bytes(kmax, bv, st) <= smem_limit), None)


def f32_config(dk: int, dv: int, smem_limit: int, bv: Optional[int] = None) -> Optional[tuple[int, int, int]]:
    """(KMAX, BV, STAGES) of ``rtk_chunk_fwd_f32`` for these head sizes: KMAX the smallest of 64,
    128, 256 that holds Dk; 64 value columns per CTA (32 when Dv <= 32 or KMAX = 256), two stages
    of q/k/v tiles. Where that does not fit ``smem_limit`` bytes: 32 value columns, then a single
    stage. None when nothing fits (e.g. KMAX = 256 below ~180 KB). With ``bv`` given (a tuned
    width): that width with the stages that fit (:func:`f32_stages`)."""
    kmax = _kmax(dk)
    if bv is not None:
        stages = f32_stages(kmax, bv, smem_limit)
        return None if stages is None else (kmax, bv, stages)
    bv = 32 if kmax == 256 or dv <= 32 else 64
    for tile in ((bv, 2), (32, 2), (bv, 1), (32, 1)):
        if f32_smem_bytes(kmax, *tile) <= smem_limit:
            return kmax, *tile
    return None


def _f32_configs() -> set[tuple]:
    """Every float32 instance the heuristic (:func:`f32_config`) or a tuned width (BV 32 or 64,
    :data:`TUNE_SPACE`) can ask for on the devices of SMEM_LIMIT_*: each tile with the stages
    that fit, in both modes, with and without VEC."""
    out = set()
    for limit in (SMEM_LIMIT_SM90, *SMEM_LIMITS_OTHER):
        for kmax in (64, 128, 256):
            for bv in ((32,) if kmax == 256 else (32, 64)):
                for vec in (False, True):
                    for exact in (False, True):
                        c = kernel_config(torch.float32, kmax, bv, vec, bv=bv, exact=exact, smem_limit=limit)
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


def _aligned(x: torch.Tensor, reverse: bool = False) -> bool:
    """Whether every row the kernel reads starts on 16 bytes (the cp.async loads): the first row it
    reads (token N-1 with ``reverse``) and strides that are multiples of 16 bytes (either sign)."""
    s = x.stride()
    per16 = 16 // x.element_size()
    return row_address(x, reverse) % 16 == 0 and s[0] % per16 == 0 and s[1] % per16 == 0 and s[2] % per16 == 0


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=None)
def _is_sm90(dev: int) -> bool:
    return torch.cuda.get_device_capability(dev) == (9, 0) and os.environ.get("RTKERNELS_NO_WGMMA") != "1"


def _wgmma_ok(dev: int) -> bool:
    """Whether the wgmma kernel may run on device ``dev``: compute capability 9.0 exactly (sm_90a
    code runs on no other), unless RTKERNELS_NO_WGMMA=1 or ``force_wgmma`` says otherwise."""
    return _is_sm90(dev) if force_wgmma is None else force_wgmma


#: Compiler options of the wgmma instances (Hopper-specific code).
WGMMA_OPTIONS = ("-arch=sm_90a",)


#: Overrides for tests and tuning (None: the heuristic): the number of sequence segments, the
#: wgmma kernel on or off, the value-tile width BV. The autotuner will own these choices.
#: float32 inputs take ``force_segments`` only (their kernel has no wgmma variant, and its BV
#: follows the shared memory).
force_segments: Optional[int] = None
force_wgmma: Optional[bool] = None
force_bv: Optional[int] = None
#: The split-sequence strategy for 16-bit inputs: the dedicated states kernel ``rtk_chunk_states``
#: and a fused pass that folds its slots into each segment's entering state (True, two launches),
#: or the fused kernel's states-only mode, ``rtk_chunk_seg_scan`` and the fused pass (False: for
#: tests and measurements; float32 inputs always take the latter).
dedicated_states: bool = True

#: The last argument of ``rtk_chunk_fwd`` / ``rtk_chunk_fwd_f32`` (RTK_MODE_* in chunk.cu).
MODE_FUSED, MODE_STATES, MODE_FOLD = 0, 1, 2


def _overrides() -> tuple:
    return (force_segments, force_wgmma, force_bv)


def segments_for(bh_tiles: int, n: int, sms: int, ctas_per_sm: int = 2) -> int:
    """The split-sequence heuristic: when the (batch, head, value-tile) CTAs fill at most half the
    multiprocessors and the sequence holds at least 2048 tokens, split it into segments of at least
    8 chunks, as many as fit in one wave of ``ctas_per_sm`` CTAs per multiprocessor (the extra
    states pass costs less than idle multiprocessors; a second, partial wave costs more).
    Measured on an H200 at (1, 32, 16384, 128) bf16, mma.sync kernel: 1 segment 0.95 ms,
    4 segments 0.51 ms, 5 segments (a partial second wave) 0.77 ms."""
    if 2 * bh_tiles > sms or n < 2048:
        return 1
    return max(1, min(ctas_per_sm * sms // bh_tiles, n // (8 * CHUNK_KERNEL)))


def ctas_per_sm(dtype: torch.dtype, dk: int, bv: int, wg: bool, smem_limit: int, exact: bool = True) -> int:
    """CTAs that share a multiprocessor, for :func:`segments_for`: the wgmma kernel 1 (its
    registers), the 16-bit mma.sync kernel 2; the float32 kernel in the exact mode 1 (384 threads of
    105 to 158 registers), in the TF32 mode 2 when two of its CTAs fit ``smem_limit`` bytes of
    shared memory (KMAX 64, BV 32: 126 registers), else 1."""
    if wg:
        return 1
    if dtype != torch.float32:
        return 2
    kmax = _kmax(dk)
    stages = f32_stages(kmax, bv, smem_limit)
    two = not exact and stages is not None and 2 * f32_smem_bytes(kmax, bv, stages) <= smem_limit
    return 2 if two else 1


def value_tile(dv: int, bh: int, n: int, sms: int) -> int:
    """The value-tile width BV. The wgmma kernel takes 128 (q k^T shared by all Dv <= 128 value
    columns, one CTA per SM) when Dv > 64 and the (batch, head) CTAs fill at least 3/4 of the SMs
    or the sequence is split anyway, else 64 (twice the CTAs for a grid that would leave SMs
    idle). Measured on an H200, bf16, D = 128: (4, 32, 4096) BV 128 0.243 ms, BV 64 0.313 ms;
    (2, 32, 1024) BV 64 0.053 ms, BV 128 0.067 ms; (1, 32, 16384) BV 128 x 4 segments 0.375 ms,
    BV 64 x 4 segments 0.482 ms."""
    t128 = bh * -(-dv // 128)
    return 128 if dv > 64 and (4 * t128 >= 3 * sms or (2 * t128 <= sms and n >= 2048)) else 64


def _default_bv(dtype: torch.dtype, dk: int, dv: int, smem_limit: int) -> int:
    """BV of the mma.sync kernels' heuristic (float32: the widest tile that fits, 32 if none)."""
    if dtype == torch.float32:
        tile = f32_config(dk, dv, smem_limit)
        return 32 if tile is None else tile[1]
    return kernel_config(dtype, dk, dv, True)[2]


def _launch_of(config: Optional[tuple], nseg: int) -> tuple[str, int, int, int, int, tuple]:
    """(name expression, BV, segments, dynamic shared memory, threads, compiler options) of a
    :func:`kernel_config` template."""
    if config is None:
        raise ValueError("no rtk_chunk_fwd_f32 tile fits this GPU's shared memory")
    wg = not _is_f32(config) and config[5]
    threads = f32_threads(config[4]) if _is_f32(config) else 256
    return name_expression(config), config[2], nseg, config_smem(config), threads, WGMMA_OPTIONS if wg else ()


@functools.lru_cache(maxsize=4096)
def _plan(dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int, n: int, dev: int,
          _key: tuple = (), exact: bool = True) -> tuple[str, int, int, int, int, tuple]:
    """(name expression, BV, segments, dynamic shared memory, threads, compiler options);
    ``exact``: the float32 kernel's mode (3xTF32, else TF32)."""
    wg = dtype != torch.float32 and _wgmma_ok(dev) and dk <= 128
    sms, limit = _sm_count(dev), _smem_limit(dev)
    bv = (force_bv or value_tile(dv, bh, n, sms)) if wg else _default_bv(dtype, dk, dv, limit)
    tiles = bh * -(-dv // bv)
    nseg = force_segments or segments_for(tiles, n, sms, ctas_per_sm(dtype, dk, bv, wg, limit, exact))
    return _launch_of(kernel_config(dtype, dk, dv, vec, tiles * nseg, sms, wg, bv, exact, limit), nseg)


def _launch_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int, dev: int, n: int = 4096,
                   exact: bool = True):
    """(name expression, BV, dynamic shared memory, threads, compiler options) of the fused pass."""
    name, bv, _, smem, threads, opts = _plan(dtype, dk, dv, vec, bh, n, dev, _overrides(), exact=exact)
    return name, bv, smem, threads, opts


def _tune_default(p: Problem, limits: Limits) -> dict:
    """The heuristic (:func:`_plan`'s choices) as a tuning config."""
    dt = p.torch_dtype
    wg = dt != torch.float32 and limits.cc == (9, 0) and p.dk <= 128
    bv = value_tile(p.dv, p.bh, p.n, limits.sms) if wg else _default_bv(dt, p.dk, p.dv, limits.max_smem)
    nseg = segments_for(p.bh * -(-p.dv // bv), p.n, limits.sms, ctas_per_sm(dt, p.dk, bv, wg, limits.max_smem))
    nseg = -(-p.n // (-(-p.n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL))
    return {"wgmma": wg, "bv": bv, "segments": nseg}


def _tune_check(p: Problem, config: dict, limits: Limits) -> Optional[str]:
    kmax = _kmax(p.dk)
    f32 = p.torch_dtype == torch.float32
    wg, bv, nseg = config.get("wgmma", False), config["bv"], config["segments"]
    if wg and f32:
        return "the fp32 kernel (TF32 mma.sync) has no wgmma variant"
    if wg and (kmax > 128 or bv < 64 or limits.cc != (9, 0)):
        return "the wgmma kernel takes Dk <= 128 and BV 64 or 128, on compute capability 9.0"
    if not wg and bv > 64:
        return "the mma.sync kernel takes BV 32 or 64"
    if kmax == 256 and bv > 32:
        return "KMAX 256 with BV 64 needs more registers than a thread has"
    if bv > 32 and p.dv <= 32:
        return "BV wider than Dv"
    need = f32_smem_bytes(kmax, bv, 1) if f32 else smem_bytes(kmax, bv, wg)  # fp32: one stage at least
    if need > limits.max_smem:
        return f"needs {need} B of shared memory, the GPU gives {limits.max_smem}"
    seg_len = -(-p.n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL
    if nseg > 1 and -(-p.n // seg_len) != nseg:
        return f"N = {p.n} gives fewer than {nseg} segments"
    if nseg > 1 and seg_len < 4 * CHUNK_KERNEL:
        return "segments shorter than 4 chunks"
    return None


#: The autotuner's space (rtkernels.autotune): the wgmma kernel or the mma.sync one, the tile width
#: BV and the number of sequence segments; KMAX follows Dk, VEC the operands' alignment, MINB the grid.
#: float32 problems get the part of it their kernel runs (no wgmma, BV 32 or 64; the stages follow
#: the shared memory), the rest is pruned with a reason by the check.
TUNE_SPACE = Space(params={"wgmma": (False, True), "bv": (32, 64, 128),
                           "segments": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)},
                   default=_tune_default, check=_tune_check)


@functools.lru_cache(maxsize=1024)
def tuned_launch(config: tuple, dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int = 1,
                 sms: int = 1, exact: bool = True, smem_limit: int = 0) -> tuple[str, int, int, int, int, tuple]:
    """The autotuner's adapter: a tuned config (sorted ``(name, value)`` pairs of TUNE_SPACE) ->
    (name expression, BV, segments, dynamic shared memory, threads, compiler options). float32:
    ``exact`` is the mode, and the stages follow ``smem_limit`` (0: an H100/H200's)."""
    c = dict(config)
    wg, bv, nseg = bool(c.get("wgmma", False)), c["bv"], c["segments"]
    return _launch_of(kernel_config(dtype, dk, dv, vec, bh * -(-dv // bv) * nseg, sms, wg, bv, exact,
                                    smem_limit), nseg)


class ChunkLaunch:
    """A planned call of the chunk kernel: kernel, grid, shared memory and every argument but the
    data pointers, so that repeating the call with new tensors of the same shapes, strides and
    alignment costs the pointer reads and the launch (the host path of a cached call).

    ``launch(q, k, v, out, initial_state)`` takes the tensors (any views of the planned ones' memory
    layout: only ``data_ptr()`` is read) and returns the final state when it was planned, else None.
    The split-sequence strategy allocates its ``[segments, B*H, Dk, Dv]`` fp32 state buffer per call
    (two with the fused kernel's states-only mode: fp32 inputs, or ``dedicated_states`` False).
    """

    __slots__ = ("fused", "states", "scan", "device", "lg", "lg_ptr", "nseg", "state_shape", "need_state",
                 "offsets")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
                 out: torch.Tensor, need_state: bool, reverse: bool = False, fp32_precision: str = "exact"):
        b, h, n, dk = q.shape
        dv = v.shape[-1]
        vec = _aligned(q, reverse) and _aligned(k, reverse) and _aligned(v, reverse)
        # reverse: the kernel starts at row N-1 (the byte offset of that row) with negated token strides
        self.offsets = tuple(row_address(x, True) - x.data_ptr() for x in (q, k, v, out)) if reverse else None
        dev = q.device.index
        bh = b * h
        exact = fp32_precision != "tf32"  # the float32 kernel's mode (16-bit inputs ignore it)
        tuned = tuned_config("chunk", dev, q.dtype, bh, n, dk, dv)  # None: no store entry
        if tuned and force_segments is None and force_wgmma is None and force_bv is None:
            name, bv, nseg, smem, threads, opts = tuned_launch(tuned, q.dtype, dk, dv, vec, bh, _sm_count(dev),
                                                               exact, _smem_limit(dev))
        else:
            name, bv, nseg, smem, threads, opts = _plan(q.dtype, dk, dv, vec, bh, n, dev, _overrides(), exact=exact)
        seg_len = -(-n // (nseg * CHUNK_KERNEL)) * CHUNK_KERNEL
        self.nseg = nseg = -(-n // seg_len)
        fn = get_function(SOURCE, name, dev, extra_options=opts, dynamic_smem=smem)
        grid, block, tail = (bh, -(-dv // bv), nseg), (threads, 1, 1), fwd_tail(q, k, v, out, scale, reverse)
        # the split strategy with the dedicated states kernel: its slots, then the fused pass folding them
        fold = nseg > 1 and q.dtype != torch.float32 and dedicated_states
        # head: q, k, v, out, log-decay, initial state, final state pointers
        self.fused = fn.bind(grid, block, smem, dev, 7, (*tail, seg_len, MODE_FOLD if fold else MODE_FUSED))
        self.device = q.device
        self.lg = log_decay.tensor(torch.float32)  # kept: the kernel reads it through a raw pointer
        self.lg_ptr = self.lg.data_ptr()
        self.need_state = need_state
        self.state_shape = (b, h, dk, dv)
        self.scan = None
        if fold:
            sc = states_config(q.dtype, dk, dv, vec, _smem_limit(dev))
            ssmem = states_smem_bytes(sc[1], sc[2], sc[4])
            sfn = get_function(SOURCE, states_name(sc), dev, dynamic_smem=ssmem)
            self.states = sfn.bind((bh, -(-dv // sc[2]), nseg - 1), block, ssmem, dev, 7, (*tail, seg_len, 0))
        elif nseg > 1:  # the fused kernel's states-only mode and the scan kernel
            self.states = fn.bind(grid, block, smem, dev, 7, (*tail, seg_len, MODE_STATES))
            total = bh * dk * dv
            # head: segment states, entering states, initial state, final state, log-decay pointers
            self.scan = get_function(SOURCE, "rtk_chunk_seg_scan", dev).bind(
                (min(-(-total // 256), 4096), 1, 1), (256, 1, 1), 0, dev, 5,
                (nseg, bh, h, dk * dv, seg_len, n - (nseg - 1) * seg_len))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 initial_state: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        s0 = initial_state
        if s0 is not None and (s0.dtype != torch.float32 or not s0.is_contiguous()):
            s0 = s0.to(torch.float32).contiguous()
        s0p = 0 if s0 is None else s0.data_ptr()
        final = torch.empty(self.state_shape, dtype=torch.float32, device=self.device) if self.need_state else None
        fp = 0 if final is None else final.data_ptr()
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if self.offsets is not None:
            oq, ok, ov, oo = self.offsets
            qp, kp, vp, op = qp + oq, kp + ok, vp + ov, op + oo
        if self.nseg == 1:
            self.fused(qp, kp, vp, op, self.lg_ptr, s0p, fp)
            return final
        local = torch.empty((self.nseg, *self.state_shape), dtype=torch.float32, device=self.device)
        if self.scan is None:
            # split sequence, rtk_chunk_states: the initial state and the state each segment but the
            # last ends with in the slots of ``local``; the fused pass folds them into each
            # segment's entering state, and its last segment stores the final state
            self.states(qp, kp, vp, op, self.lg_ptr, s0p, local.data_ptr())
            self.fused(qp, kp, vp, op, self.lg_ptr, local.data_ptr(), fp)
            return final
        # split sequence: each segment's own state (no initial state), the scan over the segments'
        # states, then the fused pass of each segment from its entering state
        s_in = torch.empty_like(local)
        self.states(qp, kp, vp, op, self.lg_ptr, 0, local.data_ptr())
        self.scan(local.data_ptr(), s_in.data_ptr(), s0p, fp, self.lg_ptr)
        self.fused(qp, kp, vp, op, self.lg_ptr, s_in.data_ptr(), 0)
        return final


def kernel_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
                   out: torch.Tensor, need_state: bool, fp32_precision: str = "exact") -> ChunkLaunch:
    """Plan the kernel call for ``[B, H, N, D]`` views with unit stride along D (see
    :class:`ChunkLaunch`): the autotune store's config for the shape bucket, else :func:`_plan`;
    ``fp32_precision``: the float32 kernel's mode."""
    return ChunkLaunch(q, k, v, log_decay, scale, out, need_state, fp32_precision=fp32_precision)


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool, fp32_precision: str = "exact", *, reverse: bool = False) -> Optional[torch.Tensor]:
    """One fused pass, or with few (batch, head, value-tile) CTAs the split-sequence strategy:
    a states-only pass (``rtk_chunk_states`` for 16-bit inputs, which skips the last segment; the
    fused kernel's states-only mode plus a scan kernel for fp32), then the fused pass per segment
    starting from its entering state. ``fp32_precision`` ("exact" or "tf32") selects the float32 kernel's
    mode; 16-bit inputs ignore it.

    ``reverse``: the operator on the reversed sequence (token N-1 first), its output written back
    in reverse order, i.e. ``out = flip(F(flip(q), flip(k), flip(v)))`` along the tokens, with the
    initial state entering before token N-1 and the final state after token 0. No copy: the kernel
    gets the pointers of row N-1 and negated token strides (:mod:`._launch`); segments and the
    states scan work in the kernel's (reversed) token order unchanged."""
    q, k, v = unit_stride(q, k, v)
    return ChunkLaunch(q, k, v, log_decay, scale, out, need_state, reverse,
                       fp32_precision=fp32_precision)(q, k, v, out, initial_state)
