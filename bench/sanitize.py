"""compute-sanitizer over every rtkernels kernel, in one command, with a summary table.

    python bench/sanitize.py [--tools memcheck,racecheck,initcheck,synccheck] [--groups a,b]
                             [--out FILE] [--logs DIR] [--jobs N] [--timeout S] [--track-unused]

The runner starts, for each tool and each *group* (a driver that runs a few kernel variants on
small odd shapes, forward and backward), ``compute-sanitizer --tool T ... python
bench/sanitize.py --drive GROUP``, parses each report, and writes two tables to ``--out``
(markdown) and stdout: group x tool (errors; racecheck: errors and warnings) and kernel source x
tool (errors attributed to the kernels of each ``cuda_src/`` file by the names in the report).
A source no driver launched shows as "not run", so a new kernel without a driver is visible.
The summary is rewritten after each finished (tool, group) run, the slow tools first, so a sweep
stopped from outside (a time limit) leaves the table of what finished ("—" for the rest).
Every driver first runs once without the sanitizer: it compiles the kernels into a shared
``RTKERNELS_CACHE_DIR`` (a temporary one unless set) and must pass its own checks against the
library's fp64 path. Exit status: 0 clean, 1 errors or a failed driver, 2 no sanitizer or no GPU.

How the tools are run, and what to expect:

* ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every tensor is its own ``cudaMalloc``. With torch's
  caching allocator a read past a tensor lands in another block of the same segment (memcheck
  sees nothing) and a fresh ``torch.empty`` reuses memory some earlier kernel wrote (initcheck sees
  nothing).
* memcheck: ``--padding 256`` puts unallocated bytes after each allocation, so an overrun of a few
  rows is out of bounds even where two allocations touch.
* memcheck, racecheck and synccheck check only rtkernels' kernels (``--kernel-name kns=rtk_``);
  initcheck checks every kernel, because an uninstrumented torch kernel's writes (``randn`` of the
  inputs) would count as never made. initcheck's reports in torch kernels are listed as "other".
  initcheck does not record cp.async.bulk writes, so every reader of a wgmma forward's output
  looks uninitialised: under initcheck the 16-bit forward takes the mma.sync kernel, except in the
  fwd16-wgmma groups, which keep wgmma to check that kernel's own reads.
* initcheck reads at byte granularity: a kernel that loads a whole 16-byte vector where only part
  of it is data (the padding of a row, the tail of a tensor inside its rounded-up allocation)
  reports an uninitialised read even if the extra values are never used. The kernels load rows
  whole only when every row is 16-byte aligned and padded loads are masked; a report here is a
  finding to read, not noise to filter. ``--track-unused`` adds ``--track-unused-memory``: it
  lists allocations (torch's included) that no kernel touched completely, e.g. a state buffer
  whose last segment slot the split strategy never writes; those are reports about memory, not
  errors, and they are left out of the error counts.
* racecheck follows cp.async, cp.async.bulk and wgmma (Compute Sanitizer 2025.3); hazards it
  classifies as warnings are counted apart.
* Every sanitized run uses ``--destroy-on-device-error kernel`` and lets the driver go on past a
  failed check (counted in the table), so a kernel the tool stops does not hide the kernels
  launched after it.

First sweep (H100, Compute Sanitizer 2025.3.1, 2026-11-24; docs/testing.md has the details):
memcheck and racecheck found nothing in any group. synccheck reports "Barrier error detected.
Divergent thread(s) in block" in rtk_chunk_fwd (mma.sync and wgmma) and rtk_chunk_fwd_f32, at
one barrier each, by threads of warps 4-7. initcheck reports nothing in rtkernels' kernels; it
reports reads of never-written memory in torch kernels that read the outputs of the wgmma
kernel (whose rows go to global memory by cp.async.bulk): it does not seem to record those
writes, and the mma.sync groups, which store rows with plain stores, report nothing.

The synccheck reports were barrier.red (H200, 2026-11-26; bench/profiling/synccheck_probe.cu):
both forward kernels now OR their flags through barrier.sync and a two-word shared ring
(rtk_chunk_fwd_f32 keeps its ring in the padding of its state copy: at KMAX 256 its tiles fill
the 227 KB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
TOOL_FLAGS = {
    "memcheck": ["--padding", "256", "--leak-check", "no", "--kernel-name", "kns=rtk_"],
    "racecheck": ["--racecheck-report", "analysis", "--kernel-name", "kns=rtk_"],
    "initcheck": [],
    "synccheck": ["--kernel-name", "kns=rtk_"],
}
KERNELS_LINE = "SANITIZE-KERNELS "
SKIP_LINE = "SANITIZE-SKIP "
FAILED_LINE = "SANITIZE-CHECKS-FAILED "
#: Set by the runner for the sanitized runs: a failed check is counted and the driver goes on, so
#: that a kernel the tool terminates (``--destroy-on-device-error kernel``) does not hide the
#: kernels launched after it.
KEEP_GOING = "RTK_SANITIZE_KEEP_GOING"
PLAIN_STORES = "RTK_SANITIZE_PLAIN_STORES"  # set for initcheck: see drive()
_failures: list = []


def _expect(ok: bool, what: str) -> None:
    if ok:
        return
    if os.environ.get(KEEP_GOING) == "1":
        _failures.append(what)
        return
    raise AssertionError(what)


# =============================================================================== drivers ====== #
# Each driver runs its kernels through the public API on small odd shapes and checks every output
# against the library's fp64 torch path (``method="vanilla"``), so a launch the sanitizer breaks
# or a wrong result shows as a failed driver.

def _torch():
    import torch

    return torch


def _qkv(b, h, n, dk, dv, dtype, seed=0, offset=False):
    """q, k, v on the GPU; ``offset``: views that start one element into their storage (rows not
    16-byte aligned: the element loaders)."""
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(d):
        x = torch.randn(b, h, n, d + (1 if offset else 0), generator=g, device="cuda") / d ** 0.5
        return x.to(dtype)[..., 1:] if offset else x.to(dtype)

    return draw(dk), draw(dk), draw(dv)


def _check(got, q, k, v, what, **kwargs):
    """``got`` (output, or (output, state)) against the fp64 vanilla path: finite, relative error
    below 5e-2 (a sanity bound: the tests hold the real tolerances)."""
    import rtkernels

    torch = _torch()
    want = rtkernels.causal_linear_attention(q.double(), k.double(), v.double(), method="vanilla",
                                             **{key: (x.double() if isinstance(x, torch.Tensor) else x)
                                                for key, x in kwargs.items()})
    pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
    for x, y in pairs:
        x = x.double()
        err = float((x - y).norm() / y.norm().clamp(min=1e-30))
        _expect(bool(torch.isfinite(x).all()) and err < 5e-2, f"{what}: relative error {err:.3g}")


def _forward(q, k, v, method, what, precision=None, state=False, decay=None):
    """One forward call (with an initial state and the final state when ``state``), checked."""
    import rtkernels

    torch = _torch()
    h = q.shape[1]
    decay = decay if decay is not None else torch.linspace(0.5, 0.999, h, device="cuda")
    kw = {"decay": decay, "scale": 0.7}
    if state:
        kw.update(initial_state=torch.randn(q.shape[0], h, q.shape[3], v.shape[3], device="cuda") / 4,
                  return_state=True)
    got = rtkernels.causal_linear_attention(q, k, v, method=method, fp32_precision=precision, **kw)
    _check(got, q, k, v, what, **kw)


def _train(q, k, v, what, precision=None, decay_grad=False, state=True, initial=True):
    """Forward and backward through the chunk kernel (the kernel backward: three passes, two of
    them reversed; with ``decay_grad`` the dlog(gamma) kernel and its sum), gradients checked.
    ``state``: the final state in the loss, from an initial state unless ``initial`` is False."""
    import rtkernels

    torch = _torch()
    b, h, n, dk = q.shape
    dv = v.shape[3]
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    s0 = (torch.randn(b, h, dk, dv, device="cuda") / 4).requires_grad_(True) if state and initial else None
    decay = torch.linspace(0.5, 0.999, h, device="cuda").requires_grad_(decay_grad)
    res = rtkernels.causal_linear_attention(*leaves, decay, method="chunk", initial_state=s0, return_state=state,
                                            fp32_precision=precision)
    out, fin = res if state else (res, None)
    w = torch.randn_like(out)
    loss = (out.float() * w.float()).sum() + (fin.sum() if state else 0)
    loss.backward()
    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_s0 = None if s0 is None else s0.detach().double().requires_grad_(True)
    ref_decay = decay.detach().double().requires_grad_(decay_grad)
    ref = rtkernels.causal_linear_attention(*ref_leaves, ref_decay, method="vanilla", initial_state=ref_s0,
                                            return_state=state)
    ref_out, ref_fin = ref if state else (ref, None)
    ((ref_out * w.double()).sum() + (ref_fin.sum() if state else 0)).backward()
    pairs = [(x.grad, y.grad) for x, y in zip(leaves, ref_leaves)]
    if s0 is not None:
        pairs.append((s0.grad, ref_s0.grad))
    if decay_grad:
        pairs.append((decay.grad, ref_decay.grad))
    scales = [y.norm() for _, y in pairs]
    if decay_grad:  # d(decay) sums terms of either sign: its rounding error scales with the sum of |terms|
        mag = [x.detach().double().abs().requires_grad_(x is decay) for x in (q, k, v, decay)]
        s0_abs = None if s0 is None else s0.detach().double().abs()
        res = rtkernels.causal_linear_attention(*mag, method="vanilla", initial_state=s0_abs, return_state=state)
        mo, mf = res if state else (res, None)
        ((mo * w.double().abs()).sum() + (mf.sum() if state else 0)).backward()
        scales[-1] = mag[3].grad.norm()
    for i, ((x, y), ref_norm) in enumerate(zip(pairs, scales)):
        err = float((x.double() - y).norm() / ref_norm.clamp(min=1e-30))
        _expect(bool(torch.isfinite(x).all()) and err < 5e-2, f"{what}: gradient {i} relative error {err:.3g}")


def _hopper() -> bool:
    return _torch().cuda.get_device_capability() == (9, 0)


def _drive_fwd16(wgmma: bool, bv: Optional[int] = None, stages: Optional[int] = None) -> Optional[str]:
    from rtkernels.methods import chunk

    torch = _torch()
    if wgmma and not _hopper():
        return "the wgmma kernel runs on compute capability 9.0 only"
    shapes = [(2, 3, 131, 40, 72), (1, 2, 100, 128, 128)]
    if not wgmma:  # KMAX 256 (the wgmma kernel takes Dk <= 128) and more CTAs than SMs (MINB 2)
        shapes += [(1, 2, 70, 200, 33), (2, 70, 65, 16, 128)]
    if stages == 3:  # three stages: the chunk loop's stage cycle (c % 3) over 2 to 5 chunks
        shapes = [(2, 3, 131, 40, 72), (1, 2, 300, 128, 128), (1, 1, 257, 64, 64)]
    with chunk.override(wgmma=wgmma, bv=bv, segments=1, stages=stages):
        for dt in (torch.float16, torch.bfloat16):
            for i, s in enumerate(shapes):
                _forward(*_qkv(*s, dt, seed=i), "chunk", f"fwd16 {s} {dt}", state=i % 2 == 1)
            _forward(*_qkv(1, 2, 90, 48, 40, dt, offset=True), "chunk", f"fwd16 unaligned {dt}")
    return None


def _drive_split(dedicated: bool) -> Optional[str]:
    from rtkernels.methods import chunk

    torch = _torch()
    kernels = [(False, None)] + ([(True, 128)] if _hopper() else [])
    for wgmma, bv in kernels:
        with chunk.override(wgmma=wgmma, bv=bv, segments=3, dedicated_states=dedicated):
            for dt in (torch.float16, torch.bfloat16):
                _forward(*_qkv(1, 2, 700, 40, 72, dt), "chunk", f"split {dt}", state=True)
                _forward(*_qkv(1, 1, 600, 200, 40, dt, seed=1), "chunk", f"split KMAX 256 {dt}", state=True)
                _forward(*_qkv(1, 2, 520, 37, 37, dt, seed=2, offset=True), "chunk", f"split unaligned {dt}")
        with chunk.override(wgmma=wgmma, bv=bv, segments=2, dedicated_states=dedicated):  # 2 slots a segment
            _forward(*_qkv(1, 2, 1024, 40, 72, torch.bfloat16), "chunk", "split, slots of half a segment", state=True)
    return None


def _drive_states_tma() -> Optional[str]:
    """The states pass's Hopper instances (chunk/states.cu TMA: tensor copies and wgmma, aligned
    rows): forward passes with two value tiles, KMAX 256 (S split by rows) and KMAX 64 (S split by
    value columns), and a training step whose reversed dk and dv passes load their boxes backwards
    (and the dv pass folds the dk pass's slots)."""
    from rtkernels.methods import chunk

    if not _hopper():
        return "tensor copies need compute capability 9.0"
    torch = _torch()
    with chunk.override(segments=3):
        for dt in (torch.float16, torch.bfloat16):
            _forward(*_qkv(1, 2, 700, 128, 96, dt), "chunk", f"states by tensor copies {dt}", state=True)
            _forward(*_qkv(1, 1, 640, 256, 200, dt, seed=1), "chunk", f"tensor copies, KMAX 256, two value tiles {dt}",
                     state=True)
            _forward(*_qkv(1, 2, 700, 64, 100, dt, seed=4), "chunk", f"tensor copies, KMAX 64 {dt}", state=True)
        _train(*_qkv(1, 2, 700, 128, 128, torch.bfloat16, seed=2), "tensor copies, reversed passes", state=False)
        _train(*_qkv(1, 2, 700, 128, 128, torch.bfloat16, seed=3), "tensor copies, trainable decay", decay_grad=True,
               state=False)
    return None


def _drive_f32(precision: str) -> Optional[str]:
    from rtkernels.methods import chunk

    torch = _torch()
    # "tf32" on Hopper: rtk_chunk_fwd_tf32 where it runs (aligned rows, Dk <= 128), and the mma.sync
    # kernel with wgmma off
    for segments, wgmma in ((1, None), (3, None)) + (((1, False), (3, False)) if precision == "tf32" else ()):
        with chunk.override(segments=segments, wgmma=wgmma):
            _forward(*_qkv(2, 3, 131, 40, 72, torch.float32), "chunk", f"f32 {precision}", precision, state=True)
            _forward(*_qkv(1, 2, 300, 200, 33, torch.float32, seed=1), "chunk", f"f32 KMAX 256 {precision}",
                     precision)
            _forward(*_qkv(1, 2, 700, 37, 64, torch.float32, seed=2, offset=True), "chunk",
                     f"f32 unaligned {precision}", precision, state=True)
    return None


def _drive_backward() -> Optional[str]:
    from rtkernels.methods import chunk

    torch = _torch()
    for segments in (None, 3):
        with chunk.override(segments=segments):
            for dt in (torch.float16, torch.bfloat16):
                _train(*_qkv(1, 2, 400, 40, 72, dt), f"backward {dt} segments={segments}")
                _train(*_qkv(1, 2, 300, 37, 200, dt, seed=1, offset=True), f"backward unaligned {dt}", state=False)
                # Dk = Dv: split alike, the dq pass folds the forward's slots (launch.transposed_slots)
                _train(*_qkv(1, 2, 700, 64, 64, dt, seed=2), f"backward forward slots {dt} segments={segments}")
            for precision in ("exact", "tf32"):
                _train(*_qkv(1, 2, 400, 40, 72, torch.float32), f"backward f32 {precision}", precision)
    return None


def _drive_dk_dv() -> Optional[str]:
    """The backward's dk and dv passes as one walk (the DUAL instance of chunk/fwd16.cu: 16-bit,
    aligned rows, Dv <= 128, wgmma): both dtypes, KMAX over and under BV, zero columns, a partial
    chunk, one token, and 3 segments folding the states pass's slots."""
    from rtkernels.methods import chunk

    if not chunk.plan._wgmma_ok(0, chunk.current_overrides()):
        return "needs the wgmma kernel (compute capability 9.0)"
    torch = _torch()
    for segments in (None, 3):
        with chunk.override(segments=segments, fused_dk_dv=True):
            for dt in (torch.float16, torch.bfloat16):
                _train(*_qkv(1, 2, 400, 40, 104, dt), f"dk+dv {dt} segments={segments}")
                _train(*_qkv(1, 2, 300, 128, 64, dt, seed=1), f"dk+dv KMAX over BV {dt}", state=False)
                _train(*_qkv(2, 2, 1, 64, 128, dt, seed=2), f"dk+dv one token {dt}", state=False)
    return None


def _drive_decay_grad() -> Optional[str]:
    """The 16-bit dlog(gamma) kernel (the dq pass's own sum turned off, as on a GPU without wgmma)."""
    from rtkernels.methods.chunk import backward

    torch = _torch()
    fused, backward.dq_pass_sums = backward.dq_pass_sums, lambda *args: False
    try:
        for dt in (torch.float16, torch.bfloat16):
            _train(*_qkv(1, 2, 200, 40, 96, dt), f"dlog few CTAs (BV 32) {dt}", decay_grad=True)
            _train(*_qkv(2, 70, 65, 40, 72, dt), f"dlog many CTAs (BV 64) {dt}", decay_grad=True, state=False)
            _train(*_qkv(1, 1, 130, 200, 40, dt), f"dlog KMAX 256 {dt}", decay_grad=True)
            _train(*_qkv(1, 2, 100, 37, 37, dt, offset=True), f"dlog unaligned {dt}", decay_grad=True, state=False)
    finally:
        backward.dq_pass_sums = fused
    return None


def _drive_decay_grad_f32() -> Optional[str]:
    """The float32 dlog(gamma) kernels in both modes: 32-wide tiles with the state's rows in two slices
    (very few CTAs), 32-wide tiles in two stages (few: on a GPU of 132 SMs), 64-wide tiles at KMAX
    128 (many CTAs), KMAX 64, KMAX 256 (one stage), unaligned rows (the element loader). On Hopper
    the "tf32" mode's aligned cases up to Dk 128 run the wgmma kernel (decay_grad_tf32.cu)."""
    torch = _torch()
    for precision in ("exact", "tf32"):
        f32 = torch.float32
        _train(*_qkv(1, 2, 200, 100, 96, f32), f"dlog f32 very few CTAs (row slices) {precision}", precision,
               decay_grad=True)
        _train(*_qkv(1, 24, 130, 128, 128, f32), f"dlog f32 few CTAs (BV 32) {precision}", precision,
               decay_grad=True, state=False)
        _train(*_qkv(2, 70, 65, 128, 72, f32), f"dlog f32 many CTAs (BV 64) {precision}", precision,
               decay_grad=True, state=False)
        _train(*_qkv(1, 2, 130, 40, 72, f32), f"dlog f32 KMAX 64 {precision}", precision, decay_grad=True)
        _train(*_qkv(1, 1, 130, 200, 40, f32), f"dlog f32 KMAX 256 {precision}", precision, decay_grad=True)
        _train(*_qkv(1, 2, 100, 37, 37, f32, offset=True), f"dlog f32 unaligned {precision}", precision,
               decay_grad=True, state=False)
    return None


def _drive_dq_dlog() -> Optional[str]:
    """dlog(gamma) summed inside the dq pass (the DLOG instance of chunk/fwd16.cu: fp16 and bf16,
    aligned rows, Dv <= 128, wgmma), with and without a final state in the loss (its term <G, W_end>)."""
    from rtkernels.methods import chunk

    if not chunk.plan._wgmma_ok(0, chunk.current_overrides()):
        return "needs the wgmma kernel (compute capability 9.0)"
    torch = _torch()
    for dt in (torch.bfloat16, torch.float16):
        _train(*_qkv(1, 2, 200, 40, 96, dt), f"dlog in dq pass KMAX 128, one value tile {dt}", decay_grad=True,
               state=False)
        _train(*_qkv(2, 3, 65, 128, 128, dt), f"dlog in dq pass, two value tiles {dt}", decay_grad=True,
               state=False)
        _train(*_qkv(1, 2, 130, 200, 64, dt), f"dlog in dq pass KMAX 64, partial value tile {dt}",
               decay_grad=True, state=False)
        _train(*_qkv(1, 2, 1, 64, 64, dt), f"dlog in dq pass, one token {dt}", decay_grad=True, state=False)
        with chunk.override(segments=3):  # the states pass carrying W, the DLOG pass folding S and W
            _train(*_qkv(1, 2, 1000, 72, 128, dt), f"dlog in dq pass, 3 segments {dt}", decay_grad=True,
                   state=False)
        with chunk.override(segments=2):  # two slots a segment
            _train(*_qkv(1, 2, 1024, 64, 128, dt), f"dlog in dq pass, 2 segments of 2 slots {dt}",
                   decay_grad=True, state=False)
            _train(*_qkv(1, 2, 1000, 72, 128, dt), f"dlog in dq pass, 2 segments, final state {dt}",
                   decay_grad=True)
        _train(*_qkv(2, 3, 65, 128, 96, dt), f"dlog in dq pass, final state {dt}", decay_grad=True)
    # the Z split with its 128-wide dq pass (DLOG 3, bf16; no initial state), and its fused dk/dv pass
    with chunk.override(dlog_split=True, dlog_wide=True, fused_dk_dv=True, segments=1):
        _train(*_qkv(1, 2, 200, 128, 128, torch.bfloat16), "Z dq pass 128 wide", decay_grad=True, state=False)
        _train(*_qkv(1, 2, 65, 128, 128, torch.bfloat16), "Z dq pass 128 wide, final state", decay_grad=True,
               initial=False)
    return None


def _drive_large_heads() -> Optional[str]:
    """Dk over 128 and Dv up to 512 with the plan's default choices (on Hopper: the wgmma kernel on
    key pieces, forward and the backward's passes, which split their Dv-wide contraction the same
    way) and with the one-pass Dk-256 mma.sync kernel."""
    from rtkernels.methods import chunk

    torch = _torch()
    for pieces in (True, False):
        with chunk.override(key_pieces=pieces):
            for dt in (torch.float16, torch.bfloat16):
                tag = "key pieces" if pieces else "one pass"
                _forward(*_qkv(1, 2, 130, 256, 512, dt), "chunk", f"large {tag} 256/512 {dt}", state=True)
                _forward(*_qkv(1, 2, 100, 200, 320, dt, seed=1), "chunk", f"large {tag} 200/320 {dt}")
                _train(*_qkv(1, 2, 130, 256, 384, dt, seed=2), f"large {tag} backward 256/384 {dt}",
                       decay_grad=True)
    return None


def _drive_method(method: str) -> Optional[str]:
    torch = _torch()
    shapes = [(2, 3, 131, 20, 72), (1, 2, 90, 100, 33), (1, 1, 70, 256, 256), (1, 2, 65, 150, 40)]
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for i, s in enumerate(shapes):
            _forward(*_qkv(*s, dt, seed=i), method, f"{method} {s} {dt}", state=i % 2 == 0)
    return None


def _drive_decode() -> Optional[str]:
    import rtkernels

    torch = _torch()
    if not hasattr(rtkernels, "decode"):
        return "this checkout has no rtkernels.decode"
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for b, h, t, dk, dv in ((3, 2, 1, 40, 72), (2, 3, 3, 200, 33), (2, 2, 2, 128, 128)):
            q, k, v = _qkv(b, h, t, dk, dv, dt)
            pool = torch.randn(b + 2, h, dk, dv, device="cuda") / 4
            idx = torch.tensor([b + 1] + list(range(b - 1)), dtype=torch.int32, device="cuda")
            idx[-1] = -1  # padding: no state read or written
            want_pool = pool.clone()
            decay = torch.linspace(0.5, 0.999, h, device="cuda")
            out = rtkernels.decode(q, k, v, pool, decay, scale=0.7, state_indices=idx)
            for i, row in enumerate(idx.tolist()):
                if row < 0:
                    continue
                o, s = rtkernels.causal_linear_attention(
                    q[i:i + 1].double(), k[i:i + 1].double(), v[i:i + 1].double(), decay.double(), scale=0.7,
                    method="vanilla", initial_state=want_pool[row:row + 1].double(), return_state=True)
                for x, y in ((out[i:i + 1], o), (pool[row:row + 1], s)):
                    err = float((x.double() - y).norm() / y.norm().clamp(min=1e-30))
                    _expect(err < 5e-2, f"decode {dt} row {row}: relative error {err:.3g}")
    return None


def _grads_close(got, want, what, bound=5e-2):
    """Each tensor of ``got`` against the fp64 one of ``want`` (relative Frobenius error < ``bound``,
    a sanity bound: the tests hold the real tolerances)."""
    torch = _torch()
    for i, (x, y) in enumerate(zip(got, want)):
        err = float((x.detach().double() - y.detach()).norm() / y.detach().norm().clamp(min=1e-30))
        _expect(bool(torch.isfinite(x).all()) and err < bound, f"{what}: tensor {i} relative error {err:.3g}")


def _drive_packed() -> Optional[str]:
    """Packed sequences (cu_seqlens) on the chunk kernels: lengths 0, 1, 63, 65, 130 in one batch,
    forward with initial and final states, backward (three passes, two reversed), 16-bit and fp32,
    against the fp64 torch path of the same packed call."""
    import rtkernels

    torch = _torch()
    lens = [65, 0, 1, 130, 63]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    n, h = sum(lens), 3
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for dk, dv in ((64, 96), (37, 130), (128, 128)):
            q, k, v = _qkv(1, h, n, dk, dv, dt, seed=dk)
            s0 = torch.randn(len(lens), h, dk, dv, device="cuda") / 4
            decay = torch.linspace(0.5, 0.999, h, device="cuda")
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, s0)]
            out, fin = rtkernels.causal_linear_attention(*leaves[:3], decay, scale=0.7, initial_state=leaves[3],
                                                         return_state=True, cu_seqlens=cu)
            ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, s0)]
            want, want_fin = rtkernels.causal_linear_attention(*ref[:3], decay.double(), scale=0.7,
                                                               initial_state=ref[3], return_state=True, cu_seqlens=cu)
            what = f"packed {dt} {dk}x{dv}"
            _grads_close([out, fin], [want, want_fin], what + " forward")
            w = torch.randn_like(out, dtype=torch.float32)
            ((out.float() * w).sum() + fin.sum()).backward()
            ((want * w.double()).sum() + want_fin.sum()).backward()
            _grads_close([x.grad for x in leaves], [x.grad for x in ref], what)
    for dk, dv in ((64, 96), (128, 128)):  # a trainable decay, no state returned: dlog(gamma) in the dq pass
        q, k, v = _qkv(1, h, n, dk, dv, torch.bfloat16, seed=dk + 1)
        decay = torch.linspace(0.5, 0.999, h, device="cuda")
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, decay)]
        ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, decay)]
        out, fin = rtkernels.causal_linear_attention(*leaves, scale=0.7, return_state=True, cu_seqlens=cu)
        want, want_fin = rtkernels.causal_linear_attention(*ref, scale=0.7, return_state=True, cu_seqlens=cu)
        w = torch.randn_like(out, dtype=torch.float32)
        ((out.float() * w).sum() + fin.sum()).backward()
        ((want * w.double()).sum() + want_fin.sum()).backward()
        _grads_close([out] + [x.grad for x in leaves], [want] + [x.grad for x in ref], f"packed trainable {dk}x{dv}")
    return None


def _drive_normalize() -> Optional[str]:
    """linear_attention's fused normalization (cuda_src/normalize/fwd.cu, bwd.cu): both features,
    both layouts, odd widths, forward and backward, against the fp64 torch path. The core calls
    run the mma.sync kernel (plain stores), so initcheck's view of what the normalization kernels
    read is not clouded by the wgmma kernel's bulk-copied outputs, which it does not record."""
    import rtkernels
    from rtkernels.methods import chunk

    torch = _torch()
    with chunk.override(wgmma=False):
        _normalize_cases(rtkernels, torch)
    return None


def _normalize_cases(rtkernels, torch) -> None:
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for feature in ("identity", "1+qk"):
            for layout, (b, h, n, dk, dv) in (("bhnd", (2, 3, 97, 37, 40)), ("bnhd", (1, 2, 130, 64, 128))):
                q, k, v = _qkv(b, h, n, dk, dv, dt, seed=n)
                q, k = (torch.nn.functional.elu(x.float()).add(1).to(dt) for x in (q, k))  # positive features
                if layout == "bnhd":
                    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                decay = torch.linspace(0.5, 0.999, h, device="cuda")
                leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
                ref = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
                kw = {"scale": 0.3, "feature": feature, "layout": layout}
                out = rtkernels.linear_attention(*leaves, decay, **kw)
                want = rtkernels.linear_attention(*ref, decay.double(), **kw)
                what = f"normalize {dt} {feature} {layout}"
                _grads_close([out], [want], what + " forward")
                w = torch.randn_like(out, dtype=torch.float32)
                (out.float() * w).sum().backward()
                (want * w.double()).sum().backward()
                # the division doubles the 16-bit rounding of the gradients (bf16 dq: about 6e-2 here)
                _grads_close([x.grad for x in leaves], [x.grad for x in ref], what, 5e-2 if dt == torch.float32 else 0.2)


#: group -> (driver, what it exercises).
GROUPS: dict[str, tuple[Callable[[], Optional[str]], str]] = {
    "fwd16-mma": (lambda: _drive_fwd16(False),
                  "chunk/fwd16.cu, mma.sync, one pass, MINB 1 and 2, KMAX 64-256, VEC on/off"),
    "fwd16-wgmma-bv64": (lambda: _drive_fwd16(True, 64), "chunk/fwd16.cu, wgmma, BV 64"),
    "fwd16-wgmma-bv128": (lambda: _drive_fwd16(True, 128), "chunk/fwd16.cu, wgmma, BV 128"),
    "fwd16-wgmma-stages3": (lambda: (_drive_fwd16(True, 64, 3) or _drive_fwd16(True, 128, 3)),
                            "chunk/fwd16.cu, wgmma, three tile stages, BV 64 and 128 (one output buffer)"),
    "split-states": (lambda: _drive_split(True), "chunk/states.cu + fwd16 folding its slots (3 segments; 2 of 2 slots)"),
    "states-tma": (_drive_states_tma, "chunk/states.cu by tensor copies and wgmma (3 segments; forward, reversed and DLOG passes)"),
    "split-segscan": (lambda: _drive_split(False), "fwd16 states-only pass + chunk/seg_scan.cu"),
    "f32-exact": (lambda: _drive_f32("exact"), "chunk/fwd_f32.cu 3xTF32, one pass and split (+ seg_scan)"),
    "f32-tf32": (lambda: _drive_f32("tf32"), "chunk/fwd_f32.cu TF32 and, on Hopper, chunk/fwd_tf32.cu; one pass "
                 "and split (+ seg_scan)"),
    "backward": (_drive_backward, "kernel backward: forward and reversed passes, 16-bit and fp32, split"),
    "dk-dv": (_drive_dk_dv, "chunk/fwd16.cu DUAL (the backward's dk and dv passes as one walk; one segment and "
                            "three, with chunk/states.cu)"),
    "decay-grad": (_drive_decay_grad, "chunk/decay_grad.cu (BV 32 and 64, KMAX 256) + chunk/decay_grad_sum.cu"),
    "decay-grad-f32": (_drive_decay_grad_f32, "chunk/decay_grad_f32.cu (exact and tf32; BV 32 and 64, row slices, "
                                              "KMAX 64, 128, 256, element loader), on Hopper chunk/decay_grad_tf32.cu "
                                              "(tf32, KMAX 64 and 128) + chunk/decay_grad_sum.cu"),
    "dq-dlog": (_drive_dq_dlog, "chunk/fwd16.cu DLOG (dlog(gamma) in the backward's dq pass, bf16 and fp16 wgmma; one "
                                "segment, three, two of two slots, with chunk/states.cu DLOG; the Z split's 128-wide "
                                "pass and its DUAL dk/dv pass) + chunk/decay_grad_sum.cu"),
    "large-heads": (_drive_large_heads, "chunk kernels at Dk 200-256, Dv 320-512: key pieces and one pass, "
                                        "forward, backward, dlog(gamma)"),
    "scan": (lambda: _drive_method("scan"), "scan.cu, KMAX 32-256, fp32/fp16/bf16"),
    "fleet": (lambda: _drive_method("fleet"), "scan.cu rank tiles + fleet.cu reduction"),
    "block": (lambda: _drive_method("block"), "block.cu, BV 32 and 64"),
    "decode": (_drive_decode, "decode.cu (pool, indices with padding)"),
    "packed": (_drive_packed, "chunk kernels on packed sequences (cu_seqlens, empty ones included): forward, "
                              "states, backward; fp32/fp16/bf16; bf16 with a trainable decay and the final states "
                              "in the loss (DLOG dq pass)"),
    "normalize": (_drive_normalize, "normalize/fwd.cu + normalize/bwd.cu (linear_attention), both features "
                                    "and layouts, forward and backward"),
}


def drive(group: str) -> int:
    """Run one group's driver (what compute-sanitizer launches) and print the kernels it used."""
    import rtkernels.jit

    from rtkernels.methods import chunk

    torch = _torch()
    # Under initcheck the 16-bit forward runs on mma.sync (plain stores) unless the group asks for
    # wgmma itself: initcheck misses cp.async.bulk writes, and its reports in every later reader
    # of a wgmma output would bury (and, at a million reports, time out) the rest of the group.
    with chunk.override(wgmma=False) if os.environ.get(PLAIN_STORES) else contextlib.nullcontext():
        skip = GROUPS[group][0]()
    torch.cuda.synchronize()
    if skip:
        print(SKIP_LINE + skip)
    kernels = sorted({(r["source"], r["name"]) for r in rtkernels.jit.compile_log()})
    print(KERNELS_LINE + json.dumps(kernels))
    if _failures:
        more = [f"... {len(_failures)} in all"] if len(_failures) > 20 else []
        print(FAILED_LINE + json.dumps(_failures[:20] + more))
        return 1
    return 0


# ================================================================================ runner ====== #

def find_sanitizer(given: Optional[str]) -> Optional[str]:
    """compute-sanitizer from ``--sanitizer``, PATH, $CUDA_HOME/bin or /usr/local/cuda/bin."""
    candidates = [given] if given else [shutil.which("compute-sanitizer")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / "compute-sanitizer"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACE = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_RECORD = re.compile(r"^========= (?![ ]|$)(?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER)(.+)$", re.MULTILINE)
_KERNEL = re.compile(r"\b(rtk_[A-Za-z0-9_]+)")


def parse_report(text: str, tool: str) -> dict:
    """errors, warnings (racecheck) and errors by kernel base name from one sanitizer log."""
    res = {"errors": None, "warnings": 0, "unused": 0, "by_kernel": {}}
    # attribute each record (a header line, then indented lines) to the first rtk_ kernel it names
    records = list(_RECORD.finditer(text))
    ends = [mm.start() for mm in records[1:]] + [len(text)]
    for mm, end in zip(records, ends):
        block, head = text[mm.start():end], mm.group(1).lower()
        if "unused memory" in head:
            res["unused"] += 1  # --track-unused-memory: a report about an allocation, not an error
            continue
        if tool == "racecheck" and head.startswith("warning"):
            continue
        km = _KERNEL.search(block)
        key = km.group(1) if km else "other"
        res["by_kernel"][key] = res["by_kernel"].get(key, 0) + 1
    m = _RACE.search(text) if tool == "racecheck" else None
    if m:
        res["errors"], res["warnings"] = int(m.group(2)), int(m.group(3))
    else:
        sums = [int(x) for x in _SUMMARY.findall(text)]
        res["errors"] = max(0, sum(sums) - res["unused"]) if sums else None
    return res


def _base(name: str) -> str:
    return name.split("<", 1)[0]


def run_one(cmd: list, timeout: float, env: dict) -> tuple[int, str, float]:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -9, out + "\nTIMEOUT", time.time() - t0


def _driver_info(output: str) -> tuple[list, Optional[str], list]:
    """(kernels the driver used, why it skipped or None, the checks that failed)."""
    kernels, skip, failed = [], None, []
    for line in output.splitlines():
        if line.startswith(KERNELS_LINE):
            kernels = json.loads(line[len(KERNELS_LINE):])
        elif line.startswith(SKIP_LINE):
            skip = line[len(SKIP_LINE):]
        elif line.startswith(FAILED_LINE):
            failed = json.loads(line[len(FAILED_LINE):])
    return kernels, skip, failed


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated, of: " + ", ".join(GROUPS))
    ap.add_argument("--out", default=None, help="summary file (markdown); default bench/out/sanitize-<time>.md")
    ap.add_argument("--logs", default=None, help="directory for the full sanitizer logs; default beside --out")
    ap.add_argument("--jobs", type=int, default=4, help="sanitizer processes at once (one GPU)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per sanitizer process")
    ap.add_argument("--sanitizer", default=None, help="path of compute-sanitizer")
    ap.add_argument("--track-unused", action="store_true", help="initcheck --track-unused-memory (reports, not errors)")
    args = ap.parse_args(argv)
    if args.drive:
        return drive(args.drive)

    tools = [t for t in args.tools.split(",") if t]
    groups = [g for g in args.groups.split(",") if g]
    bad = [t for t in tools if t not in TOOLS] + [g for g in groups if g not in GROUPS]
    if bad:
        print(f"sanitize: unknown tool or group: {', '.join(bad)}", file=sys.stderr)
        return 2
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("sanitize: compute-sanitizer not found (looked at --sanitizer, PATH, $CUDA_HOME/bin, "
              "/usr/local/cuda/bin); it ships with the CUDA toolkit: install the toolkit or pass --sanitizer PATH",
              file=sys.stderr)
        return 2
    torch = _torch()
    from rtkernels.jit import compiler_available, list_sources

    if not (torch.cuda.is_available() and compiler_available()):
        print("sanitize: needs a CUDA GPU with CuPy (the kernels are compiled with NVRTC through CuPy)",
              file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path(__file__).resolve().parent / "out" / f"sanitize-{stamp}.md")
    logs = Path(args.logs or out.with_suffix(""))
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    env.setdefault("RTKERNELS_CACHE_DIR", tempfile.mkdtemp(prefix="rtkernels-sanitize-"))
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH", "")) if x)
    me = [sys.executable, str(Path(__file__).resolve()), "--drive"]

    # 1. each driver once without the sanitizer: compile, check, learn its kernels
    info: dict[str, dict] = {}

    def plain(g):
        return g, run_one(me + [g], args.timeout, env)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for g, (rc, text, secs) in pool.map(plain, groups):
            kernels, skip, _ = _driver_info(text)
            info[g] = {"rc": rc, "kernels": kernels, "skip": skip, "seconds": secs}
            (logs / f"{g}.plain.log").write_text(text)
            state = "skipped: " + skip if skip else ("ok" if rc == 0 else f"FAILED rc={rc}")
            print(f"[plain] {g}: {state}, {len(kernels)} kernels, {secs:.0f} s", flush=True)

    # 2. every tool over every driver that ran; the slow tools first (racecheck, initcheck: minutes
    # on the larger groups), so that a run cut short by its caller has the long ones behind it
    slow_first = sorted(tools, key=lambda t: ("racecheck", "initcheck", "memcheck", "synccheck").index(t)
                        if t in TOOLS else len(TOOLS))
    jobs = [(t, g) for t in slow_first for g in groups if info[g]["rc"] == 0 and not info[g]["skip"]]
    results: dict[tuple, dict] = {}

    def sanitize(job):
        tool, g = job
        log = logs / f"{g}.{tool}.log"
        flags = list(TOOL_FLAGS[tool])
        if tool == "initcheck" and args.track_unused:
            flags.append("--track-unused-memory")
        cmd = [sanitizer, "--tool", tool, *flags, "--print-limit", "1000", "--show-backtrace", "device",
               "--destroy-on-device-error", "kernel", "--log-file", str(log), *me, g]
        extra = {KEEP_GOING: "1", **({PLAIN_STORES: "1"} if tool == "initcheck" else {})}
        rc, text, secs = run_one(cmd, args.timeout, dict(env, **extra))
        report = log.read_text() if log.exists() else ""
        res = parse_report(report, tool)
        kernels, _, failed = _driver_info(text)
        res.update(rc=rc, seconds=secs, driver_ok=KERNELS_LINE in text, checks_failed=len(failed))
        (logs / f"{g}.{tool}.stdout").write_text(text)
        return job, res

    out.parent.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done in concurrent.futures.as_completed([pool.submit(sanitize, job) for job in jobs]):
            (tool, g), res = done.result()
            results[(tool, g)] = res
            print(f"[{tool}] {g}: {_cell(res)} ({res['seconds']:.0f} s)", flush=True)
            # the summary so far ("—": not finished), so a sweep stopped from outside leaves one
            out.write_text(_summary(tools, groups, info, results, list_sources(), sanitizer, logs, args))

    text = _summary(tools, groups, info, results, list_sources(), sanitizer, logs, args)
    out.write_text(text)
    print(text)
    print(f"summary: {out}\nlogs: {logs}")
    failed = any(i["rc"] != 0 for i in info.values()) or any(
        r["errors"] != 0 or not r["driver_ok"] or r["checks_failed"] for r in results.values())
    return 1 if failed else 0


def _cell(res: Optional[dict]) -> str:
    if res is None:
        return "—"
    if res["rc"] == -9:
        return "timeout"
    if res["errors"] is None:
        return f"no report (rc {res['rc']})"
    cell = str(res["errors"])
    rtk = sum(c for k, c in res["by_kernel"].items() if k != "other")
    if res["errors"] and rtk < res["errors"]:
        cell += f" ({rtk} shown in rtk_ kernels)"
    if res.get("checks_failed"):
        cell += f", {res['checks_failed']} driver checks failed"
    if res["unused"]:
        cell += f" ({res['unused']} unused-memory reports)"
    if res["warnings"]:
        cell += f" ({res['warnings']} warn)"
    if not res["driver_ok"]:
        cell += f", driver died (rc {res['rc']})"
    return cell


def _summary(tools, groups, info, results, sources, sanitizer, logs, args) -> str:
    torch = _torch()
    import rtkernels

    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    lines = [f"# compute-sanitizer sweep, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"- GPU: {torch.cuda.get_device_name()} (cc {'.'.join(map(str, torch.cuda.get_device_capability()))}), "
             f"torch {torch.__version__}, rtkernels {getattr(rtkernels, '__version__', '?')}",
             f"- sanitizer: {version[-1] if version else sanitizer}",
             "- PYTORCH_NO_CUDA_MEMORY_CACHING=1; memcheck --padding 256; memcheck, racecheck and synccheck on "
             "rtk_ kernels only; --destroy-on-device-error kernel"
             + ("; initcheck --track-unused-memory" if args.track_unused else ""),
             f"- logs: {logs}", "", "## errors per group (driver) and tool", "",
             "| group | what | kernels | " + " | ".join(tools) + " |",
             "|---|---|---:|" + "---:|" * len(tools)]
    for g in groups:
        i = info[g]
        if i["skip"]:
            cells = [f"n/a ({i['skip']})"] * len(tools)
        elif i["rc"] != 0:
            cells = [f"driver failed without the sanitizer (rc {i['rc']})"] * len(tools)
        else:
            cells = [_cell(results.get((t, g))) for t in tools]
        lines.append(f"| {g} | {GROUPS[g][1]} | {len(i['kernels'])} | " + " | ".join(cells) + " |")
    # by source: which groups ran its kernels, and the errors attributed to them
    ran: dict[str, set] = {}
    base_source: dict[str, str] = {}
    for g in groups:
        for source, name in info[g]["kernels"]:
            ran.setdefault(source, set()).add(g)
            base_source[_base(name)] = source
    lines += ["", "## errors per kernel source and tool (attributed by the kernel named in each report)", "",
              "| source | groups | " + " | ".join(tools) + " |", "|---|---|" + "---:|" * len(tools)]
    other = {t: 0 for t in tools}
    for source in sources:
        cells = []
        for t in tools:
            if source not in ran:
                cells.append("not run")
                continue
            n = 0
            for g in ran[source]:
                res = results.get((t, g))
                if res is not None:
                    n += sum(c for k, c in res["by_kernel"].items() if base_source.get(k) == source)
            cells.append(str(n))
        lines.append(f"| {source} | {', '.join(sorted(ran.get(source, []))) or '—'} | " + " | ".join(cells) + " |")
    for (t, g), res in results.items():
        other[t] += sum(c for k, c in res["by_kernel"].items() if k not in base_source)
    lines.append("| (other kernels, e.g. torch's) | | " + " | ".join(str(other[t]) for t in tools) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
