"""Planning the chunk kernels: template instances, shared memory, tile widths, the split-sequence
heuristic, the autotuner's space, and the turning of a config into a launch (:class:`Launch`).

Nothing here launches anything: :mod:`.launch` does, with what :func:`plan_launch` or
:func:`tuned_launch` decide. Tests and tuning steer the plan through :func:`override`
(one :class:`Overrides` object) instead of module globals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator, NamedTuple, Optional

import torch

from ...autotune.space import Config, Limits, Problem, Space
from ...jit import dtype_code
from .._launch import row_address

#: The sources of the chunk kernels, one kernel each (under ``cuda_src/``).
FWD16_SOURCE = "chunk/fwd16.cu"
F32_SOURCE = "chunk/fwd_f32.cu"
TF32_WG_SOURCE = "chunk/fwd_tf32.cu"
STATES_SOURCE = "chunk/states.cu"
STATES_TF32_SOURCE = "chunk/states_tf32.cu"
SEG_SCAN_SOURCE = "chunk/seg_scan.cu"
#: Largest Dk the kernels take (the contraction of q . k and the state rows a CTA holds).
MAX_DIM = 256
#: Largest Dv the kernels take: the value columns are split over CTAs in tiles of BV, so Dv only
#: sets the grid (RetNet's heads have Dv = 2 Dk = 512). The backward contracts over Dv in two of
#: its passes, which the launch runs as pieces of key columns (:func:`key_pieces`).
MAX_VALUE_DIM = 512
CHUNK_KERNEL = 64  # tokens per chunk of the kernel (8 warps: 4 output warps x 16 rows, 4 state warps)


def kernel_supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the chunk kernels take q (Dk <= :data:`MAX_DIM`) and v (Dv <= :data:`MAX_VALUE_DIM`)
    of this dtype (fp32: when a tile fits the device's shared memory)."""
    if q.shape[-1] > MAX_DIM or v.shape[-1] > MAX_VALUE_DIM:
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
                  smem_limit: int = 0, stages: int = 2) -> Optional[tuple]:
    """Template arguments (DT, KMAX, BV, VEC, MINB, WG) of ``rtk_chunk_fwd`` for a grid of ``ctas``
    CTAs on a GPU with ``sms`` multiprocessors; ``wgmma``: the GPU runs sm_90a code (Hopper), so
    the wgmma output warpgroup is used where Dk <= 128; ``bv``: the value-tile width (the wgmma
    kernel takes 64 or 128); ``stages`` 3: the wgmma kernel with three chunk stages of tiles
    (aligned rows only; the template then ends DLOG = false, STAGES = 3).

    For float32: (DT, KMAX, BV, STAGES, EXACT, VEC, MINB) of ``rtk_chunk_fwd_f32`` (see
    :func:`f32_config`; ``bv`` given: that width, with the stages that fit), or None when no tile
    fits ``smem_limit`` bytes of shared memory per CTA (0: the limit of an H100/H200); MINB is
    always 1. With ``wgmma``, the TF32 mode (``exact`` false), aligned rows, Dk <= 128 and a
    64-wide tile (or none asked): ``rtk_chunk_fwd_tf32`` instead, the same tuple with an eighth
    argument WG = true (:func:`tf32_wg_config`)."""
    if dtype == torch.float32:
        if wgmma and not exact and vec and _kmax(dk) <= 128 and bv in (None, 64):
            return tf32_wg_config(dk)
        tile = f32_config(dk, dv, smem_limit or SMEM_LIMIT_SM90, bv)
        return None if tile is None else (dtype_code(dtype), *tile, exact, vec, 1)
    kmax = _kmax(dk)
    wg = wgmma and kmax <= 128
    if wg:  # one CTA per SM: the wgmma kernel needs more than 128 registers a thread
        deep = (False, 3) if stages == 3 and vec else ()
        return (dtype_code(dtype), kmax, bv or 64, vec, 1, True) + deep
    bv = bv or (32 if kmax == 256 or dv <= 32 else 64)
    return dtype_code(dtype), kmax, bv, vec, 1 if ctas <= sms else 2, False


def states_smem_bytes(kmax: int, bv: int, stages: int, tma: bool = False) -> int:
    """Dynamic shared memory of ``rtk_chunk_states`` (mirrors rtk_chunk_states_smem in the kernel):
    rows padded by 16 bytes, or for ``tma`` unpadded plus the alignment slack and the barriers."""
    if tma:
        return 2 * stages * CHUNK_KERNEL * (kmax + bv) + 1024 + 8 * stages
    return 2 * stages * CHUNK_KERNEL * ((kmax + 8) + (bv + 8))


def states_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, smem_limit: int, dlog: bool = False,
                  tma: bool = False) -> tuple:
    """Template arguments (DT, KMAX, BV, VEC, STAGES) of ``rtk_chunk_states``, the states-only
    pass of the split-sequence strategy for 16-bit inputs: BV 128 where KMAX <= 128 (k read once
    for up to 128 value columns: the pass is bandwidth-bound), else 64 (registers); 3 chunk stages
    (4 for ``dlog`` by cp.async) where they fit ``smem_limit`` bytes, else 2 (few instances to compile). Why 3:
    more loads in flight made the pass slower, not faster (H100, (1, 32, 16384, 128) bf16: 6, 5, 4,
    3 stages 115, 111, 100, 93-97 us; three stages beat four by 1.5-3 % on four split shapes;
    docs/performance.md, session 13). ``dlog``: the instance that also carries W = dS/dlog(gamma)
    for the split dq pass of a trainable decay (BV 64, as that pass's tiles: S and W in registers),
    with a sixth argument, DLOG = true; four stages by cp.async (not measured again), three by tensor
    copies (a trainable long step's states kernels 242 -> 232 us on an H100). ``tma`` (aligned rows
    on compute capability 9.0; :func:`states_tma`): tiles loaded by tensor copies and the state
    updated by wgmma (sm_90a code, :data:`WGMMA_OPTIONS`), the seventh argument TMA = true (DLOG
    then given as the sixth); with them too, 4, 5 and 6 stages were slower than 3 (long: 84, 96,
    101, 113 us) and 2 about as fast."""
    kmax = _kmax(dk)
    bv = 64 if dlog or kmax > 128 else 128
    most = 4 if dlog and not tma else 3
    stages = most if states_smem_bytes(kmax, bv, most, tma) <= smem_limit else 2
    tail = (dlog, True) if tma else (True,) if dlog else ()
    return (dtype_code(dtype), kmax, bv, vec, stages) + tail


def states_tma(dev: int, dk: int, vec: bool, over: "Overrides", dlog: bool = False) -> bool:
    """Whether the states pass takes its Hopper instance (tiles by tensor copies, the state update
    on wgmma): on compute capability 9.0 where wgmma may run (:func:`_wgmma_ok`), every operand
    row 16-byte aligned (their strides then suit a tensor map), unless ``Overrides.tensor_copies``
    is False; not for ``dlog`` at Dk <= 64 (its one 64 x 64 block of S leaves the second
    warpgroup nothing). The launch still falls back when the driver refuses a map. Measured on an
    H100 (docs/performance.md, session 16), the pass's own time against cp.async and mma.sync:
    (1, 32, 16384, 128) 99.6 -> 84.2 us, (2, 8, 65536, 64) 104 -> 89, (1, 8, 16384, 256) 113 -> 95."""
    return (vec and over.tensor_copies and not (dlog and _kmax(dk) <= 64) and _capability(dev) == (9, 0)
            and _wgmma_ok(dev, over))


def fold_parts(seg_len: int, segments: int, tiles: int, sms: int) -> int:
    """Slots per segment of the states pass (``rtk_chunk_states``) for ``segments`` segments of
    ``seg_len`` tokens and ``tiles`` (batch, head, value-tile) CTAs per slot: each segment but the
    last in as many equal parts of whole chunks, at least 4 chunks each, as keep its CTAs within
    one per multiprocessor (1: one slot per segment). Why: the pass runs one CTA per tile and slot,
    and a CTA keeps its SM busy, so a pass of fewer CTAs than SMs leaves SMs idle: on an H100 the
    dq pass with dlog(gamma) at (1, 32, 16384, 128) had 64 states CTAs (0.170 ms); in 2 parts,
    128 CTAs took 0.095 ms (4 parts, 256 CTAs two a SM, 0.094). Parts never fill more than one
    wave: the SMs are the bottleneck, so a second CTA on an SM runs no faster (96 CTAs of the
    forward at that shape in 2 parts, 192 CTAs of two per SM: 0.138 -> 0.146 ms per pass, and each
    segment's CTAs then fold twice the slots)."""
    chunks = seg_len // CHUNK_KERNEL
    if segments < 2:
        return 1
    most = min(max(1, sms // (tiles * (segments - 1))), chunks // 4)
    return max((r for r in range(1, most + 1) if chunks % r == 0), default=1)


def states_options(config: tuple) -> tuple[str, ...]:
    """Compiler options of a ``rtk_chunk_states`` instance: the TMA ones run wgmma (sm_90a)."""
    return WGMMA_OPTIONS if len(config) > 6 and config[6] else ()


def states_name(config: tuple) -> str:
    return "rtk_chunk_states<" + ", ".join(str(c).lower() for c in config) + ">"


def _states_configs() -> set[tuple]:
    plain = {states_config(dt, dk, 128, vec, limit) for dt in (torch.float16, torch.bfloat16)
             for dk in (64, 128, 256) for vec in (False, True) for limit in (SMEM_LIMIT_SM90, *SMEM_LIMITS_OTHER)}
    tma = {states_config(dt, dk, 128, True, SMEM_LIMIT_SM90, dlog, tma=True) for dt in (torch.float16, torch.bfloat16)
           for dk in (64, 128, 256) for dlog in (False, True) if not dlog or dk == 128}
    dlog = {states_config(dt, dk, 64, True, SMEM_LIMIT_SM90, dlog=True) for dt in (torch.float16, torch.bfloat16)
            for dk in (64, 128)}
    return plain | dlog | tma


def all_configs() -> list[tuple]:
    """Every ``rtk_chunk_fwd*`` template the plans and the tuner ask for (the wgmma kernel at the
    stages :func:`default_stages` gives it: another count, which only ``Overrides.stages`` forces,
    compiles on first use)."""
    plain = {kernel_config(dt, dk, dv, vec, ctas, 1) for dt in (torch.float16, torch.bfloat16)
             for dk in (64, 128, 256) for dv in (32, 64) for vec in (False, True) for ctas in (1, 2)}
    wg = {kernel_config(dt, dk, 128, vec, 1, 1, True, bv, stages=default_stages(dt, bv))
          for dt in (torch.float16, torch.bfloat16) for dk in (64, 128) for vec in (False, True) for bv in (64, 128)}
    dlog = {dlog_config(dt, dk, True, z) for dt in (torch.float16, torch.bfloat16) for dk in (64, 128)
            for z in (False, True)} | {dlog_config(torch.bfloat16, dk, True, True, True) for dk in (64, 128)}
    dual = {dual_config(dt, dk, dv, True, z) for dt in (torch.float16, torch.bfloat16)
            for dk in (64, 128) for dv in (64, 128) for z in (False, True)}
    tma = {_tma_config(c) for c in wg if c[3]} | {_tma_config(c) for c in dlog if c is not None}
    return sorted(plain | wg | dlog | dual | tma | _f32_configs())


def _tma_config(config: tuple) -> tuple:
    """The TMA instance of a plain wgmma :func:`kernel_config` template on aligned rows, or of a dq
    pass that sums dlog(gamma) (:func:`dlog_config`): (DT, KMAX, BV, VEC, MINB, WG, DLOG, STAGES, DUAL
    = false, TMA = true)."""
    return (*config[:6], config[6] if len(config) > 6 else False, fwd_stages(config), False, True)


@functools.lru_cache(maxsize=None)
def _tma_variants() -> dict[str, tuple[str, int]]:
    tma = [c for c in all_configs() if len(c) == 10 and c[9]]
    # the name of the instance it doubles: 6 arguments (plain, 2 stages), 7 (a dlog pass), 8 (3 stages)
    return {name_expression(c[:7] if c[6] else c[:6] if c[7] == 2 else c[:8]): (name_expression(c), config_smem(c))
            for c in tma}


def tma_variant(name: str) -> Optional[tuple[str, int]]:
    """(name expression, dynamic shared memory) of the TMA instance of the wgmma instance ``name``
    (aligned rows; a plain forward, or a dq pass that sums dlog(gamma)), or None where there is
    none: the tiles arrive as tensor copies on an mbarrier per stage and the output rows leave as
    tensor stores (``cuda_src/chunk/fwd16.cu``, TMA). The launch takes it only for a forward walk
    over unpacked sequences whose tensor maps (q, k, v, out, and x for a dlog pass) the driver
    accepts, unless ``Overrides.tma_io`` is False."""
    return _tma_variants().get(name)


def dlog_config(dtype: torch.dtype, dk: int, vec: bool, zsplit: bool = False, wide: bool = False) -> Optional[tuple]:
    """Template arguments (DT, KMAX, BV, VEC, MINB, WG, DLOG) of the ``rtk_chunk_fwd`` instance that
    also sums dlog(gamma) (the backward's dq pass of a trainable decay, ``cuda_src/chunk/fwd16.cu``'s
    header): fp16 or bf16, 16-byte aligned rows, Dk (the pass's: the forward's Dv) <= 128, on the
    wgmma kernel with 64-wide value tiles; None where it does not exist. ``zsplit``: its Z form (DLOG
    2, ``cuda_src/chunk/dlog_rows.cuh``), else W's; with ``wide`` (bf16 only), the Z form with
    128-wide value tiles and Z kept only in its 16-bit copy (DLOG 3). The caller checks that the GPU
    runs sm_90a code."""
    if dtype not in (torch.float16, torch.bfloat16) or not vec or dk > KEY_PIECE:
        return None
    if wide:
        return (dtype_code(dtype), _kmax(dk), 128, True, 1, True, 3) if zsplit and dtype == torch.bfloat16 else None
    return dtype_code(dtype), _kmax(dk), 64, True, 1, True, 2 if zsplit else True


def dual_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, dlog: bool = False) -> Optional[tuple]:
    """Template arguments (DT, KMAX, BV, VEC, MINB, WG, DLOG, STAGES, DUAL) of the ``rtk_chunk_fwd``
    instance that runs the backward's dk and dv passes as one walk (``cuda_src/chunk/fwd16.cu``'s
    header, DUAL): fp16 or bf16, 16-byte aligned rows, Dk <= 128 and Dv <= 128 (the forward's; dk
    contracts over all of Dv, so one value tile of 64 or 128 columns holds it), on the wgmma
    kernel; None where it does not exist. ``dlog``: the instance that also sums the Z split's terms
    of dlog(gamma) (DLOG 2). The caller checks that the GPU runs sm_90a code."""
    if dtype not in (torch.float16, torch.bfloat16) or not vec or dk > KEY_PIECE or dv > 128:
        return None
    return dtype_code(dtype), _kmax(dk), 64 if dv <= 64 else 128, True, 1, True, 2 if dlog else False, 2, True


def tf32_wg_config(dk: int) -> tuple:
    """(DT, KMAX, BV, STAGES, EXACT, VEC, MINB, WG) of ``rtk_chunk_fwd_tf32`` (``cuda_src/chunk/
    fwd_tf32.cu``): float32 in the TF32 mode on wgmma (sm_90a), 16-byte aligned rows, Dk <= 128,
    64 value columns a CTA, two stages. The caller checks that the GPU runs sm_90a code."""
    return dtype_code(torch.float32), _kmax(dk), 64, 2, False, True, 1, True


def _is_f32(config: tuple) -> bool:
    return config[0] == dtype_code(torch.float32)


def _is_tf32_wg(config: tuple) -> bool:
    return _is_f32(config) and len(config) > 7 and bool(config[7])


def name_expression(config: tuple) -> str:
    if _is_tf32_wg(config):
        return f"rtk_chunk_fwd_tf32<{config[1]}, {config[2]}>"
    if _is_f32(config):
        return "rtk_chunk_fwd_f32<" + ", ".join(str(c).lower() for c in config[1:]) + ">"
    return "rtk_chunk_fwd<" + ", ".join(str(c).lower() for c in config) + ">"


def smem_bytes(kmax: int, bv: int, wg: bool = False, dlog: bool = False, stages: int = 2, dual: bool = False,
               zsmem: bool = False, tma: bool = False) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd`` (mirrors rtk_chunk_smem in
    ``cuda_src/chunk/layout16.cuh``): ``stages`` stages of q/k/v tiles, two 16-bit state copies (one
    for KMAX 256), and with ``wg`` two buffers of output rows (one where two do not fit beside three
    stages); ``dlog`` (wgmma only): an x tile per stage and two copies of W; ``dual`` (wgmma only):
    an x tile per stage and one buffer of output rows as wide as the wider output; ``zsmem`` (with
    ``dlog``, DLOG 3): two S copies, one Z copy and one x tile outside the stages; ``tma``: an
    mbarrier per stage (the TMA instance, :func:`tma_variant`)."""
    c = CHUNK_KERNEL
    copies = 1 if kmax == 256 else 2
    if wg:  # 128-byte-swizzled tiles without padding, output-row buffers (rows padded by 16
        # bytes), + slack to align the base to 1024 bytes
        x = c * bv if (dlog and not zsmem) or dual else 0
        w = (kmax * bv + c * bv if zsmem else copies * kmax * bv) if dlog else 0
        head = stages * (2 * c * kmax + c * bv + x) + copies * kmax * bv + w
        # fp16 maxima (of W too with dlog), the OR ring, the TMA instance's mbarriers, alignment
        fixed = (64 if dlog else 32) + 8 + (8 * stages if tma else 0) + 1024
        row = (max(kmax, bv) if dual else bv) + 8
        obuf = 2 if not dual and 2 * (head + 2 * c * row) + fixed <= SMEM_LIMIT_SM90 else 1
        return 2 * (head + obuf * c * row) + fixed
    return 2 * (stages * (2 * c * (kmax + 8) + c * (bv + 8)) + copies * kmax * (bv + 8)) + 32 + 8


def f32_threads(exact: bool) -> int:
    """Threads of a ``rtk_chunk_fwd_f32`` CTA (rtk_chunk_f32_smem::THREADS): 4 output warps and 8
    state warps in the exact mode (its operand splits leave gaps a third warp per SM sub-partition
    fills), 4 in the TF32 mode."""
    return 384 if exact else 256


def f32_smem_bytes(kmax: int, bv: int, stages: int = 2) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd_f32`` with ``stages`` stages (mirrors
    rtk_chunk_f32_smem in the kernel): per stage the q, k and v tiles, then the fp32 state copy and
    the 8 q S pieces the state warps compute (16 x BV/4 floats each)."""
    c = CHUNK_KERNEL
    return 4 * (stages * (2 * c * (kmax + 4) + c * (bv + 4)) + kmax * (bv + 8) + 8 * 16 * (bv // 4))


def tf32_wg_smem_bytes(kmax: int, bv: int) -> int:
    """Dynamic shared memory of ``rtk_chunk_fwd_tf32`` (mirrors rtk_tf32_smem in the kernel): two
    stages of q, k and v^T tiles, two fp32 copies of S^T, the OR ring, the 1024-byte alignment slack."""
    c = CHUNK_KERNEL
    return 4 * (2 * (2 * c * kmax + bv * c) + 2 * bv * kmax) + 8 + 1024


def tf32_states_config(dk: int, dv: int) -> tuple[int, int, int]:
    """(KMAX, BV, STAGES) of ``rtk_chunk_states_tf32`` (``cuda_src/chunk/states_tf32.cu``), the
    states pass of float32's split sequence in the "tf32" mode where ``rtk_chunk_fwd_tf32`` runs:
    KMAX as the fused pass's, BV 128 (k read once for up to 128 value columns) or 64 for Dv <= 64,
    three chunk stages (as :func:`states_config` for 16-bit; they fit Hopper's shared memory, the
    only GPU the wgmma plan runs on)."""
    return _kmax(dk), 64 if dv <= 64 else 128, 3


def tf32_states_name(config: tuple[int, int, int]) -> str:
    return "rtk_chunk_states_tf32<" + ", ".join(map(str, config)) + ">"


def tf32_states_smem_bytes(config: tuple[int, int, int]) -> int:
    """Dynamic shared memory of ``rtk_chunk_states_tf32`` (mirrors rtk_states_tf32_smem): per stage
    a chunk of k and of v rows, fp32, each row padded by 8 floats."""
    kmax, bv, stages = config
    return 4 * stages * CHUNK_KERNEL * ((kmax + 8) + (bv + 8))


def config_smem(config: tuple) -> int:
    """Dynamic shared memory of a :func:`kernel_config` template, any of the three kernels."""
    if _is_tf32_wg(config):
        return tf32_wg_smem_bytes(config[1], config[2])
    if _is_f32(config):
        return f32_smem_bytes(config[1], config[2], config[3])
    dual = len(config) > 8 and config[8]
    dlog = len(config) > 6 and config[6]
    return smem_bytes(config[1], config[2], config[5], bool(dlog) and not dual, fwd_stages(config), dual,
                      dlog == 3 and not dual, len(config) > 9 and config[9])


def fwd_stages(config: tuple) -> int:
    """Tile stages of a 16-bit :func:`kernel_config` template (its eighth argument, 2 if absent)."""
    return config[7] if len(config) > 7 else 2


# ---- float32: tiles that fit the device's shared memory ------------------------------------------

#: Largest dynamic shared memory per CTA (opt-in) of sm_90 (H100/H200) and of sm_100.
SMEM_LIMIT_SM90 = 227 * 1024
#: The same for sm_80 / sm_87 (A100, Orin) and for sm_86 / sm_89 / sm_120 (consumer GPUs, L40S).
SMEM_LIMITS_OTHER = (163 * 1024, 99 * 1024)

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
    return out | {tf32_wg_config(dk) for dk in (64, 128)}


@functools.lru_cache(maxsize=None)
def _smem_limit(dev: int) -> int:
    """Largest dynamic shared memory per CTA (opt-in) of device ``dev``, in bytes."""
    props = torch.cuda.get_device_properties(dev)
    limit = getattr(props, "shared_memory_per_block_optin", 0)
    if not limit:
        import cupy

        limit = cupy.cuda.Device(dev).attributes["MaxSharedMemoryPerBlockOptin"]
    return int(limit)


def aligned(x: torch.Tensor, reverse: bool = False) -> bool:
    """Whether every row the kernel reads starts on 16 bytes (the cp.async loads): the first row it
    reads (token N-1 with ``reverse``) and strides that are multiples of 16 bytes (either sign)."""
    s = x.stride()
    per16 = 16 // x.element_size()
    return row_address(x, reverse) % 16 == 0 and s[0] % per16 == 0 and s[1] % per16 == 0 and s[2] % per16 == 0


@functools.lru_cache(maxsize=None)
def _sm_count(dev: int) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(dev: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(dev)


def _is_sm90(dev: int) -> bool:
    return _capability(dev) == (9, 0) and os.environ.get("RTKERNELS_NO_WGMMA") != "1"


def _wgmma_ok(dev: int, overrides: Overrides) -> bool:
    """Whether the wgmma kernel may run on device ``dev``: compute capability 9.0 exactly (sm_90a
    code runs on no other), unless RTKERNELS_NO_WGMMA=1 or ``overrides.wgmma`` says otherwise."""
    return _is_sm90(dev) if overrides.wgmma is None else overrides.wgmma


#: Compiler options of the wgmma instances (Hopper-specific code).
WGMMA_OPTIONS = ("-arch=sm_90a",)


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What a test or a measurement may force on the chunk kernel's plan (None: the heuristic or
    the tuned config decides). ``segments``: the number of sequence segments; ``wgmma``: the wgmma
    kernel on or off; ``bv``: the value-tile width. float32 inputs take ``segments``, and in the
    TF32 mode ``wgmma`` (off: ``rtk_chunk_fwd_f32`` on Hopper too) and ``bv`` (anything but 64
    also leaves the wgmma kernel); otherwise their BV follows the shared memory. ``dedicated_states``: the
    split-sequence strategy of 16-bit inputs, the states kernel ``rtk_chunk_states`` plus a fused
    pass folding its slots (True), or the fused kernel's states-only mode, ``rtk_chunk_seg_scan``
    and the fused pass (False; float32 never folds: in the "tf32" mode on the wgmma kernel True
    gives ``rtk_chunk_states_tf32`` for the first pass, elsewhere float32 takes the states-only
    mode). ``key_pieces``: 16-bit inputs with
    Dk > :data:`KEY_PIECE` on the wgmma kernel as pieces of key columns (True, where wgmma runs),
    or the Dk-256 mma.sync kernel in one pass (False); None: the tuned config, else pieces where
    wgmma runs. ``stages``: chunk stages of q/k/v tiles of the wgmma kernel (2 or 3; 3 only where
    every operand row is 16-byte aligned); None: :func:`default_stages`. ``tensor_copies``: the
    states pass takes its Hopper instance (tensor copies and wgmma) where it can
    (:func:`states_tma`), or always cp.async and mma.sync. ``fused_dk_dv``: the backward's dk and
    dv passes as one walk (:func:`fuses_dk_dv`): True wherever it can, False never, None the
    heuristic. ``dlog_split``: a trainable decay's dlog(gamma) by the Z split
    (:func:`rtkernels.methods.chunk.decay_grad.z_split_applies`): False never, True wherever it
    applies, None where its dq pass is 128 wide and W's pass has no tensor-copy twin.
    ``dlog_wide``: the Z split's dq pass with 128-wide value tiles, Z kept only in its 16-bit copy
    (bf16; :func:`dlog_config` with ``wide``): False never, True wherever it exists, None where the
    64-wide pass would need two waves (:func:`dlog_launch`). ``tma_io``: a forward walk's wgmma
    kernel with its tiles by tensor copies and its output rows by tensor stores (:func:`tma_variant`)
    where it can (True), or by cp.async and bulk copies of rows (False)."""

    segments: Optional[int] = None
    wgmma: Optional[bool] = None
    bv: Optional[int] = None
    dedicated_states: bool = True
    key_pieces: Optional[bool] = None
    stages: Optional[int] = None
    tensor_copies: bool = True
    fused_dk_dv: Optional[bool] = None
    dlog_split: Optional[bool] = None
    dlog_wide: Optional[bool] = None
    tma_io: bool = True

    @property
    def steers_plan(self) -> bool:
        """Whether the plan ignores the tuned config (a segment count, kernel, width, key split or
        stage count is forced)."""
        return self.segments is not None or self.wgmma is not None or self.bv is not None or \
            self.key_pieces is not None or self.stages is not None


#: The :class:`Overrides` in force; :func:`override` sets it for a block (tests may also replace
#: it, e.g. with pytest's monkeypatch).
overrides = Overrides()


def current_overrides() -> Overrides:
    """The :class:`Overrides` in force (part of the cached call's plan epoch)."""
    return overrides


@contextlib.contextmanager
def override(**changes) -> Iterator[Overrides]:
    """Within the block, the chunk kernel's plan follows ``Overrides(**changes)`` (fields not
    named keep their values), e.g. ``with override(segments=4): causal_linear_attention(...)``."""
    global overrides
    prev = overrides
    overrides = dataclasses.replace(prev, **changes)
    try:
        yield overrides
    finally:
        overrides = prev


#: Widest key piece of the wgmma kernel (its KMAX).
KEY_PIECE = 128


def key_pieces(dtype: torch.dtype, dk: int, dev: int, overrides: Overrides,
               tuned: Optional[bool] = None) -> Optional[list[slice]]:
    """The key columns in equal pieces, each a multiple of 8 (16-byte aligned slices) but the last,
    of at most :data:`KEY_PIECE` for 16-bit inputs on the wgmma kernel, else of at most
    :data:`MAX_DIM`; None where Dk fits one piece. The wgmma pieces are chosen by
    ``overrides.key_pieces`` where set (and wgmma runs), else by ``tuned`` (the stored winner's
    ``key_pieces``) where known, else wherever the wgmma kernel runs.

    Why: the scores q_i . k_j and the state's rows split over key columns, so the operator is the
    sum of the operator on each piece (and the final state the pieces' states stacked). On an H100
    two wgmma passes of Dk 128 beat one pass of the Dk-256 mma.sync kernel, which fits one CTA per
    SM and forms q k^T again for each 32-column value tile. Pieces of MAX_DIM serve the backward's
    dq and dk passes, whose "keys" are v and dL/do: Dv wide, up to :data:`MAX_VALUE_DIM`."""
    if dtype == torch.float32:
        wgmma = False
    elif tuned is not None and overrides.key_pieces is None:
        wgmma = tuned  # the stored winner was timed on this GPU, as a tuned wgmma config is
    else:
        wgmma = overrides.key_pieces is not False and _wgmma_ok(dev, overrides)
    return _split_keys(dk, KEY_PIECE if wgmma else MAX_DIM)


def _split_keys(dk: int, widest: int) -> Optional[list[slice]]:
    """Dk key columns in equal pieces of at most ``widest``, each a multiple of 8 but the last
    (:func:`key_pieces`); None where Dk fits one piece."""
    if dk <= widest:
        return None
    count = -(-dk // widest)
    step = -(-(-(-dk // count)) // 8) * 8
    return [slice(a, min(a + step, dk)) for a in range(0, dk, step)]


def _piece_problem(p: Problem) -> Problem:
    """``p`` as its widest key piece on the wgmma kernel (what a key-pieces config runs per piece)."""
    pieces = _split_keys(p.dk, KEY_PIECE)
    return p if pieces is None else dataclasses.replace(p, dk=pieces[0].stop)


#: The field ``mode`` of the chunk kernels' parameters (RTK_MODE_* in the kernels).
MODE_FUSED, MODE_STATES, MODE_FOLD = 0, 1, 2
#: The fields of ``rtk_chunk_shape`` after its ``rtk_fwd_shape`` (``cuda_src/chunk/modes.cuh``; a test
#: holds them against the header): the segment length, the mode, the tokens per states-pass slot
#: (:func:`fold_parts`; read in RTK_MODE_FOLD), and the packed sequences' offsets
#: address (0: none), the address of their validity flag, whether the launch is reversed, the
#: address of the fourth operand x (the DLOG and DUAL instances), for the DLOG instances
#: (:func:`dlog_config`) the addresses of the partial sums and of the final state's gradient, and
#: for the DUAL ones (:func:`dual_config`) the address of the second output (0 elsewhere, and for
#: no such gradient).
CHUNK_FIELDS = ("seg_len", "mode", "fold_len", "cu_seqlens", "cu_valid", "cu_reverse", "x", "dlog_out",
                "dlog_g", "out2")
#: The fields after (seg_len, mode, fold_len) of a launch with none of them set.
NO_EXTRAS = (0,) * (len(CHUNK_FIELDS) - 3)


class Launch(NamedTuple):
    """A planned fused pass: name expression, value-tile width, sequence segments, dynamic shared
    memory, threads per CTA, compiler options, and the source holding the kernel."""

    name: str
    bv: int
    segments: int
    smem: int
    threads: int
    options: tuple
    source: str


def segments_for(bh_tiles: int, n: int, sms: int, ctas_per_sm: int = 2, min_chunks: int = 8) -> int:
    """The split-sequence heuristic: when the (batch, head, value-tile) CTAs fill at most half the
    multiprocessors and the sequence holds at least 2048 tokens, split it into segments of at least
    ``min_chunks`` chunks, as many as fit in one wave of ``ctas_per_sm`` CTAs per multiprocessor
    (the extra states pass costs less than idle multiprocessors; a second, partial wave costs more)."""
    if 2 * bh_tiles > sms or n < 2048:
        return 1
    return max(1, min(ctas_per_sm * sms // bh_tiles, n // (min_chunks * CHUNK_KERNEL)))


def tf32_wg_planned(dk: int, dv: int, vec: bool, dev: int, overrides: Overrides = Overrides()) -> bool:
    """Whether a float32 pass in the "tf32" mode runs ``rtk_chunk_fwd_tf32`` (wgmma, 64 value
    columns a CTA): on compute capability 9.0, 16-byte aligned rows, Dk <= 128 and Dv > 32. With
    Dv <= 32 half of its tile would idle, and the mma.sync kernel's 32-wide tiles are faster (H100,
    (8, 1, 65536, 64 / 32) fwd+bwd 1.66 against 1.75 ms); forcing wgmma takes it anyway."""
    return (dk <= 128 and vec and overrides.bv in (None, 64) and (dv > 32 or overrides.wgmma is True)
            and _wgmma_ok(dev, overrides))


def tf32_wg_segments(bh_tiles: int, n: int, sms: int) -> int:
    """Segments of float32's wgmma kernel (``rtk_chunk_fwd_tf32``, one CTA per SM). Its states-only
    period costs about what its fused one does, so the split is planned as for two CTAs per SM with
    segments of at least 32 chunks. H100, fwd+bwd ms by segments: (1, 32, 16384, 128) 2: 5.02,
    **4: 4.74**, 8: 4.89; (1, 16, 32768, 128) 4: 5.04, **8: 4.80**, 16: 4.89; (1, 8, 65536, 128)
    8: 5.03, **16: 4.79**; (2, 8, 16384, 64) **8: 0.95**, 16: 1.00 (bold: this rule's choice)."""
    return segments_for(bh_tiles, n, sms, 2, 32)


def tf32_dlog_segments(bh_tiles: int, n: int, sms: int) -> int:
    """Segments of float32's "tf32" dlog(gamma) kernel (``rtk_chunk_decay_grad_tf32``, one CTA per
    SM, ``bh_tiles`` CTAs a segment): :func:`segments_for` with one CTA per SM and
    segments of at least 32 chunks. Its states pass (each segment but the last, k and v only)
    costs less than the walk it splits. H100, the kernel alone in ms by segments: (1, 32, 16384,
    128) 1: 1.42, **2: 1.08**, 4: 1.10; (1, 16, 32768, 128) 2: 2.07, **4: 1.05**, 8: 1.07; (2, 8,
    16384, 64) 1: 1.66, **8: 0.32**; (1, 8, 65536, 128) 1: 5.48, **8: 1.05**, 16: 1.10 (bold: this
    rule's choice)."""
    return segments_for(bh_tiles, n, sms, 1, 32)


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
    columns, one CTA per SM) when Dv > 64 and the (batch, head) CTAs fill at least 3/4 of the SMs;
    else 64 where 64-wide tiles fill 3/4 of them (one wave, no sequence split: on an H200 the key
    pieces of d256 and RetNet's heads took 0.31 ms this way against 0.40 and 0.35 with BV 128 and two
    segments); else 128 where the sequence is split anyway (N >= 2048 and at most half the SMs
    busy), else 64 (twice the CTAs for a grid that would leave SMs idle)."""
    t128, t64 = bh * -(-dv // 128), bh * -(-dv // 64)
    if dv <= 64:
        return 64
    if 4 * t128 >= 3 * sms:
        return 128
    if 4 * t64 >= 3 * sms:
        return 64
    return 128 if 2 * t128 <= sms and n >= 2048 else 64


def _default_bv(dtype: torch.dtype, dk: int, dv: int, smem_limit: int) -> int:
    """BV of the mma.sync kernels' heuristic (float32: the widest tile that fits, 32 if none)."""
    if dtype == torch.float32:
        tile = f32_config(dk, dv, smem_limit)
        return 32 if tile is None else tile[1]
    return kernel_config(dtype, dk, dv, True)[2]


def _launch_of(config: Optional[tuple], nseg: int) -> Launch:
    """The :class:`Launch` of a :func:`kernel_config` template with ``nseg`` segments."""
    if config is None:
        raise ValueError("no rtk_chunk_fwd_f32 tile fits this GPU's shared memory")
    f32, tf32_wg = _is_f32(config), _is_tf32_wg(config)
    wg = tf32_wg or (not f32 and config[5])
    threads = f32_threads(config[4]) if f32 else 256
    source = TF32_WG_SOURCE if tf32_wg else F32_SOURCE if f32 else FWD16_SOURCE
    return Launch(name_expression(config), config[2], nseg, config_smem(config), threads,
                  WGMMA_OPTIONS if wg else (), source)


@functools.lru_cache(maxsize=4096)
def plan_launch(dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int, n: int, dev: int,
         overrides: Overrides = Overrides(), exact: bool = True) -> Launch:
    """The heuristic's launch on device ``dev`` (no tuned config); ``exact``: the float32
    kernel's mode (3xTF32, else TF32)."""
    if dtype == torch.float32:
        wg = not exact and tf32_wg_planned(dk, dv, vec, dev, overrides)
    else:
        wg = dk <= 128 and _wgmma_ok(dev, overrides)
    sms, limit = _sm_count(dev), _smem_limit(dev)
    if not wg:
        bv = _default_bv(dtype, dk, dv, limit)
    else:  # float32's wgmma kernel: 64 columns
        bv = 64 if dtype == torch.float32 else overrides.bv or value_tile(dv, bh, n, sms)
    tiles = bh * -(-dv // bv)
    nseg = overrides.segments or (
        tf32_wg_segments(tiles, n, sms) if wg and dtype == torch.float32 else
        segments_for(tiles, n, sms, ctas_per_sm(dtype, dk, bv, wg, limit, exact)))
    stages = overrides.stages or default_stages(dtype, bv)
    return _launch_of(kernel_config(dtype, dk, dv, vec, tiles * nseg, sms, wg, bv, exact, limit, stages), nseg)


def default_stages(dtype: torch.dtype, bv: int) -> int:
    """Tile stages of the wgmma kernel (where it runs, on aligned rows): 3 for bf16 with 64-wide
    value tiles, else 2. Why (H100, kernel time alone, 2 -> 3 stages): bf16 BV 64 at (8, 16, 2048,
    64) 0.0598 -> 0.0544 ms, (2, 32, 1024, 128) 0.0348 -> 0.0342, (4, 16, 4096, 128) 0.1225 ->
    0.1195; BV 128, where the third stage leaves room for one output buffer only, 1.5 % slower at
    (4, 32, 4096, 128) and (1, 32, 16384, 128); fp16 (its second barrier a chunk) 1-2 % slower
    but at d64."""
    return 3 if dtype == torch.bfloat16 and bv == 64 else 2


def packed_launch(dtype: torch.dtype, dk: int, dv: int, vec: bool, bh: int, n: int, dev: int,
                  overrides: Overrides = Overrides(), exact: bool = True) -> Launch:
    """The launch of a pass over packed sequences (``cu_seqlens``; ``bh`` = S * H CTA rows of
    ``n`` tokens on average): :func:`plan_launch` with one segment always. The split-sequence
    strategy would need each sequence's segment count, which the host does not know without
    reading the offsets (a sync); the tuned store is not consulted either (its entries are per
    (B*H, N) shape, not per distribution of lengths)."""
    return plan_launch(dtype, dk, dv, vec, bh, n, dev, dataclasses.replace(overrides, segments=1), exact)


@functools.lru_cache(maxsize=256)
def dlog_launch(dtype: torch.dtype, dk: int, dv: int, bh: int, n: int, dev: int,
                overrides: Overrides = Overrides(), zsplit: bool = False) -> Launch:
    """The launch of the dq pass that also sums dlog(gamma) (:func:`dlog_config`'s instance, which
    must exist for ``dtype`` and ``dk``), ``bh`` CTA rows of ``n`` tokens and ``dv`` value columns in
    tiles of 64: split into segments as the forward is (:func:`segments_for`, one CTA per SM;
    ``overrides.segments`` wins), the states pass then carrying W beside S
    (:func:`states_config` with ``dlog``). ``zsplit``: the Z form, in one segment (segments would
    need the states pass to carry Z); in bf16 with 64 < Dv <= 128 its 128-wide instance (DLOG 3)
    where the 64-wide one would need more than one wave of CTAs (2 ``bh`` > SMs), and
    ``overrides.dlog_wide`` is not False (True: wherever it exists)."""
    sms = _sm_count(dev)
    nseg = 1 if zsplit else overrides.segments or segments_for(bh * -(-dv // 64), n, sms, 1)
    wide = (zsplit and overrides.dlog_wide is not False and dtype == torch.bfloat16 and 64 < dv <= 128
            and (overrides.dlog_wide or 2 * bh > sms))
    return _launch_of(dlog_config(dtype, dk, True, zsplit, wide), split(n, nseg)[1])


@functools.lru_cache(maxsize=256)
def dual_launch(dtype: torch.dtype, dk: int, dv: int, bh: int, n: int, dev: int,
                overrides: Overrides = Overrides(), zsplit: bool = False) -> Launch:
    """The launch of the backward's fused dk and dv pass (:func:`dual_config`'s instance, which must
    exist for these arguments) over ``bh`` CTA rows of ``n`` tokens, one CTA per (batch, head) and
    segment: split as the forward is (:func:`segments_for`, one CTA per SM; ``overrides.segments``
    wins), the segments folding the dedicated states pass's slots. ``zsplit``: the instance that also
    sums the Z split's terms of dlog(gamma)."""
    nseg = overrides.segments or segments_for(bh, n, _sm_count(dev), 1)
    return _launch_of(dual_config(dtype, dk, dv, True, zsplit), split(n, nseg)[1])


def fuses_dk_dv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, dk: torch.Tensor,
                overrides: Overrides, sequences: int = 0) -> bool:
    """Whether the backward runs its dk and dv passes as one walk (:func:`dual_launch`) for the
    forward's q, k, v, the output's gradient and the dk buffer (CUDA tensors the chunk kernel
    takes): its instance exists (:func:`dual_config`; every operand row 16-byte aligned, read
    from the last token, with a unit last stride), wgmma runs, v and dL/do have one set of
    strides (the kernel reads its fourth tile with the third's), dk has q's (its second output is
    written with the second operand's strides), and ``overrides.fused_dk_dv`` allows it: True wherever it can, None where
    the dv pass alone would take one value tile holding all of Dv (:func:`value_tile`), since the
    fused pass runs one CTA per (batch, head) and segment; False never. ``sequences`` > 0: a pass
    over that many packed sequences (S * H CTA rows, never split: :func:`packed_launch`), which
    the heuristic fuses where those rows fill 3/4 of the SMs."""
    if (overrides.fused_dk_dv is False or not q.is_cuda or v.stride() != grad_out.stride()
            or dk.stride() != q.stride() or any(x.stride(-1) != 1 for x in (q, k, v, grad_out))):
        return False  # (a pass copies an operand without a unit last stride: x and dk would not follow)
    b, h, n, d_k = q.shape
    d_v = v.shape[-1]
    dev = q.device.index
    vec = all(aligned(x, True) for x in (q, k, v, grad_out))
    if dual_config(q.dtype, d_k, d_v, vec) is None or not _wgmma_ok(dev, overrides):
        return False
    if overrides.fused_dk_dv is True or d_v <= 64:
        return True
    sms = _sm_count(dev)
    if sequences:  # one segment: 128-wide tiles where (sequence, head) rows fill 3/4 of the SMs
        return 4 * sequences * h >= 3 * sms
    return value_tile(d_v, b * h, n, sms) >= d_v


def split(n: int, segments: int) -> tuple[int, int]:
    """(segment length, segments) of ``n`` tokens asked to split in ``segments``: the length a
    multiple of the chunk, the count what that length gives (at most the one asked, at least 1)."""
    seg_len = max(1, -(-n // (segments * CHUNK_KERNEL))) * CHUNK_KERNEL
    return seg_len, max(1, -(-n // seg_len))


def _tune_default(p: Problem, limits: Limits) -> dict:
    """The heuristic (:func:`key_pieces` and :func:`plan_launch`'s choices) as a tuning config:
    16-bit Dk > :data:`KEY_PIECE` on compute capability 9.0 as key pieces, each planned as a pass
    of its width."""
    dt = p.torch_dtype
    if dt != torch.float32 and limits.cc == (9, 0) and p.dk > KEY_PIECE:
        return {**_tune_default(_piece_problem(p), limits), "key_pieces": True}
    wg = dt != torch.float32 and limits.cc == (9, 0) and p.dk <= 128
    bv = value_tile(p.dv, p.bh, p.n, limits.sms) if wg else _default_bv(dt, p.dk, p.dv, limits.max_smem)
    nseg = segments_for(p.bh * -(-p.dv // bv), p.n, limits.sms, ctas_per_sm(dt, p.dk, bv, wg, limits.max_smem))
    nseg = split(p.n, nseg)[1]
    return {"key_pieces": False, "wgmma": wg, "bv": bv, "segments": nseg}


def _tune_check(p: Problem, config: dict, limits: Limits) -> Optional[str]:
    f32 = p.torch_dtype == torch.float32
    wg, bv, nseg = config.get("wgmma", False), config["bv"], config["segments"]
    if wg and f32:
        return "the tune space has no wgmma variant for fp32 (the heuristic takes rtk_chunk_fwd_tf32 in the tf32 mode)"
    if not wg and bv > 64:
        return "the mma.sync kernel takes BV 32 or 64"
    if config.get("key_pieces"):  # missing (stored before it was tuned): checked as the one pass it described
        if p.dk <= KEY_PIECE:
            return f"Dk <= {KEY_PIECE} runs in one pass"
        if f32 or not wg:
            return "key pieces run the wgmma kernel (the mma.sync kernel takes Dk 256 in one pass)"
        p = _piece_problem(p)  # the rest holds for each piece (the first is the widest)
    kmax = _kmax(p.dk)
    if wg and (kmax > 128 or bv < 64 or limits.cc != (9, 0)):
        return "the wgmma kernel takes Dk <= 128 and BV 64 or 128, on compute capability 9.0"
    if kmax == 256 and bv > 32:
        return "KMAX 256 with BV 64 needs more registers than a thread has"
    if bv > 32 and p.dv <= 32:
        return "BV wider than Dv"
    need = f32_smem_bytes(kmax, bv, 1) if f32 else smem_bytes(kmax, bv, wg)  # fp32: one stage at least
    if need > limits.max_smem:
        return f"needs {need} B of shared memory, the GPU gives {limits.max_smem}"
    seg_len, got = split(p.n, nseg)
    if nseg > 1 and got != nseg:
        return f"N = {p.n} gives fewer than {nseg} segments"
    if nseg > 1 and seg_len < 4 * CHUNK_KERNEL:
        return "segments shorter than 4 chunks"
    return None


#: The autotuner's space (rtkernels.autotune): for 16-bit Dk > KEY_PIECE on Hopper, key pieces on
#: the wgmma kernel or the Dk-256 kernel in one pass (``key_pieces``; the other parameters then
#: apply to each piece); the wgmma kernel or the mma.sync one, the tile width BV and the number of
#: sequence segments; KMAX follows Dk, VEC the operands' alignment, MINB the grid. float32 problems
#: get the part of it their kernel runs (one pass, no wgmma, BV 32 or 64; the stages follow the
#: shared memory), the rest is pruned with a reason by the check. A stored config without
#: ``key_pieces`` (written before it was tuned) keeps the plan's own choice of pieces.
TUNE_SPACE = Space(params={"key_pieces": (False, True), "wgmma": (False, True), "bv": (32, 64, 128),
                           "segments": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)},
                   default=_tune_default, check=_tune_check, open_params=("segments",),
                   optional_params=("key_pieces",))


@functools.lru_cache(maxsize=1024)
def tuned_launch(config: Config, problem: Problem, limits: Limits, *, vec: bool = True,
                 exact: bool = True) -> Launch:
    """The autotuner's adapter (every kernel method has one of this signature): a config of
    :data:`TUNE_SPACE` (sorted ``(name, value)`` pairs) for ``problem`` on a GPU of ``limits`` ->
    its :class:`Launch`. ``vec``: every operand row 16-byte aligned; ``exact``: the float32
    kernel's mode (its stages follow ``limits.max_smem``). A key-pieces config of a 16-bit
    ``problem`` wider than :data:`KEY_PIECE` gives the launch of its first (widest) piece; the
    call plans each piece as a problem of its own width (:func:`key_pieces`)."""
    c = dict(config)
    wg, bv, nseg = bool(c.get("wgmma", False)), c["bv"], c["segments"]
    if c.get("key_pieces") and problem.dtype != "fp32":
        problem = _piece_problem(problem)
    dv = problem.dv
    return _launch_of(kernel_config(problem.torch_dtype, problem.dk, dv, vec, problem.bh * -(-dv // bv) * nseg,
                                    limits.sms, wg, bv, exact, limits.max_smem,
                                    default_stages(problem.torch_dtype, bv)), nseg)


def instance_options() -> dict[str, tuple[str, ...]]:
    """The compiler options of the forward and states instances that need any (the wgmma ones:
    sm_90a code), by name expression, as their launches ask for them."""
    fwd = {name_expression(c): _launch_of(c, 1).options for c in all_configs() if _launch_of(c, 1).options}
    return {**fwd, **{states_name(c): states_options(c) for c in _states_configs() if states_options(c)}}


def instances() -> dict[str, list[str]]:
    """Every template instance the plans can ask for, by source (the CI compile test)."""
    fwd: dict[str, list[str]] = {FWD16_SOURCE: [], F32_SOURCE: [], TF32_WG_SOURCE: []}
    for c in all_configs():
        fwd[_launch_of(c, 1).source].append(name_expression(c))
    tf32_states = sorted({tf32_states_name(tf32_states_config(dk, dv)) for dk in (64, 128) for dv in (64, 128)})
    return {**fwd, STATES_SOURCE: sorted(states_name(c) for c in _states_configs()), STATES_TF32_SOURCE: tf32_states,
            SEG_SCAN_SOURCE: ["rtk_chunk_seg_scan"]}
