"""The compiled entry of cached calls (``cuda_src/host/compiled_call.cpp``).

A cached call (:mod:`rtkernels.call_cache`) repeats a planned launch with new data pointers. In
Python its signature, the output's allocation and the launch are each a few crossings into torch's
C++ and cost about 20 µs of host time on a slow host, 28 µs with autograd history. The compiled
entry does the three in one crossing, in C++: the same signature (computed from the call's own
arguments by the one function that both registration and lookup use), ``at::empty``, and
``cuLaunchKernel`` on torch's current stream. A call with autograd history gets a C++ autograd
node whose backward runs the Python Function's own backward (:func:`node_backward`).

It serves CUDA calls whose plan is a fixed program of launches (:meth:`ChunkLaunch.program
<rtkernels.methods.chunk.launch.ChunkLaunch.program>`): torch tensors in, any decay form but a CPU
tensor (keyed by value in Python), float32 with ``fp32_precision`` given or following torch's
float32 matmul setting (read on every call, part of the signature), no forced autotune
candidate, the chunk overrides in force when it was loaded, strict decay checks off.
Everything else, and any call it has not seen, takes Python's path, which registers the call here
once it has passed every check.

Building: the first cached CUDA call starts a build in a background thread with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja; about 30 s, once per torch and
source version, kept under the cache directory); calls take Python's path until it is loaded.
One process builds a directory at a time (an ``flock``), and a build that died midway never
blocks the next one.
:func:`build` waits for it (``rtkernels compile`` and the GPU tests call it). ``RTKERNELS_COMPILED_CALL=0``
turns it off. Where the build fails, :func:`status` says why and calls stay on Python's path.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import sys
import threading
from typing import Any, Iterator, Optional

import torch

from . import autograd, call_cache, decay
from .autotune import answers
from .jit import driver, tensor_map
from .jit.files import cache_dir
from .jit.sources import source_dir
from .methods.chunk import plan

__all__ = ["ENV", "MISS", "module", "enabled", "build", "status", "offer", "clear", "size", "suspended", "SOURCE",
           "NodeInfo", "node_backward"]

#: Environment variable: ``0`` never builds or uses the compiled entry.
ENV = "RTKERNELS_COMPILED_CALL"
#: The source under ``cuda_src``.
SOURCE = "host/compiled_call.cpp"
#: What the compiled ``call`` returns for a call it does not know.
MISS = object()

#: The loaded extension once built (the API reads it on each call), else None.
module: Any = None
#: Bumped whenever the compiled entry forgets its calls: a cached call registered under an older
#: generation is offered again.
generation = 0

_lock = threading.Lock()
_built = threading.Event()  # set once a build has ended (loaded or failed)
_state = "idle"  # idle, building, ready, failed, off
_reason = ""


def enabled() -> bool:
    """Whether the compiled entry may be built and used (``RTKERNELS_COMPILED_CALL`` is not ``0``)."""
    return os.environ.get(ENV, "1") != "0"


def status() -> str:
    """``idle``, ``building``, ``ready``, ``off`` or ``failed: <why>``."""
    return f"failed: {_reason}" if _state == "failed" else _state


def _build_dir() -> str:
    src = (source_dir() / SOURCE).read_bytes()
    # (+ "flock": a directory of its own, never shared with a release that built without _one_builder)
    tag = hashlib.sha256(src + torch.__version__.encode() + repr(sys.version_info).encode() + b"flock").hexdigest()[:16]
    path = cache_dir() / "host" / tag
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@contextlib.contextmanager
def _one_builder(directory: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` for one build across processes. torch guards a
    build directory with a lock file that a process killed mid-build leaves behind (a script that
    exits while the background build runs), and every later build would wait on it forever; the
    kernel drops a ``flock`` with its holder, so under ours a torch lock file is always stale."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock alone
        yield
        return
    with open(os.path.join(directory, "rtk_build.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, "lock"))  # torch's, left by a builder that died
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load() -> None:
    global module, _state, _reason, generation
    try:
        from torch.utils import cpp_extension

        directory = _build_dir()
        with _one_builder(directory):
            ext = cpp_extension.load("rtk_compiled_call", [str(source_dir() / SOURCE)], extra_cflags=["-O2"],
                                     build_directory=directory, with_cuda=False, verbose=False)
        # no driver library (a CPU-only machine): loaded, but it registers nothing and misses every call
        ext.init(driver.launch_kernel_address() or 0, tensor_map.replace_address_function() or 0, node_backward,
                 answers, plan, decay, MISS)
    except Exception as exc:  # no compiler, no ninja, a compile error: Python's path serves every call
        with _lock:
            _state, _reason = "failed", f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        _built.set()
        return
    with _lock:
        generation += 1
        module, _state = ext, "ready"
    _built.set()


def build(wait: bool = True) -> bool:
    """Build and load the compiled entry (in this thread with ``wait``, else in a background thread
    if not yet started); True once it is loaded."""
    global _state
    with _lock:
        if _state == "idle" and not enabled():
            _state = "off"
        start = _state == "idle"
        if start:
            _state = "building"
    if start:
        if wait:
            _load()
        else:
            threading.Thread(target=_load, name="rtkernels-compiled-call", daemon=True).start()
    elif wait and _state == "building":
        _built.wait()
    return module is not None


def offer(args: tuple, hit: call_cache.CachedCall) -> None:
    """Register the cached call ``hit`` of arguments ``args`` (the 11 of
    :func:`~rtkernels.causal_linear_attention` after ``cu_seqlens`` is None) with the compiled entry,
    once per generation; the first offer starts the build in the background."""
    if hit.offered == generation:
        return
    hit.offered = generation  # (loading bumps the generation: every call is offered again then)
    if module is None:
        if _state == "idle":
            build(wait=False)
        return
    program = getattr(hit.launcher, "program", None)
    spec = program(hit.device_decay) if program is not None else None
    s0 = args[8]
    if spec is None or (s0 is not None and (s0.dtype != torch.float32 or not s0.is_contiguous())):
        return  # (the launcher converts such an initial state per call)
    temps, launches, keep, state_shape = spec
    info = None if hit.grad is None else NodeInfo(hit.grad, getattr(hit.launcher, "fold", None))
    module.register(args, (hit.device.index, hit.out_shape, torch.empty(0, dtype=hit.dtype), state_shape is not None,
                           state_shape or (), hit.device_decay, temps, launches, keep, hit.launcher, info))


def clear() -> None:
    """Forget every registered call (each is offered again on its next cached call)."""
    global generation
    with _lock:
        generation += 1
    if module is not None:
        module.clear()


def size() -> int:
    """How many calls the compiled entry holds."""
    return 0 if module is None else module.size()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within the block calls take Python's cached path (to compare the two; not thread-safe)."""
    global module
    kept, module = module, None
    try:
        yield
    finally:
        module = kept


class NodeInfo:
    """What the compiled entry's autograd node hands its backward besides the tensors: the cached
    call's :class:`~rtkernels.call_cache.GradCall` and the forward's split-sequence ``fold`` (or None)."""

    __slots__ = ("grad", "fold")

    def __init__(self, grad: call_cache.GradCall, fold: Optional[tuple]):
        self.grad, self.fold = grad, fold


class _NodeContext:
    """The part of a Python Function's ``ctx`` its backward reads, for the compiled node."""

    __slots__ = ("saved_tensors", "call", "needs_input_grad", "source_meta", "forward_states")


def node_backward(info: NodeInfo, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay_t: Optional[torch.Tensor],
                   s0: Optional[torch.Tensor], kept: Optional[torch.Tensor], needs: tuple,
                   grad_out: Optional[torch.Tensor], grad_state: Optional[torch.Tensor]) -> tuple:
    """The compiled node's backward: the Python Function's (:class:`~rtkernels.autograd.CausalLinearAttentionFunction`)
    on the node's saved tensors; ``(dq, dk, dv, d_decay_source, d_initial_state)``."""
    g = info.grad
    log_decay = g.log_decay(decay_t)
    ctx = _NodeContext()
    ctx.saved_tensors = (q, k, v, s0)
    ctx.call = autograd.Call(g.method, log_decay, g.scale, g.bnhd, g.return_state, g.fp32_precision)
    ctx.needs_input_grad = (False, *needs, False)
    src = log_decay.source
    ctx.source_meta = None if src is None else (src.device, src.dtype)
    ctx.forward_states = None if kept is None or info.fold is None else (kept, info.fold)
    return autograd.CausalLinearAttentionFunction.backward(ctx, grad_out, grad_state)[1:6]


call_cache.on_clear(clear)


@atexit.register
def _forget_at_exit() -> None:  # the entries hold Python objects: drop them while Python still runs
    if module is not None:
        module.clear()
