"""Launching the chunk kernels: :class:`ChunkLaunch` (a planned call, repeated by the cached
call with new pointers), :func:`kernel_prepare` and :func:`kernel_forward`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ...autotune.answers import plan_state, tuned_config
from ...autotune.keys import dtype_name
from ...autotune.space import Config, Limits, Problem
from ...decay import LogDecay
from ...jit import get_function
from ...jit.tensor_map import TensorMaps
from .._launch import FWD_POINTERS, fwd_tail, row_address, unit_stride
from .plan import (CHUNK_FIELDS, FWD16_SOURCE, MODE_FOLD, MODE_FUSED, MODE_STATES, NO_EXTRAS, SEG_SCAN_SOURCE,
                   STATES_SOURCE, STATES_TF32_SOURCE, TF32_WG_SOURCE, Launch, _sm_count, _smem_limit, aligned,
                   current_overrides, dlog_launch, dual_launch, fold_parts, key_pieces, override, packed_launch,
                   plan_launch, split, states_config, states_name, states_options, states_smem_bytes, states_tma,
                   tf32_states_config, tf32_states_name, tf32_states_smem_bytes, tf32_wg_planned, tma_variant,
                   tuned_launch)

__all__ = ["ChunkLaunch", "KeyPiecesLaunch", "kernel_prepare", "kernel_forward", "pass_launch", "pass_launcher",
           "launch_pass", "transposed_slots", "call_pieces", "kernel_final_state"]


#: The states kernel's tensor-map parameter for its cp.async instances (never read: zeros).
_NO_MAPS = TensorMaps(2)
#: The same for ``rtk_chunk_fwd`` (q, k, v, o, x) and its instances that take no tensor copies.
_NO_FWD_MAPS = TensorMaps(5)
#: Where a dlog(gamma) launch's x address comes among a call's arguments (the pointers, then the
#: struct's late fields from cu_seqlens on: ChunkLaunch.__call__).
_X_ARG = FWD_POINTERS + CHUNK_FIELDS.index("x") - CHUNK_FIELDS.index("cu_seqlens")


def _encode(maps: TensorMaps, i: int, x: torch.Tensor, rows: int) -> bool:
    """Map ``i`` of ``maps`` over ``x`` (a ``[B, H, N, D]`` view, 16-bit, a reversed pass's token
    stride negative): element coordinates (column, token, head, batch) over the memory as stored,
    boxes of 64 columns x ``rows`` tokens. False where the driver refuses it."""
    b, h, n, d = x.shape
    es = x.element_size()
    strides = (abs(x.stride(2)) * es, x.stride(1) * es, x.stride(0) * es)
    return maps.encode(i, x.data_ptr(), (d, n, h, b), strides, (64, rows, 1, 1))


def _fwd_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dlog: bool) -> Optional[TensorMaps]:
    """The TMA instance's tensor maps (a forward walk; :func:`_encode`) of q, k, v, out and, for a dq
    pass that sums dlog(gamma), x (read with v's strides: described by v, pointed at x by each call);
    boxes of 64 tokens (the loads) or 16 (an output warp's rows). Each follows its pointer of a call.
    None where the driver refuses one."""
    items = ((q, 64), (k, 64), (v, 64), (out, 16)) + (((v, 64),) if dlog else ())
    maps = TensorMaps(5, [(0, 0), (1, 0), (2, 0), (3, 0)] + ([(_X_ARG, 0)] if dlog else []))
    return maps if all(_encode(maps, i, x, rows) for i, (x, rows) in enumerate(items)) else None


def _kv_maps(k: torch.Tensor, v: torch.Tensor, offsets: Optional[tuple[int, ...]]) -> TensorMaps:
    """The states kernel's tensor maps of k and v (:func:`_encode`, boxes of 64 tokens); each follows
    its pointer of a call (head pointers 1 and 2, less the reversed pass's offset of the last row).
    :data:`_NO_MAPS` where the driver refuses either."""
    maps = TensorMaps(2, [(1, offsets[1] if offsets else 0), (2, offsets[2] if offsets else 0)])
    return maps if _encode(maps, 0, k, 64) and _encode(maps, 1, v, 64) else _NO_MAPS


def pass_launch(dtype: torch.dtype, b: int, h: int, n: int, dk: int, dv: int, dev: int, vec: bool, exact: bool,
                tuned: Optional[Config] = None) -> Launch:
    """The :class:`~.plan.Launch` of one pass over ``dk`` key columns on device ``dev``: the tuned
    config ``tuned`` (a key piece's: the config of the call it belongs to), else the store's
    config for this pass's shape, else the heuristic (:func:`.plan.plan_launch`); overrides that
    steer the plan win over either config. A float32 pass in the "tf32" mode that the wgmma kernel
    serves keeps the heuristic: the store's float32 entries are timed in the exact mode, among
    mma.sync configs only (the wgmma kernel has no exact mode)."""
    over = current_overrides()
    if not over.steers_plan and not (dtype == torch.float32 and not exact and tf32_wg_planned(dk, dv, vec, dev, over)):
        tuned = tuned or tuned_config("chunk", dev, dtype, b * h, n, dk, dv)  # None: no store entry
        if tuned:
            limits = Limits(sms=_sm_count(dev), max_smem=_smem_limit(dev))
            return tuned_launch(tuned, Problem(b, h, n, dk, dv, dtype_name(dtype)), limits, vec=vec, exact=exact)
    return plan_launch(dtype, dk, dv, vec, b * h, n, dev, over, exact=exact)


def call_pieces(dtype: torch.dtype, bh: int, n: int, dk: int, dv: int, dev: int
                ) -> tuple[Optional[list[slice]], Optional[Config]]:
    """How a call of ``[B*H = bh, N, Dk]`` keys splits its key columns (:func:`.plan.key_pieces`):
    the pieces (None: one pass) and the config every piece runs: the store's config of the whole
    call where it chose key pieces, else None (each pass looks up its own shape, as before key
    pieces were tuned)."""
    over = current_overrides()
    tuned = None if over.steers_plan else tuned_config("chunk", dev, dtype, bh, n, dk, dv)
    split = None if tuned is None else dict(tuned).get("key_pieces")  # None: stored before it was tuned
    pieces = key_pieces(dtype, dk, dev, over, split)
    return pieces, tuned if pieces is not None and split else None


#: The sources of a pointer slot in :meth:`ChunkLaunch.program` (a temporary's is the last + its index);
#: ``cuda_src/host/compiled_call.cpp`` numbers them alike.
PROGRAM_SOURCES = ("q", "k", "v", "out", "decay", "initial_state", "final_state", "constant", "temporary")


class ChunkLaunch:
    """A planned call of the chunk kernel: kernel, grid, shared memory and every argument but the
    data pointers, so that repeating the call with new tensors of the same shapes, strides and
    alignment costs the pointer reads and the launch (the host path of a cached call).

    ``launch(q, k, v, out, initial_state)`` takes the tensors (any views of the planned ones' memory
    layout: only ``data_ptr()`` is read) and returns the final state when it was planned, else None.
    The split-sequence strategy allocates its ``[segments, B*H, Dk, Dv]`` fp32 state buffer per call
    (two with the fused kernel's states-only mode: fp32 inputs, or ``Overrides.dedicated_states`` False).
    ``tuned``: the config of a key piece's whole call (:func:`call_pieces`); None: :func:`pass_launch`
    looks one up.

    ``sequences`` = S > 0: packed sequences (``cu_seqlens``, :mod:`.packed`) in a batch of one, one CTA
    row per (sequence, head), one segment (:func:`.plan.packed_launch`), states ``[S, H, Dk, Dv]``;
    each call then takes ``seqs``, the addresses of the int64 offsets and of their validity flag
    (device tensors: they go into the struct parameter, packed per call).

    ``dlog``: the instance that also sums dlog(gamma) (:func:`.plan.dlog_launch`; the backward's dq
    pass); each call then takes ``dlog``, the addresses of x, of the ``[segments * rows, Dv / 64,
    H]`` float32 partial sums and of the final state's gradient (fp32, contiguous; 0: none). Split
    into segments, its states pass also carries W = dS/dlog(gamma) (twice the slots).

    ``dual``: the instance that also writes a second output (:func:`.plan.dual_launch`; the
    backward's dk and dv passes as one walk, planned as the dv pass R(k, q, g)); each call then takes
    ``dual``, the addresses of x (the forward's v, with v's strides) and of the second output (dk,
    with k's strides).

    ``zsplit``: with ``dlog``, the Z form of the dq pass (one segment); with ``dual``, the instance
    that also sums the Z split's terms of dlog(gamma) (each call then takes ``dlog`` too: its
    partial sums' address, ``[segments * rows, 1, H]``). ``cuda_src/chunk/dlog_rows.cuh`` has the math.

    ``fold``: for a split launch with the dedicated states pass (16-bit, not ``dlog``), what its
    slots are: ``(segments, fold_len, slots, state_shape)``, else None. A call may hand back its
    slots (``keep``, a list it appends ``(slots, fold)`` to: the forward of a training step keeps
    them for the backward's dq pass, the dk pass for the dv pass) or take them instead of running
    its states pass (``slots``: fp32 contiguous ``[slots, *state_shape]``, slot 0 the initial
    state, as the states pass writes them).
    """

    __slots__ = ("fused", "states", "scan", "device", "log_decay", "decay_ptr", "nseg", "slots", "state_shape",
                 "need_state", "offsets", "packed", "fold")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
                 out: torch.Tensor, need_state: bool, reverse: bool = False, fp32_precision: str = "exact",
                 tuned: Optional[Config] = None, sequences: int = 0, dlog: bool = False, dual: bool = False,
                 zsplit: bool = False):
        b, h, n, dk = q.shape
        dv = v.shape[-1]
        vec = aligned(q, reverse) and aligned(k, reverse) and aligned(v, reverse)
        # reverse: the kernel starts at row N-1 (the byte offset of that row) with negated token strides
        self.offsets = tuple(row_address(x, True) - x.data_ptr() for x in (q, k, v, out)) if reverse else None
        dev = q.device.index
        bh = b * h
        exact = fp32_precision != "tf32"  # the float32 kernel's mode (16-bit inputs ignore it)
        over = current_overrides()
        if sequences:
            bh = sequences * h
        if dual:  # packed sequences: one segment (as packed_launch)
            lp = dual_launch(q.dtype, dk, dv, bh, n, dev, dataclasses.replace(over, segments=1) if sequences else over,
                             zsplit)
        elif dlog:
            lp = dlog_launch(q.dtype, dk, dv, bh, n, dev, dataclasses.replace(over, segments=1) if sequences else over,
                             zsplit)
        elif sequences:
            lp = packed_launch(q.dtype, dk, dv, vec, bh, max(1, n // sequences), dev, over, exact)
        else:
            lp = pass_launch(q.dtype, b, h, n, dk, dv, dev, vec, exact, tuned)
        name, bv, nseg, smem, threads, opts = lp.name, lp.bv, lp.segments, lp.smem, lp.threads, lp.options
        # rtk_chunk_fwd's tensor maps: the TMA instance's for a forward walk over unpacked sequences
        # where the driver takes them all, zeros for its other instances; the float32 kernels take none
        fmaps = _NO_FWD_MAPS if lp.source == FWD16_SOURCE else None
        tma = None if reverse or sequences or dual or fmaps is None else tma_variant(name)
        if tma is not None and over.tma_io:  # (a twin exists only for wgmma instances, which only Hopper runs)
            maps = _fwd_maps(q, k, v, out, dlog)
            if maps is not None:
                (name, smem), fmaps = tma, maps
        seg_len, nseg = split(n, nseg)
        self.nseg = nseg
        self.slots = nseg  # of the split strategy's state buffer (the states pass's: below)
        fn = get_function(lp.source, name, dev, extra_options=opts, dynamic_smem=smem)
        self.log_decay = log_decay  # keeps the tensor the kernels read alive
        self.decay_ptr, mode = log_decay.kernel_arg()
        grid, block, tail = (bh, -(-dv // bv), nseg), (threads, 1, 1), fwd_tail(q, k, v, out, scale, mode, reverse)
        # the split strategy with the dedicated states kernel (always for dlog): its slots, then the
        # fused pass folding them
        fold = nseg > 1 and q.dtype != torch.float32 and (over.dedicated_states or dlog or dual)
        self.device = q.device
        self.need_state = need_state
        self.state_shape = (sequences or b, h, dk, dv)
        self.scan = None
        self.packed = None
        self.states = None
        self.fold = None
        fold_len = seg_len
        if fold:  # the states pass over slots of fold_len tokens, parts of the segments but the last
            maps = _kv_maps(k, v, self.offsets) if states_tma(dev, dk, vec, over, dlog) else _NO_MAPS
            tma = maps is not _NO_MAPS
            sc = states_config(q.dtype, dk, dv, vec, _smem_limit(dev), dlog, tma)
            ssmem = states_smem_bytes(sc[1], sc[2], sc[4], tma)
            tiles = bh * -(-dv // sc[2])
            parts = fold_parts(seg_len, nseg, tiles, _sm_count(dev))
            fold_len = seg_len // parts
            self.slots = ((nseg - 1) * parts + 1) * (2 if dlog else 1)
            sfn = get_function(STATES_SOURCE, states_name(sc), dev, extra_options=states_options(sc),
                               dynamic_smem=ssmem)
            self.states = sfn.bind((bh, -(-dv // sc[2]), (nseg - 1) * parts), block, ssmem, dev, FWD_POINTERS,
                                   (*tail, fold_len, 0, fold_len, *NO_EXTRAS), maps)
            if not dlog:
                self.fold = (nseg, fold_len, self.slots, self.state_shape)
        mode_k = MODE_FOLD if fold else MODE_FUSED
        if sequences or dlog or dual:  # addresses that change per call: the struct's last fields (from
            # cu_seqlens on, CHUNK_FIELDS) are packed with the pointers at each launch
            self.packed = (fn.bind(grid, block, smem, dev, FWD_POINTERS, (*tail, seg_len, mode_k, fold_len, *NO_EXTRAS),
                                   fmaps, late=len(NO_EXTRAS)), int(reverse))
            self.fused = None
            return
        # head: q, k, v, out, log-decay, initial state, final state pointers; no packed sequences
        self.fused = fn.bind(grid, block, smem, dev, FWD_POINTERS, (*tail, seg_len, mode_k, fold_len, *NO_EXTRAS),
                             fmaps)
        if nseg > 1 and not fold:  # each segment's own state (below), then the scan kernel
            if lp.source == TF32_WG_SOURCE and over.dedicated_states:
                # float32 "tf32": rtk_chunk_states_tf32 (the fused kernel's states-only mode costs
                # what its fused mode does); the last segment's state only for the final state
                sc = tf32_states_config(dk, dv)
                ssmem = tf32_states_smem_bytes(sc)
                sfn = get_function(STATES_TF32_SOURCE, tf32_states_name(sc), dev, dynamic_smem=ssmem)
                self.states = sfn.bind((bh, -(-dv // sc[1]), nseg if need_state else nseg - 1), (256, 1, 1), ssmem,
                                       dev, FWD_POINTERS, (*tail, seg_len, MODE_STATES, fold_len, *NO_EXTRAS))
            else:  # the fused kernel's states-only mode
                self.states = fn.bind(grid, block, smem, dev, FWD_POINTERS,
                                      (*tail, seg_len, MODE_STATES, fold_len, *NO_EXTRAS), fmaps)
            total = bh * dk * dv
            # head: segment states, entering states, initial state, final state, log-decay pointers
            self.scan = get_function(SEG_SCAN_SOURCE, "rtk_chunk_seg_scan", dev).bind(
                (min(-(-total // 256), 4096), 1, 1), (256, 1, 1), 0, dev, 5,
                (nseg, bh, h, dk * dv, seg_len, n - (nseg - 1) * seg_len, mode))

    def program(self, device_decay: bool) -> Optional[tuple]:
        """This call as a fixed program for the compiled entry (:mod:`rtkernels.compiled_call`):
        ``(temps, launches, keep, state_shape)``, or None where a call needs Python (packed,
        reversed). ``temps``: the shapes of the float32 per-call buffers (the slots as
        :meth:`__call__` allocates them, so the one a training forward keeps reaches the backward
        as Python's path hands it); ``launches``: :meth:`BoundLaunch.parameters` plus, per pointer slot, (source,
        byte offset) with sources q, k, v, out, decay, initial state, final state, constant,
        temporaries (``PROGRAM_SOURCES``); ``keep``: the temporary a training forward keeps for the
        backward (:attr:`fold`'s slots), or -1; ``state_shape``: the final state's, or None.
        ``device_decay``: the call passes a CUDA decay tensor (else the planned decay's pointer is
        a constant)."""
        if self.packed is not None or self.offsets is not None:
            return None
        q, k, v, out, dp, s0, fin, const, t0 = range(len(PROGRAM_SOURCES))
        decay = (dp, 0) if device_decay else (const, self.decay_ptr)
        none = (const, 0)
        fused_s0, fused_fin, temps, runs, keep = (s0, 0), (fin, 0), [], [], -1
        slots = (self.slots, *self.state_shape)
        if self.states is not None and self.scan is None:  # the states pass, then the fused pass folds its slots
            temps, keep = [slots], (0 if self.fold is not None else -1)
            runs.append((self.states, ((q, 0), (k, 0), (v, 0), (out, 0), decay, (s0, 0), (t0, 0))))
            fused_s0 = (t0, 0)
        elif self.scan is not None:  # each segment's own state, the scan, the fused pass from the entering states
            temps = [slots, slots]
            runs.append((self.states, ((q, 0), (k, 0), (v, 0), (out, 0), decay, none, (t0, 0))))
            runs.append((self.scan, ((t0, 0), (t0 + 1, 0), (s0, 0), (fin, 0), decay)))
            fused_s0, fused_fin = (t0 + 1, 0), none
        runs.append((self.fused, ((q, 0), (k, 0), (v, 0), (out, 0), decay, fused_s0, fused_fin)))
        launches = []
        for bound, head in runs:
            params = bound.parameters()
            if params is None or params[4] != len(head):
                return None
            launches.append((*params, head))
        return temps, launches, keep, (self.state_shape if self.need_state else None)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 initial_state: Optional[torch.Tensor] = None, decay: Optional[torch.Tensor] = None,
                 decay_ptr: Optional[int] = None, seqs: Optional[tuple[int, int]] = None,
                 dlog: Optional[tuple[int, int, int]] = None, keep: Optional[list] = None,
                 slots: Optional[torch.Tensor] = None, dual: Optional[tuple[int, int]] = None
                 ) -> Optional[torch.Tensor]:
        """Launch on new tensors; ``decay``: a CUDA decay tensor of the planned dtype and stride in
        place of the planned one (the cached call's), or ``decay_ptr``, the address of one (a
        :meth:`LogDecay.kernel_arg` of the planned mode); neither: the planned decay. ``seqs``: the
        packed sequences' (offsets, validity flag) addresses, for a launch planned with ``sequences``;
        ``dlog``: the (x, partial sums, final-state gradient or 0) addresses, for a launch planned
        with ``dlog``; ``dual``: the (x, second output) addresses, for a launch planned with ``dual``.
        ``keep``, ``slots``: the class docstring's ``fold`` (ignored without one)."""
        s0 = initial_state
        if s0 is not None and (s0.dtype != torch.float32 or not s0.is_contiguous()):
            s0 = s0.to(torch.float32).contiguous()
        s0p = 0 if s0 is None else s0.data_ptr()
        final = torch.empty(self.state_shape, dtype=torch.float32, device=self.device) if self.need_state else None
        fp = 0 if final is None else final.data_ptr()
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        dp = decay.data_ptr() if decay is not None else self.decay_ptr if decay_ptr is None else decay_ptr
        if self.offsets is not None:
            oq, ok, ov, oo = self.offsets
            qp, kp, vp, op = qp + oq, kp + ok, vp + ov, op + oo
        if self.fold is not None and slots is not None:  # the slots a states pass wrote before
            s0p = slots.data_ptr()
        elif self.scan is None and self.states is not None:
            # split sequence, rtk_chunk_states: the initial state and the state each segment but the
            # last ends with in the slots of ``local``; the fused pass folds them into each
            # segment's entering state, and its last segment stores the final state
            local = torch.empty((self.slots, *self.state_shape), dtype=torch.float32, device=self.device)
            self.states(qp, kp, vp, op, dp, s0p, local.data_ptr())
            s0p = local.data_ptr()
            if keep is not None and self.fold is not None:
                keep.append((local, self.fold))
        if self.packed is not None:
            bound, rev = self.packed
            if dual is not None:  # x has v's strides and the second output k's: the same row offsets
                x, out2 = dual
                extras = (x + (self.offsets[2] if self.offsets else 0), dlog[1] if dlog else 0, 0,
                          out2 + (self.offsets[1] if self.offsets else 0))
            else:
                extras = (*(dlog or (0, 0, 0)), 0)
            bound(qp, kp, vp, op, dp, s0p, fp, *(seqs or (0, 0)), rev, *extras)
            return final
        if self.scan is None:
            self.fused(qp, kp, vp, op, dp, s0p, fp)
            return final
        # split sequence: each segment's own state (no initial state), the scan over the segments'
        # states, then the fused pass of each segment from its entering state
        local = torch.empty((self.slots, *self.state_shape), dtype=torch.float32, device=self.device)
        s_in = torch.empty_like(local)
        self.states(qp, kp, vp, op, dp, 0, local.data_ptr())
        self.scan(local.data_ptr(), s_in.data_ptr(), s0p, fp, dp)
        self.fused(qp, kp, vp, op, dp, s_in.data_ptr(), 0)
        return final


#: Planned states-only launches of :func:`kernel_final_state` by call signature (None: no such pass
#: for that signature), as :data:`_planned` keeps the passes of :func:`kernel_forward`.
_final_plans: dict[tuple, Optional[ChunkLaunch]] = {}


def kernel_final_state(k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                       fp32_precision: str = "exact", reverse: bool = False) -> Optional[torch.Tensor]:
    """``sum_t gamma^(N-1-t) k_t^T v_t``, the state ``[B, H, Dk, Dv]`` (fp32) that a sequence of
    ``[B, H, N, D]`` views k, v (unit last stride) reaches from zero, without any output: the split
    strategy's first two kernels, the fused kernel's states-only mode (float32 "tf32" on wgmma:
    ``rtk_chunk_states_tf32``; each segment's own state; neither reads q or the output, so k and v
    stand in for them) and the segment scan, whose final state this is; with ``reverse``, of the reversed sequence: ``sum_t gamma^t k_t^T v_t``.
    Reads k and v once; O(N Dk Dv). None where the plan does not split the sequence into segments
    or splits the keys (then there is no such pass to run alone). The plan is kept by call
    signature (shapes, strides, dtypes, device, 16-byte alignment, the decay's kernel mode, the
    flags, the autotune store's state and the overrides), so a repeated call costs its launches."""
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    if n == 0:
        return None
    decay, mode = log_decay.kernel_arg()
    key = (k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype, k.get_device(),
           (k.data_ptr() | v.data_ptr()) & 15, mode, fp32_precision, reverse, plan_state(), current_overrides())
    if key in _final_plans:
        lc = _final_plans[key]
    else:
        lc = None
        if call_pieces(k.dtype, b * h, n, dk, dv, k.device.index)[0] is None:
            # 16-bit: the states-only mode and the scan, not the states kernel and a fold (float32
            # never folds; its "tf32" wgmma plan keeps rtk_chunk_states_tf32)
            with override(dedicated_states=k.dtype == torch.float32 and current_overrides().dedicated_states):
                lc = ChunkLaunch(k, k, v, log_decay, 1.0, v, True, reverse, fp32_precision=fp32_precision)
            if lc.scan is None:
                lc = None
        if len(_final_plans) >= _PLANNED_MAX:
            _final_plans.clear()
        _final_plans[key] = lc
    if lc is None:
        return None
    local = torch.empty((lc.slots, *lc.state_shape), dtype=torch.float32, device=k.device)
    entering = torch.empty_like(local)
    final = torch.empty(lc.state_shape, dtype=torch.float32, device=k.device)
    ptrs = [x.data_ptr() for x in (k, k, v, v)]
    if lc.offsets is not None:  # reversed: each tensor from its row N-1
        ptrs = [p + o for p, o in zip(ptrs, lc.offsets)]
    lc.states(*ptrs, decay, 0, local.data_ptr())
    lc.scan(local.data_ptr(), entering.data_ptr(), 0, final.data_ptr(), decay)
    return final


class KeyPiecesLaunch:
    """A planned call whose Dk is split (:func:`.plan.key_pieces`: over 128 on the wgmma kernel, over
    256 elsewhere, which the backward's Dv-wide passes need): one
    :class:`ChunkLaunch` per piece of key columns, the first writing ``out``, the others a
    contiguous temporary each that is then added to it (one more rounding of a 16-bit output); the
    final state is the pieces' states stacked along Dk, the initial state split the same way.
    ``tuned``: the config every piece runs (:func:`call_pieces`). Called like :class:`ChunkLaunch`.
    Extra work: the pieces read v and write an output each."""

    __slots__ = ("parts", "pieces", "need_state", "out_size", "out_stride")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
                 out: torch.Tensor, need_state: bool, reverse: bool, fp32_precision: str, pieces: list[slice],
                 tuned: Optional[Config] = None, sequences: int = 0):
        self.pieces, self.need_state = pieces, need_state
        # the [B, H, N, Dv] view of the output the plan saw: a cached call passes the caller's tensor,
        # which for layout "bnhd" is [B, N, H, Dv] over the same memory
        self.out_size, self.out_stride = tuple(out.shape), out.stride()
        self.parts = [ChunkLaunch(q[..., p], k[..., p], v, log_decay, scale, out if i == 0 else _piece_out(out),
                                  need_state, reverse, fp32_precision, tuned, sequences) for i, p in enumerate(pieces)]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 initial_state: Optional[torch.Tensor] = None, decay: Optional[torch.Tensor] = None,
                 decay_ptr: Optional[int] = None, seqs: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
        if out.stride() != self.out_stride or tuple(out.shape) != self.out_size:
            out = out.as_strided(self.out_size, self.out_stride, out.storage_offset())
        states = []
        for i, (p, part) in enumerate(zip(self.pieces, self.parts)):
            dst = out if i == 0 else _piece_out(out)  # contiguous [B, H, N, Dv], as planned
            s0 = None if initial_state is None else initial_state[:, :, p]
            states.append(part(q[..., p], k[..., p], v, dst, s0, decay, decay_ptr, seqs))
            if i:
                out.add_(dst)
        return torch.cat(states, dim=2) if self.need_state else None


def transposed_slots(launcher: Any, slots: torch.Tensor, fold: tuple) -> Optional[torch.Tensor]:
    """One pass's states-pass ``slots`` (its :attr:`ChunkLaunch.fold` ``fold``) as the slots of
    ``launcher``, a pass whose states are their transposes over the same tokens with the same
    weights: the backward's dq pass F(g, v, k, S_0^T) after the forward F(q, k, v) (sum v^T k =
    (sum k^T v)^T), and its dv pass R(k, q, g) after its dk pass R(v, g, q) (sum q^T g = (sum g^T
    q)^T). Transposed (one copy of the slots) where ``launcher`` splits the sequence the same way,
    else None (it runs its own states pass)."""
    mine = getattr(launcher, "fold", None)  # None: a launch without them (key pieces, one pass, DLOG)
    nseg, fold_len, count, (b, h, dk, dv) = fold
    if mine is None or mine != (nseg, fold_len, count, (b, h, dv, dk)):
        return None
    return slots.transpose(-1, -2).contiguous()


def _piece_out(out: torch.Tensor) -> torch.Tensor:
    return torch.empty(out.shape, dtype=out.dtype, device=out.device)


def _launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
              out: torch.Tensor, need_state: bool, reverse: bool, fp32_precision: str, sequences: int = 0):
    b, h, n, dk = q.shape
    if sequences:  # packed sequences: the heuristic's pieces (the tuned store is per (B*H, N) shape)
        pieces, tuned = key_pieces(q.dtype, dk, q.device.index, current_overrides()), None
    else:
        pieces, tuned = call_pieces(q.dtype, b * h, n, dk, v.shape[-1], q.device.index)
    if pieces is None:
        return ChunkLaunch(q, k, v, log_decay, scale, out, need_state, reverse, fp32_precision=fp32_precision,
                           sequences=sequences)
    return KeyPiecesLaunch(q, k, v, log_decay, scale, out, need_state, reverse, fp32_precision, pieces, tuned,
                           sequences)


def kernel_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
                   out: torch.Tensor, need_state: bool, fp32_precision: str = "exact") -> ChunkLaunch:
    """Plan the kernel call for ``[B, H, N, D]`` views with unit stride along D (see
    :class:`ChunkLaunch`; :class:`KeyPiecesLaunch` where Dk is split, as the tuned config or the
    heuristic chooses): the autotune store's config for the shape bucket, else
    :func:`.plan.plan_launch`; ``fp32_precision``: the float32 kernel's mode."""
    return _launcher(q, k, v, log_decay, scale, out, need_state, False, fp32_precision)


#: Planned launches of :func:`kernel_forward` by call signature (the autograd forward and the
#: backward's passes repeat the same few): planning again costs tens of µs of host time per pass.
_planned: dict[tuple, ChunkLaunch] = {}
_PLANNED_MAX = 256


def pass_launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay", scale: float,
                  out: torch.Tensor, need_state: bool, fp32_precision: str = "exact", *, reverse: bool = False,
                  sequences: int = 0, dlog: bool = False, dual: bool = False, zsplit: bool = False):
    """The planned launch (:class:`ChunkLaunch` or :class:`KeyPiecesLaunch`) of one
    :func:`kernel_forward` pass over these ``[B, H, N, D]`` views (unit last stride), kept by call
    signature: shapes, strides, dtypes, device, 16-byte alignment, the decay's kernel mode, scale,
    the flags, the number of packed sequences, the autotune store's state and the overrides. A
    repeated pass costs the key and its launches; the backward's plan holds two or three of them."""
    mode = log_decay.kernel_arg()[1]
    key = (q.shape, q.stride(), k.stride(), v.shape, v.stride(), out.stride(), q.dtype, k.dtype, v.dtype,
           out.dtype, q.get_device(), (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15, mode,
           scale, need_state, fp32_precision, reverse, sequences, dlog, dual, zsplit, plan_state(), current_overrides())
    launcher = _planned.get(key)
    if launcher is None:
        if len(_planned) >= _PLANNED_MAX:
            _planned.clear()
        launcher = _planned[key] = (
            ChunkLaunch(q, k, v, log_decay, scale, out, need_state, reverse, sequences=sequences, dual=True,
                        zsplit=zsplit) if dual
            else ChunkLaunch(q, k, v, log_decay, scale, out, need_state, sequences=sequences, dlog=True,
                             zsplit=zsplit) if dlog
            else _launcher(q, k, v, log_decay, scale, out, need_state, reverse, fp32_precision, sequences))
    return launcher


def kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: "LogDecay",
                   scale: float, out: torch.Tensor, initial_state: Optional[torch.Tensor],
                   need_state: bool, fp32_precision: str = "exact", *, reverse: bool = False,
                   packed: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   dlog: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None,
                   forward_states: Optional[tuple[torch.Tensor, tuple]] = None,
                   keep: Optional[list] = None,
                   dual: Optional[tuple[torch.Tensor, torch.Tensor]] = None, zsplit: bool = False
                   ) -> Optional[torch.Tensor]:
    """One fused pass, or with few (batch, head, value-tile) CTAs the split-sequence strategy:
    a states-only pass (``rtk_chunk_states`` for 16-bit inputs, which skips the last segment; the
    fused kernel's states-only mode plus a scan kernel for fp32), then the fused pass per segment
    starting from its entering state. ``fp32_precision`` ("exact" or "tf32") selects the float32 kernel's
    mode; 16-bit inputs ignore it.

    ``reverse``: the operator on the reversed sequence (token N-1 first), its output written back
    in reverse order, i.e. ``out = flip(F(flip(q), flip(k), flip(v)))`` along the tokens, with the
    initial state entering before token N-1 and the final state after token 0. No copy: the kernel
    gets the pointers of row N-1 and negated token strides (:mod:`rtkernels.methods._launch`); segments and the
    states scan work in the kernel's (reversed) token order unchanged.

    ``packed``: packed sequences in a batch of one, ``(offsets, valid)``: the ``[S + 1]`` int64
    offsets and the bool telling they are valid, both on the device (:mod:`.packed`); one CTA row
    per (sequence, head), one segment, states ``[S, H, Dk, Dv]``. A reversed pass reads sequence s
    from its last token to its first.

    ``dlog``: ``(x, partial, g)``, the backward's dq pass of a trainable decay (not reversed): the
    DLOG instance (:func:`.plan.dlog_launch`, whose :func:`.plan.dlog_config` must exist for these
    operands), which also writes each CTA's share of dlog(gamma) at the start of ``partial``
    (``[segments * rows, Dv / 64, H]`` float32 values, as :func:`.decay_grad.dq_pass_partials` or
    :meth:`.decay_grad.PartialSums.buffer` allocate them; :mod:`.decay_grad` sums them);
    x has v's shape and strides; g, the gradient of the forward's final state (fp32 contiguous
    ``[rows, H, Dv, Dk]`` in this pass's terms) or None, adds its term <g, W_end>.

    ``forward_states``: ``(slots, fold)`` another pass kept (the forward's for the backward's dq
    pass, the dk pass's for the dv pass): taken in place of this pass's own states pass where they
    match (:func:`transposed_slots`). ``keep``: a list that gets this pass's ``(slots, fold)`` where
    it runs a states pass (:func:`launch_pass`).

    ``dual``: ``(x, out2)``, the backward's dk and dv passes as one walk (16-bit; the caller checks
    :func:`.plan.fuses_dk_dv`): this pass is the dv pass R(k, q, g) into ``out``, and it also writes
    R(x, g, k) (dk, with x the forward's v) into ``out2``; x has v's strides, out2 k's.

    ``zsplit``: dlog(gamma) by the Z split (:class:`ChunkLaunch`): with ``dlog``, the dq pass's Z form;
    with ``dual`` (and ``dlog = (x, partial, None)``), the dk/dv pass's terms into ``partial``.

    The plan is kept by call signature (:func:`pass_launcher`), so a repeated pass costs its launches."""
    q, k, v = unit_stride(q, k, v)
    sequences = 0 if packed is None else packed[0].shape[0] - 1
    launcher = pass_launcher(q, k, v, log_decay, scale, out, need_state, fp32_precision, reverse=reverse,
                             sequences=sequences, dlog=dlog is not None, dual=dual is not None, zsplit=zsplit)
    decay = log_decay.kernel_arg()[0]
    seqs = None if packed is None else (packed[0].data_ptr(), packed[1].data_ptr())
    return launch_pass(launcher, q, k, v, out, initial_state, decay, seqs, dlog, forward_states, keep, dual)


def launch_pass(launcher: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                initial_state: Optional[torch.Tensor], decay_ptr: int, seqs: Optional[tuple[int, int]] = None,
                dlog: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None,
                forward_states: Optional[tuple[torch.Tensor, tuple]] = None,
                keep: Optional[list] = None,
                dual: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Optional[torch.Tensor]:
    """Run a planned pass (a :func:`pass_launcher` launch; :func:`kernel_forward` and the backward's
    replayed plans) on these tensors with the decay at ``decay_ptr``: ``forward_states`` folded in
    place of its states pass where they match (:func:`transposed_slots`), else ``seqs`` and
    ``dlog`` and ``dual`` (tensors, as :func:`kernel_forward` takes them) passed on as addresses. ``keep``: where
    the pass runs the dedicated states pass (its launcher has a ``fold``), ``(slots, fold)`` is
    appended to it, for a later pass whose states are the transposes of these."""
    two = {} if dual is None else {"dual": (dual[0].data_ptr(), dual[1].data_ptr())}
    slots = None if forward_states is None else transposed_slots(launcher, *forward_states)
    if slots is not None:
        return launcher(q, k, v, out, initial_state, decay_ptr=decay_ptr, slots=slots, **two)
    # only a ChunkLaunch with a states pass keeps slots (key pieces take no keep=)
    extra = {"keep": keep} if keep is not None and getattr(launcher, "fold", None) is not None else {}
    extra.update(two)
    if dlog is None:
        return launcher(q, k, v, out, initial_state, decay_ptr=decay_ptr, seqs=seqs, **extra)
    return launcher(q, k, v, out, initial_state, decay_ptr=decay_ptr, seqs=seqs, **extra,
                    dlog=(dlog[0].data_ptr(), dlog[1].data_ptr(), 0 if dlog[2] is None else dlog[2].data_ptr()))
