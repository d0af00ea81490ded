r"""dL/dlog(gamma) for the kernel backward: one CUDA kernel per operand width
(``cuda_src/chunk/decay_grad.cu`` for fp16/bf16, ``cuda_src/chunk/decay_grad_f32.cu`` for float32),
and the same computation in torch operations (:func:`torch_w_recurrence`) that the CPU tests check.

Per batch and head, chunks of C = 64 tokens (the last one L <= C long), local index t (queries)
/ s (keys), S_c the state entering chunk c and W_c = dS_c/dlog(gamma) its derivative, carried
forward with it (``do`` = dL/do, ``G`` = dL/d(final state), 0 when absent)::

    S_0 = S0 (or 0),  W_0 = 0
    S_{c+1} = gamma^L S_c + sum_s gamma^(L-1-s) k_s^T v_s
    W_{c+1} = gamma^L (W_c + L S_c) + sum_s (L-1-s) gamma^(L-1-s) k_s^T v_s
    dL/dlog(gamma) = scale * sum_c [ sum_t gamma^(t+1) q_t ((t+1) S_c + W_c) do_t^T
                                     + sum_{s<t} (t-s) gamma^(t-s) (q_t . k_s)(do_t . v_s) ]
                     + <G, W_end>

summed over the batch for each head. It is the derivative of ``L = sum_t do_t . o_t + <G, S_N>``
through o_t = scale q_t S_t, S_t = gamma^(t+1) S_c + sum_{s<=t} gamma^(t-s) k_s^T v_s, the same
number as the adjoint four-term formula of :mod:`rtkernels.autograd` (forward mode instead of
reverse mode). Every weight is non-negative and only non-negative powers of gamma appear: no
cancellation, no overflow, for any gamma in (0, 1] and any N.

The kernel (the header of the .cu file has the details): one CTA of 8 warps per (batch*head,
tile of BV value columns) walks the chunks with q, k, v, do in shared memory (cp.async, two
stages). S, W and the four Dk x Dv products of each chunk (A1 = sum_t (t+1) gamma^(t+1) q_t^T
do_t, A2 = sum_t gamma^(t+1) q_t^T do_t, and the k^T v sums of the two recurrences) live in
fp32 registers in one mma fragment layout, so ``<S, A1> + <W, A2>`` (the first term) and
``<G, W_end>`` are elementwise in registers; the intra-chunk term takes the causal 64 x 64 block
of q k^T and do v^T by mma. Operands are the 16-bit inputs; a per-token weight (from a table the
CTA makes once, as a 16-bit hi/lo pair applied by two packed fma) multiplies one operand, which
is rounded once to 16 bits (the weights normalised to at most 1 first, so fp16 neither overflows
nor loses a small gamma to its subnormals); accumulation is fp32 throughout. Each CTA
writes one partial sum (reduced in a fixed order); a second launch sums them over batches and tiles in
float64, per head in a fixed order: deterministic, no atomics.

**Float32.** ``rtk_chunk_decay_grad_f32`` is the same walk with fp32 tiles in shared memory and
TF32 tensor cores (mma.sync m16n8k8): a weight multiplies its operand in fp32 and only the product
is split, as 3xTF32 (hi + lo, about fp32 accuracy) in the "exact" mode or rounded once to TF32 in
the "tf32" mode; each chunk's k^T v sums start from zero and join S and W by fp32 FMAs (the tensor
cores' adder truncates, which compounds over a long sequence when S itself is the accumulator).
On Hopper the "tf32" mode with 16-byte aligned rows and Dk <= 128 runs ``rtk_chunk_decay_grad_tf32``
(``cuda_src/chunk/decay_grad_tf32.cu``, TF32 wgmma) instead: the same sum, each of a CTA's two
state warpgroups owning a 64 x 64 block of S and W (KMAX 128: 64 value columns a CTA; KMAX 64: 128), v
and do stored transposed in shared memory, and the causal block's term as sum_t do_t . (P~ v)_t
with P~ = (t - s) gamma^(t - s) q_t . k_s from registers (:func:`tf32_wg_kmax`). With KMAX 128 a
third warpgroup computes that term while the other two run the state products
(:func:`tf32_threads`; H100, (4, 32, 4096, 128): 0.64 ms, against 0.71 with two warpgroups and
1.79 for the mma.sync kernel; a trainable decay's step 1.25x the fixed one).

Work per CTA and chunk: four KMAX x BV x 64 products (the two over k and v in one pass) and the
causal block of two 64 x 64 score matrices (q k^T over KMAX, recomputed for each value tile;
do v^T over BV): about one forward pass. Memory: a ``[B, tiles, H]`` fp32 buffer. The mma.sync
kernels walk the chunks of a (batch, head) in one CTA, so few (batch, head) pairs with a long
sequence leave multiprocessors idle; where they are very few, the float32 kernel lets two CTAs
share a walk, each with half the state's rows (:func:`kernel_config_f32`, SLICES; the buffer is
then ``[B, 2 tiles, H]``). The wgmma kernel splits such a sequence into segments instead
(:func:`.plan.tf32_dlog_segments`): a first launch walks each segment but the last with the two
recurrences alone and leaves its own S and W in slots, and each later segment's CTAs start from
S and W entering it, W_in(z+1) = gamma^L (W_in(z) + L S_in(z)) + W_own(z), as the dq pass below
does (H100, (1, 32, 16384, 128): 1.42 -> 1.08 ms; a trainable decay's step 1.30x -> 1.22x the
fixed one). The buffer is then ``[segments * B, tiles, H]``.

**Inside the dq pass.** Where the backward's dq pass runs the wgmma kernel in fp16 or bf16
(:func:`dq_pass_sums`), that pass computes the same sum instead of this kernel, with no second walk
over the sequence (``cuda_src/chunk/fwd16.cu``, DLOG). The pass is the forward operator with
queries g = dL/do, keys v and values k; a CTA holds S^T (and W^T, carried beside it by the state
warps as above) for a tile of 64 columns of Dk, and its output warps hold g_t S^T scaled by
scale gamma^(t+1), the scores g_t . v_s scaled by scale gamma^(t-s), and (new) g_t W^T and the
partial scores q_t . k_s over the tile's columns. Dotting with q_t's columns of the tile::

    sum_t q_t . ((t+1) scale gamma^(t+1) g_t S^T + scale gamma^(t+1) g_t W^T) + sum_{s<t} (t-s) P_ts (q_t . k_s)

is the tile's share of the first two terms above (every term is linear in q's and k's columns, so
the tiles' shares add up to the whole), summed in fp32 and written once per CTA into the same
kind of buffer, then summed by the same second launch. Where few (batch, head, tile) CTAs walk a
long sequence, the pass splits it into segments as the forward does (:func:`.plan.dlog_launch`):
``rtk_chunk_states`` carries W beside S over each segment but the last, and the CTAs of segment
z + 1 start from S and W entering it, W_in(z+1) = gamma^L (W_in(z) + L S_in(z)) + W_own(z) (L the
segment's length; the derivative of S_in(z+1) = gamma^L S_in(z) + S_own(z)), each writing its own
partial sum. The products read the 16-bit copies of S
and W (rounded once, as the forward's S copy), the scores P in fp32 (not rounded to 16 bits).
fp16 carries W times a power of two dn (``rtk_dlog_norm``: the largest chunk weight m gamma^m times
dn lies in (1/2, 1], so its 16-bit weights neither overflow near gamma = 1 nor fall to subnormals for
small gamma; the states pass's W slots hold W dn too), and scales its W copy by a power of two of
its own, as it does the S copy.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ...decay import LogDecay
from ...jit import Kernel, dtype_code, get_function, launch
from .._launch import fwd_tail, unit_stride
from .plan import (WGMMA_OPTIONS, _sm_count, _wgmma_ok, aligned, current_overrides, dlog_config, dlog_launch, dual_launch,
                   fuses_dk_dv, split, tf32_dlog_segments, tma_variant)

__all__ = ["SOURCE", "SOURCE_F32", "SOURCE_TF32", "SUM_SOURCE", "SUM_KERNEL", "CHUNK", "kernel_config", "kernel_config_f32",
           "all_configs", "all_configs_f32", "name_expression", "name_expression_f32", "smem_bytes", "smem_bytes_f32",
           "tf32_wg_kmax", "tf32_wg_bv", "tf32_threads", "name_expression_tf32", "names_tf32", "smem_bytes_tf32", "instance_options",
           "kernel_log_decay_grad", "kernel_log_decay_grad_tf32",
           "dq_pass_sums", "dq_pass_partials", "sum_partials", "PartialSums", "torch_w_recurrence"]

SOURCE = "chunk/decay_grad.cu"
#: The float32 kernel (TF32 tensor cores; 3xTF32 in the "exact" mode).
SOURCE_F32 = "chunk/decay_grad_f32.cu"
#: The float32 kernel of the "tf32" mode on Hopper (TF32 wgmma, sm_90a code).
SOURCE_TF32 = "chunk/decay_grad_tf32.cu"
#: The kernel that sums the partial sums per head (and applies the decay's chain rule).
SUM_SOURCE, SUM_KERNEL = "chunk/decay_grad_sum.cu", "rtk_chunk_decay_grad_sum"
#: Tokens per chunk (the kernel's and :func:`torch_w_recurrence`'s).
CHUNK = 64


def kernel_config(dtype: torch.dtype, dk: int, dv: int, vec: bool, few_ctas: bool = False
                  ) -> tuple[int, int, int, bool]:
    """Template arguments (DT, KMAX, BV, VEC) of ``rtk_chunk_decay_grad``: KMAX the smallest of 64,
    128, 256 that holds Dk; BV 32 where KMAX = 256 (S, W and the scratch fragment of a warp's
    32 x 32 slice: 96 fp32 registers) or Dv <= 32, else 64; VEC: every row 16-byte aligned.
    ``few_ctas``: 64-wide value tiles would leave multiprocessors idle (no more CTAs than SMs);
    then Dv > 64 takes 32-wide tiles, twice the CTAs for the sequential walk over the chunks
    (H100, bf16, D = 128: 2.03 -> 1.09 ms at (1, 32, 16384), 0.156 -> 0.128 at (2, 32, 1024);
    slower where the SMs are already full: 0.71 -> 0.85 ms at (4, 32, 4096))."""
    kmax = 64 if dk <= 64 else 128 if dk <= 128 else 256
    bv = 32 if kmax == 256 or dv <= 32 or (few_ctas and dv > 64) else 64
    return dtype_code(dtype), kmax, bv, vec


def all_configs() -> list[tuple[int, int, int, bool]]:
    """Every instance :func:`kernel_config` can ask for (the CI compile test compiles them)."""
    return sorted({kernel_config(dt, dk, dv, vec, few) for dt in (torch.float16, torch.bfloat16)
                   for dk in (64, 128, 256) for dv in (32, 64, 128) for vec in (False, True) for few in (False, True)})


def name_expression(config: tuple) -> str:
    return "rtk_chunk_decay_grad<" + ", ".join(str(c).lower() for c in config) + ">"


def smem_bytes(kmax: int, bv: int) -> int:
    """Dynamic shared memory of the kernel (mirrors rtk_dg_smem): two stages of q, k (64 x KMAX) and
    v, do (64 x BV) in 16 bits, rows padded by 8 elements."""
    return 2 * 2 * CHUNK * (2 * (kmax + 8) + 2 * (bv + 8))


def kernel_config_f32(dk: int, dv: int, vec: bool, exact: bool, few_ctas: bool = False, fewer_ctas: bool = False
                      ) -> tuple[int, int, int, int, bool, bool]:
    """Template arguments (KMAX, BV, STAGES, SLICES, EXACT, VEC) of ``rtk_chunk_decay_grad_f32``: KMAX
    as :func:`kernel_config`'s; at KMAX 128 and Dv > 32, 64-wide value tiles in two stages unless
    ``few_ctas`` (64-wide tiles would leave more than half the multiprocessors idle); with
    ``fewer_ctas`` (32-wide ones would too) 32-wide tiles in one stage with the state's rows in two
    slices, each walked by its own CTA, two CTAs a multiprocessor; elsewhere BV 32 in two stages (one
    at KMAX 256: shared memory). EXACT: 3xTF32 (the "exact" mode). H100, fp32 "exact", D = 128, µs:
    32-wide two-stage / one-stage (two CTAs a multiprocessor) / 64-wide tiles (the first version)
    420 / 351 / 300 at (2, 32, 1024), 3242 / 2669 / 2310 at (4, 32, 4096), 3187 / 3436 / 4554 at
    (1, 32, 16384); 32-wide two-stage / sliced 1470 / 1045 at (1, 8, 8192), 2913 / 2283 at
    (1, 16, 16384), 2990 / 3140 at (1, 32, 16384)."""
    kmax = 64 if dk <= 64 else 128 if dk <= 128 else 256
    if kmax == 128 and fewer_ctas:
        return kmax, 32, 1, 2, exact, vec
    bv = 64 if kmax == 128 and dv > 32 and not few_ctas else 32
    return kmax, bv, 2 if kmax <= 128 else 1, 1, exact, vec


def all_configs_f32() -> list[tuple[int, int, int, int, bool, bool]]:
    """Every instance :func:`kernel_config_f32` can ask for."""
    return sorted({kernel_config_f32(dk, dv, vec, exact, few, fewer) for dk in (64, 128, 256) for dv in (32, 64)
                   for vec in (False, True) for exact in (False, True) for few in (False, True)
                   for fewer in (False, True)})


def name_expression_f32(config: tuple) -> str:
    return "rtk_chunk_decay_grad_f32<" + ", ".join(str(c).lower() for c in config) + ">"


def smem_bytes_f32(kmax: int, bv: int, stages: int) -> int:
    """Dynamic shared memory of the float32 kernel (mirrors rtk_dgf_smem): ``stages`` stages of q, k
    (64 x KMAX) and v, do (64 x BV) in fp32, rows unpadded."""
    return stages * 4 * CHUNK * (2 * kmax + 2 * bv)


def tf32_wg_kmax(dk: int) -> int:
    """KMAX of ``rtk_chunk_decay_grad_tf32`` (``cuda_src/chunk/decay_grad_tf32.cu``) for Dk <= 128:
    64 or 128 (its value tile: :func:`tf32_wg_bv`)."""
    return 64 if dk <= 64 else 128


def tf32_wg_bv(kmax: int) -> int:
    """Value columns of a ``rtk_chunk_decay_grad_tf32`` CTA: KMAX * BV = 128 * 64, each of its two
    warpgroups a 64 x 64 block of the state (rtk_dgt_smem::BV)."""
    return 128 * 64 // kmax


def tf32_threads(kmax: int, states: bool = False) -> int:
    """Threads of a ``rtk_chunk_decay_grad_tf32`` CTA: 384 for the KMAX 128 walk (two state
    warpgroups and the causal one), else 256 (the two state warpgroups)."""
    return 384 if kmax == 128 and not states else 256


def name_expression_tf32(kmax: int, states: bool = False) -> str:
    """The instance of ``rtk_chunk_decay_grad_tf32``: the walk that sums, or (``states``) the pass
    that leaves each segment but the last its own S and W (:func:`kernel_log_decay_grad`'s split)."""
    return f"rtk_chunk_decay_grad_tf32<{kmax}, {'true' if states else 'false'}>"


def names_tf32() -> list[str]:
    """Every instance of ``rtk_chunk_decay_grad_tf32``."""
    return [name_expression_tf32(kmax, states) for kmax in (64, 128) for states in (False, True)]


def smem_bytes_tf32(kmax: int) -> int:
    """Dynamic shared memory of ``rtk_chunk_decay_grad_tf32`` (mirrors rtk_dgt_smem): two stages of
    q, k (64 x KMAX) and v^T, do^T (BV x 64) in fp32, and the 1024-byte alignment slack."""
    return 4 * 2 * (2 * CHUNK * kmax + 2 * tf32_wg_bv(kmax) * CHUNK) + 1024


def instance_options() -> dict[str, tuple[str, ...]]:
    """The compiler options of the dlog(gamma) instances that need any (the wgmma ones), by name."""
    return {name: WGMMA_OPTIONS for name in names_tf32()}


@functools.lru_cache(maxsize=256)
def _plan(dtype: torch.dtype, dk: int, dv: int, vec: bool, few_ctas: bool = False, exact: bool = True,
          fewer_ctas: bool = False, wgmma: bool = False) -> tuple[str, str, int, int, int, tuple[str, ...]]:
    """(source, name expression, BV, row slices, dynamic shared memory, compiler options).
    ``wgmma``: the GPU runs sm_90a code (and the plan's overrides allow it)."""
    if dtype == torch.float32 and wgmma and not exact and vec and dk <= 128:
        kmax = tf32_wg_kmax(dk)
        return SOURCE_TF32, name_expression_tf32(kmax), tf32_wg_bv(kmax), 1, smem_bytes_tf32(kmax), WGMMA_OPTIONS
    if dtype == torch.float32:
        kmax, bv, stages, slices, *_ = config = kernel_config_f32(dk, dv, vec, exact, few_ctas, fewer_ctas)
        return SOURCE_F32, name_expression_f32(config), bv, slices, smem_bytes_f32(kmax, bv, stages), ()
    config = kernel_config(dtype, dk, dv, vec, few_ctas)
    return SOURCE, name_expression(config), config[2], 1, smem_bytes(config[1], config[2]), ()


def kernel_log_decay_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                          initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                          grad_state: Optional[torch.Tensor], *, for_source: bool = False,
                          fp32_precision: str = "exact") -> torch.Tensor:
    """dL/dlog(gamma), ``[H]`` float32, by the kernel (arguments as a
    :data:`~rtkernels.autograd.BackwardImpl`'s: ``[B, H, N, D]`` views of one dtype on one CUDA
    device, Dk <= 256 and Dv <= 512 (value tiles of BV columns), any strides; ``grad_out`` = dL/do).
    Views without a unit last stride are copied; the initial state and ``grad_state`` are used as
    fp32 contiguous copies. 16-bit views run ``rtk_chunk_decay_grad``; float32 views
    ``rtk_chunk_decay_grad_f32`` in ``fp32_precision``'s mode ("exact": 3xTF32, about fp32
    accuracy; "tf32": one TF32 product, about 1e-3).

    Two launches (three where the "tf32" wgmma kernel splits the sequence: its states pass first):
    the partial sums, then ``rtk_chunk_decay_grad_sum`` (``chunk/decay_grad_sum.cu``),
    which adds them per head in a fixed order in fp64; with ``for_source`` and a CUDA decay tensor
    of factors or rates it also applies the chain rule (:meth:`LogDecay.source_grad`'s), giving
    dL/d(the caller's tensor) in float32 instead."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    q, k, v, grad_out = unit_stride(q, k, v, grad_out)
    vec = all(aligned(x) for x in (q, k, v, grad_out))
    dev = q.device.index
    sms, f32 = _sm_count(dev), q.dtype == torch.float32
    few = b * h * -(-dv // 64) * (2 if f32 else 1) <= sms  # CTAs with 64-wide value tiles
    fewer = f32 and b * h * -(-dv // 32) * 2 <= sms        # with 32-wide ones
    wgmma = f32 and _wgmma_ok(dev, current_overrides())
    source, name, bv, slices, smem, options = _plan(q.dtype, dk, dv, vec, few, fp32_precision == "exact", fewer, wgmma)
    fn = get_function(source, name, dev, extra_options=options, dynamic_smem=smem)
    tiles = -(-dv // bv)
    s0, g = (None if x is None else x.to(torch.float32).contiguous() for x in (initial_state, grad_state))
    decay, mode = log_decay.kernel_arg()
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), grad_out.data_ptr(), decay,
                0 if s0 is None else s0.data_ptr(), 0 if g is None else g.data_ptr())
    tail = fwd_tail(q, k, v, grad_out, float(scale), mode)
    if source == SOURCE_TF32:
        return _walk_tf32(fn, pointers, tail, q, v, bv, smem, options, log_decay, for_source)
    partial = torch.empty(b, tiles * slices, h, dtype=torch.float32, device=q.device)
    launch(fn, (b * h, tiles, slices), (256, 1, 1), (*pointers, partial.data_ptr(), *tail), dev, shared_mem=smem,
           pointers=8)  # then rtk_fwd_shape
    return sum_partials(partial, log_decay, for_source)


def _walk_tf32(fn: Kernel, pointers: tuple, tail: tuple, q: torch.Tensor, v: torch.Tensor, bv: int, smem: int,
               options: tuple[str, ...], log_decay: LogDecay, for_source: bool) -> torch.Tensor:
    """``rtk_chunk_decay_grad_tf32`` over :func:`.plan.tf32_dlog_segments` segments of the sequence
    (``overrides.segments`` wins): with more than one, its states instance first leaves each segment
    but the last its own S and W (slots of ``[B*H, Dk, Dv]`` fp32: S at 1 .., W at segments + 1 ..),
    from which each later segment's CTAs fold the S and W entering it. Each (segment, batch) writes
    a row of partial sums."""
    b, h, n, dk = q.shape
    dv, dev = v.shape[-1], q.device.index
    tiles = -(-dv // bv)
    nseg = current_overrides().segments or tf32_dlog_segments(b * h * tiles, n, _sm_count(dev))
    seg_len, nseg = split(n, nseg)
    partial = torch.empty(nseg * b, tiles, h, dtype=torch.float32, device=q.device)
    slots = torch.empty(2 * nseg * b * h * dk * dv, dtype=torch.float32, device=q.device) if nseg > 1 else None
    args = (*pointers, partial.data_ptr(), 0 if slots is None else slots.data_ptr(), *tail, seg_len)
    kmax = tf32_wg_kmax(dk)
    if slots is not None:
        states = get_function(SOURCE_TF32, name_expression_tf32(kmax, True), dev, extra_options=options,
                              dynamic_smem=smem)
        launch(states, (b * h, tiles, nseg - 1), (tf32_threads(kmax, True), 1, 1), args, dev, shared_mem=smem,
               pointers=9)
    launch(fn, (b * h, tiles, nseg), (tf32_threads(kmax), 1, 1), args, dev, shared_mem=smem,
           pointers=9)  # then rtk_dgt_shape
    return sum_partials(partial, log_decay, for_source)


def kernel_log_decay_grad_tf32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay,
                               scale: float, initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                               grad_state: Optional[torch.Tensor], *, for_source: bool = False) -> torch.Tensor:
    """:func:`kernel_log_decay_grad` of float32 views in the "tf32" mode (kept for callers of
    session 18's name; it ran the 16-bit kernel on fp16 copies scaled by powers of two, which the
    float32 kernel replaced)."""
    return kernel_log_decay_grad(q, k, v, log_decay, scale, initial_state, grad_out, grad_state,
                                 for_source=for_source, fp32_precision="tf32")


def _sum_launch(shape: tuple[int, int, int], log_decay: LogDecay, for_source: bool
                ) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block, struct) of ``rtk_chunk_decay_grad_sum`` over ``[rows, tiles, H]`` partial sums:
    one thread per head; the decay mode without its kind (the sum alone, the decay never read)
    unless ``for_source``."""
    rows, tiles, h = shape
    mode = log_decay.kernel_arg()[1]
    if not for_source:
        mode &= ~(3 << 2)
    return (-(-h // 128), 1, 1), (128, 1, 1), (rows * tiles, h, mode)


def sum_partials(partial: torch.Tensor, log_decay: LogDecay, for_source: bool) -> torch.Tensor:
    """``[H]`` float32: the ``[rows, tiles, H]`` float32 partial sums added per head, in a fixed
    order, in fp64 (``rtk_chunk_decay_grad_sum``); with ``for_source`` and a CUDA decay tensor of
    factors or rates, times the decay's chain rule (dL/d(the caller's tensor)). One launch."""
    dev = partial.device.index
    grid, block, tail = _sum_launch(tuple(partial.shape), log_decay, for_source)
    out = torch.empty(partial.shape[2], dtype=torch.float32, device=partial.device)
    launch(get_function(SUM_SOURCE, SUM_KERNEL, dev), grid, block,
           (partial.data_ptr(), out.data_ptr(), log_decay.kernel_arg()[0], *tail), dev, pointers=3)
    return out


class PartialSums:
    """The dq pass's partial sums of dlog(gamma) for ``[B, H, N, D]`` inputs like q and v and a
    decay like ``log_decay`` (its dtype, kind and stride; ``sequences`` = S: packed sequences in a
    batch of one, a row of partial sums per sequence), planned once: the buffer's shape
    (:func:`dq_pass_partials`) and the sum kernel's launch, bound (:func:`sum_partials` with
    ``for_source``). A planned backward keeps one, so that a trainable decay's step adds one
    allocation (the partial sums and the result's row) and one bound launch to the fixed decay's
    host time."""

    __slots__ = ("shape", "device", "_sum", "_at", "dq_rows")

    def __init__(self, q: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, sequences: int = 0,
                 dual_rows: Optional[int] = None):
        dev = q.device.index
        self.shape, self.device = _partials_shape(q, v, sequences), q.device
        #: the Z split (``dual_rows``: the fused dk/dv pass's CTA rows, segments * B): the dq pass's
        #: sums as rows of one tile, then the dk/dv pass's from row ``dq_rows``
        self.dq_rows = None
        if dual_rows is not None:  # the Z dq pass's value tiles: 64 wide, or 128 (plan.dlog_config's wide)
            b, h, n, dk = q.shape
            bv = dlog_launch(q.dtype, v.shape[-1], dk, b * h, n, dev, current_overrides(), True).bv
            self.dq_rows = self.shape[0] * -(-dk // bv)
            self.shape = (self.dq_rows + dual_rows, 1, self.shape[2])
        rows, tiles, h = self.shape
        self._at = -(-rows * tiles * h // 64) * 64  # the result's offset: 256-byte aligned, as a fresh tensor
        grid, block, tail = _sum_launch(self.shape, log_decay, True)
        self._sum = get_function(SUM_SOURCE, SUM_KERNEL, dev).bind(grid, block, 0, dev, 3, tail)

    def buffer(self) -> torch.Tensor:
        """An empty flat float32 buffer: the dq pass writes its ``[segments * B, Dk / 64, H]``
        partial sums at its start, :meth:`total` the ``[H]`` result after them (one allocation)."""
        return torch.empty(self._at + self.shape[2], dtype=torch.float32, device=self.device)

    def total(self, partial: torch.Tensor, decay_ptr: int) -> torch.Tensor:
        """dL/d(the decay tensor), ``[H]`` float32 (a view of ``partial``'s end), from ``partial``
        (:meth:`buffer`, written) and the decay's address (:meth:`LogDecay.kernel_arg`)."""
        base = partial.data_ptr()
        self._sum(base, base + 4 * self._at, decay_ptr)
        return partial[self._at:]


def dq_pass_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                 grad_state: Optional[torch.Tensor]) -> bool:
    """Whether the backward's dq pass over these ``[B, H, N, D]`` views (16-bit CUDA tensors the
    chunk kernel takes) can sum dlog(gamma) itself (module docstring): fp16 or bf16, every row
    16-byte aligned, q and k with one set of strides (the pass reads q with the strides of its values, k),
    Dv <= 128 and a GPU that runs the wgmma kernel. A gradient of the final state (``grad_state``)
    is no obstacle: the CTA that ends the sequence adds its term <G, W_end>."""
    return (q.is_cuda and q.stride() == k.stride() and q.stride(-1) == 1
            and all(aligned(x) for x in (q, k, v, grad_out))
            and dlog_config(q.dtype, v.shape[-1], True) is not None
            and _wgmma_ok(q.device.index, current_overrides()))


def z_split_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor) -> Optional[int]:
    """Where a backward whose dq pass sums dlog(gamma) (:func:`dq_pass_sums`) takes the Z split
    (``cuda_src/chunk/dlog_rows.cuh``): the W form's dq pass would run in one segment (the Z form
    is never split), the dk and dv passes fuse (:func:`.plan.fuses_dk_dv`, k standing for the dk
    buffer, which takes its strides), and its dq pass takes the 128-wide instance
    (:func:`.plan.dlog_launch`; with 64-wide tiles the split only moves time from the dq pass to the
    dk/dv pass), and only where the W form's pass has no tensor-copy twin (:func:`.plan.tma_variant`;
    with one, W's pass and the plain fused pass take less time). ``Overrides.dlog_split``: False
    never, True with either width. Returns the fused pass's CTA rows (its segments * B), which the
    partial sums' buffer holds after the dq pass's (:class:`PartialSums`), else None. The caller
    checks the rest: no initial state, and a final-state gradient only where it rides on the
    reversed passes."""
    over = current_overrides()
    b, h, n, dk = q.shape
    if over.dlog_split is False or _partials_shape(q, v)[0] != b:
        return None
    if over.dlog_split is None:
        dev, dv = q.device.index, v.shape[-1]
        if dlog_launch(q.dtype, dv, dk, b * h, n, dev, over, True).bv != 128:
            return None
        if over.tma_io and tma_variant(dlog_launch(q.dtype, dv, dk, b * h, n, dev, over).name) is not None:
            return None  # W's pass by tensor copies and the plain fused pass are faster (H200, mid)
    if not fuses_dk_dv(q, k, v, grad_out, k, over):
        return None
    return dual_launch(q.dtype, dk, v.shape[-1], b * h, n, q.device.index, over, True).segments * b


def _partials_shape(q: torch.Tensor, v: torch.Tensor, sequences: int = 0) -> tuple[int, int, int]:
    """(segments * B, Dk / 64, H); ``sequences`` = S packed sequences: (S, Dk / 64, H), one segment."""
    b, h, n, dk = q.shape
    if sequences:
        return sequences, -(-dk // 64), h
    segments = dlog_launch(q.dtype, v.shape[-1], dk, b * h, n, q.device.index, current_overrides()).segments
    return segments * b, -(-dk // 64), h


def dq_pass_partials(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``[segments * B, tiles, H]`` float32 buffer the dq pass writes its partial sums into
    (tiles of 64 columns of Dk; the pass's sequence segments, :func:`.plan.dlog_launch`)."""
    return torch.empty(_partials_shape(q, v), dtype=torch.float32, device=q.device)


def torch_w_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, scale: float,
                       initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                       grad_state: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's computation in torch operations, chunk by chunk (a Python loop over the chunks):
    the S and W recurrences and the two terms of the module docstring, in the dtype of
    ``log_decay`` (``[H]`` log(gamma)); q, k, v, ``grad_out`` (dL/do) are ``[B, H, N, D]``, the
    states ``[B, H, Dk, Dv]`` or None. Returns ``[H]``. For tests: the CPU tests check it against
    autograd through the fp64 reference. Its NaN handling is the kernel's (s > t by a select,
    s = t a product with weight 0)."""
    cdt = log_decay.dtype
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    q, k, v, do = (x.to(cdt) for x in (q, k, v, grad_out))
    s = torch.zeros(b, h, dk, dv, dtype=cdt, device=q.device) if initial_state is None else initial_state.to(cdt)
    w = torch.zeros_like(s)
    acc = torch.zeros(b, h, dtype=cdt, device=q.device)
    lg = log_decay.view(h, 1)
    zero = torch.zeros((), dtype=cdt, device=q.device)
    for c0 in range(0, n, CHUNK):
        ln = min(CHUNK, n - c0)
        qc, kc, vc, dc = (x[:, :, c0:c0 + ln] for x in (q, k, v, do))
        t = torch.arange(ln, dtype=cdt, device=q.device)
        pw = torch.exp(lg * (t + 1))                                        # [H, L] gamma^(t+1)
        a1 = (qc * ((t + 1) * pw)[..., None]).transpose(-1, -2) @ dc
        a2 = (qc * pw[..., None]).transpose(-1, -2) @ dc
        acc = acc + (s * a1).sum((-1, -2)) + (w * a2).sum((-1, -2))
        dist = t[:, None] - t[None, :]
        weight = dist * torch.exp(lg[..., None] * dist.clamp(min=0))       # [H, L, L], 0 on the diagonal
        intra = (qc @ kc.transpose(-1, -2)) * (dc @ vc.transpose(-1, -2)) * weight
        acc = acc + torch.where(dist >= 0, intra, zero).sum((-1, -2))
        m = ln - 1 - t                                                      # L-1-s
        e = torch.exp(lg * m)
        d1 = (kc * e[..., None]).transpose(-1, -2) @ vc
        d2 = (kc * (m * e)[..., None]).transpose(-1, -2) @ vc
        carry = torch.exp(log_decay * ln).view(h, 1, 1)
        w = carry * (w + ln * s) + d2
        s = carry * s + d1
    res = scale * acc
    if grad_state is not None:
        res = res + (grad_state.to(cdt) * w).sum((-1, -2))
    return res.sum(0)
