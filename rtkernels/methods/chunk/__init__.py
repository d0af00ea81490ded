"""``chunk``: the chunked form, every chunk at once (the flagship's algorithm).

With chunks of C tokens and S_c the state entering chunk c:

    O_c[t]  = gamma^(t+1) q_t S_c + sum_{s <= t} gamma^(t-s) (q_t . k_s) v_s
    S_{c+1} = gamma^L S_c + sum_s gamma^(L-1-s) k_s^T v_s      (L = C, the last chunk: what is left)

Only non-negative powers of gamma appear, so it is safe for every gamma in (0, 1] and any N.
The torch path computes every chunk's masked product and own state in batched products, then
scans the chunk states. Work O(N C (Dk + Dv) + N Dk Dv), memory O(N (Dk + Dv) + N Dk Dv / C).

On a CUDA device, fp16 and bf16 inputs with Dk, Dv <= 256 run ``cuda_src/chunk/fwd16.cu``: one fused kernel on
tensor cores (mma.sync m16n8k16, fp32 accumulation, fp32 state in registers), one CTA per
(batch, head, tile of value columns) walking chunks of 64 tokens, the next chunk loaded with
cp.async while the current one is computed; four warps compute the outputs while four others
update the state. Memory beyond inputs and output: none, except with few (batch, head, value-tile)
CTAs: then the sequence is split into segments, ``rtk_chunk_states`` (``chunk/states.cu``)
writes the state each segment but the last ends with (``[segments, B*H, Dk, Dv]`` fp32), and the
fused pass folds them into each segment's entering state.

fp32 inputs run ``rtk_chunk_fwd_f32`` (``chunk/fwd_f32.cu``): the same algorithm and warp roles on TF32
tensor cores (mma.sync m16n8k8, fp32 tiles in shared memory). ``fp32_precision="exact"`` splits
every operand x into hi = x truncated to tf32 and lo = x - hi (which the tensor cores read to TF32
precision) and forms each product as hi*lo' + lo*hi' + hi*hi' (3xTF32: about fp32 accuracy), with
8 state warps (:func:`.plan.f32_threads`); ``"tf32"`` uses one TF32 product (relative error ~1e-3,
faster) and 4 state warps. It takes the same arguments, so the launch
planner's split-sequence strategy (segments, ``rtk_chunk_seg_scan`` in ``chunk/seg_scan.cu``) serves it too,
and its tile (BV, stages) follows the GPU's shared memory. On Hopper the ``"tf32"`` mode runs
``rtk_chunk_fwd_tf32`` (``chunk/fwd_tf32.cu``, wgmma) instead where rows are 16-byte aligned and
Dk <= 128 and Dv > 32 (:func:`.plan.tf32_wg_config`): the same arguments and modes, v stored
transposed in shared memory (wgmma reads TF32 operands K-major only), its sequence split by
:func:`.plan.tf32_wg_segments` (:func:`.plan.tf32_wg_planned` says where it runs), the split's
first pass by ``rtk_chunk_states_tf32`` (``chunk/states_tf32.cu``, :func:`.plan.tf32_states_config`).
fp64 inputs run
the torch path.

The package: :mod:`.torch_path` (the torch path), :mod:`.plan` (instances, tiles, heuristics,
the tune space, :class:`Overrides`), :mod:`.launch` (the planned call), :mod:`.backward` (the
kernel backward: three forward passes and the dlog(gamma) kernel of :mod:`.decay_grad`),
:mod:`.packed` (packed variable-length batches, ``cu_seqlens``: one CTA per sequence, head and
value tile, forward and backward).
"""

from . import decay_grad
from .launch import ChunkLaunch, kernel_forward, kernel_prepare
from .plan import instance_options as _fwd_options
from .plan import instances as _fwd_instances
from .plan import (CHUNK_KERNEL, F32_SOURCE, FWD16_SOURCE, TF32_WG_SOURCE, MAX_DIM, MAX_VALUE_DIM, MODE_FOLD, MODE_FUSED, MODE_STATES,
                   SEG_SCAN_SOURCE, SMEM_LIMIT_SM90, SMEM_LIMITS_OTHER, STATES_SOURCE, TUNE_SPACE, WGMMA_OPTIONS,
                   Launch, Overrides, aligned, all_configs, config_smem, ctas_per_sm, current_overrides, dlog_launch,
                   dual_config, dual_launch, fuses_dk_dv,
                   f32_config, f32_smem_bytes, f32_stages, f32_threads, fold_parts, kernel_config, kernel_supports,
                   name_expression, override, plan_launch, segments_for, smem_bytes, split, states_config, states_name,
                   states_smem_bytes, tf32_wg_config, tf32_dlog_segments, tf32_wg_planned, tf32_wg_segments, tf32_wg_smem_bytes, tuned_launch,
                   value_tile)
from .torch_path import CHUNK, torch_forward

__all__ = [
    "torch_forward", "instance_options", "kernel_supports", "kernel_forward", "kernel_prepare", "ChunkLaunch", "TUNE_SPACE",
    "tuned_launch", "instances", "plan_launch", "Launch", "Overrides", "override", "current_overrides", "kernel_config",
    "all_configs", "name_expression", "states_config", "states_name", "states_smem_bytes", "smem_bytes",
    "f32_config", "f32_smem_bytes", "f32_stages", "f32_threads", "config_smem", "ctas_per_sm", "segments_for",
    "value_tile", "aligned", "CHUNK", "CHUNK_KERNEL", "MAX_DIM", "MAX_VALUE_DIM", "SMEM_LIMIT_SM90", "SMEM_LIMITS_OTHER",
    "WGMMA_OPTIONS", "MODE_FUSED", "MODE_STATES", "MODE_FOLD", "FWD16_SOURCE", "F32_SOURCE", "STATES_SOURCE",
    "SEG_SCAN_SOURCE", "TF32_WG_SOURCE", "tf32_wg_config", "tf32_wg_planned", "tf32_wg_segments", "tf32_dlog_segments", "tf32_wg_smem_bytes", "dlog_launch", "dual_config", "dual_launch", "fuses_dk_dv", "split", "fold_parts",
]


def instance_options() -> dict[str, tuple[str, ...]]:
    """The compiler options of the instances that need any (the wgmma ones: sm_90a code), by name
    expression: the forward and states passes' (:func:`.plan.instance_options`) and the dlog(gamma)
    kernel's."""
    return {**_fwd_options(), **decay_grad.instance_options()}


def instances() -> dict[str, list[str]]:
    """Every template instance the chunk method can ask for, by source: the forward kernels
    (:func:`.plan.instances`) and the backward's dlog(gamma) kernel (the CI compile test)."""
    return {**_fwd_instances(),
            decay_grad.SOURCE: [decay_grad.name_expression(c) for c in decay_grad.all_configs()],
            decay_grad.SOURCE_F32: [decay_grad.name_expression_f32(c) for c in decay_grad.all_configs_f32()],
            decay_grad.SOURCE_TF32: decay_grad.names_tf32(),
            decay_grad.SUM_SOURCE: [decay_grad.SUM_KERNEL]}
