"""Timing: CUDA events (``time.perf_counter`` on the CPU), graph replay, one kernel's time by the profiler,
L2 flush, peak memory, host overhead, limits."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

Fn = Callable[[], Any]


def sync(device: torch.device) -> None:
    """Wait until ``device`` is idle (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_s(fn: Fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def l2_bytes(device: torch.device) -> int:
    """The L2 cache size of ``device`` (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


#: Short calls repeat until their timed calls add up to this many seconds (at most :data:`MAX_REPS`
#: repetitions): twenty calls of 0.05 ms span a millisecond, and this host's speed moves over
#: longer spans than that, so a small shape's median moved by 80 % between two runs minutes apart.
TIMED_S = 0.1
MAX_REPS = 200


def time_call(fn: Fn, device: torch.device, reps: int, flush: Optional[torch.Tensor] = None,
              max_call_s: float = 2.0, extend: bool = False) -> dict[str, float]:
    """Median time of ``fn`` in ms over ``reps`` repetitions, after two warm-up calls; ``extend``:
    at least ``reps``, more for a short call (as many as take :data:`TIMED_S` seconds, up to
    :data:`MAX_REPS`).

    The first warm-up call (JIT compile, autotuning) is reported as ``first_call_ms``. Before each
    repetition ``flush`` (if given) is overwritten, evicting the inputs from L2, and the device is
    synchronised: the GPU is idle when the start event runs, so the events also cover the host's
    launch overhead. If the second warm-up call takes longer than ``max_call_s``, only 3 repetitions
    run (``reps`` in the result says how many ran).
    """
    return time_calls([fn], device, reps, flush, max_call_s, extend)[0]


def time_calls(fns: Sequence[Fn], device: torch.device, reps: int, flush: Optional[torch.Tensor] = None,
               max_call_s: float = 2.0, extend: bool = False) -> list[dict[str, float]]:
    """:func:`time_call` of each of ``fns``, their repetitions interleaved (a, b, a, b, ...), so that
    a ratio of their times is not skewed by the host's speed drifting between two runs (on a busy
    host it moves by tens of percent over seconds)."""
    firsts = [_wall_s(fn, device) for fn in fns]
    call_s = max(_wall_s(fn, device) for fn in fns)
    if call_s > max_call_s:
        reps = min(reps, 3)
    elif extend:
        reps = max(reps, min(MAX_REPS, int(TIMED_S / max(call_s, 1e-6))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            if flush is not None:
                flush.zero_()
            sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                ts.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
    return [{"ms": statistics.median(ts), "ms_min": min(ts), "reps": reps, "first_call_ms": first * 1e3}
            for ts, first in zip(times, firsts)]


def back_to_back_ms(fn: Fn, reps: int = 50, warmup: int = 3) -> float:
    """Mean time of ``fn`` in ms over ``reps`` calls issued back to back on the current CUDA stream
    (host time hidden behind the GPU: kernel time plus launch gaps), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graph_replay_ms(fn: Fn, reps: int, calls: int = 10) -> float:
    """The kernel time alone: ``calls`` calls of ``fn`` captured in one CUDA graph (after warm-up
    calls on a side stream, as capture needs), the graph replayed ``reps`` times; the median ms per
    call. No Python, no launch overhead, no L2 flush between the calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def kernel_us(fn: Fn, contains: str) -> float:
    """GPU time in µs of the kernels of one ``fn()`` call whose name contains ``contains``, by
    torch.profiler (one kernel's own time inside a call of several, e.g. the states pass's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum((e.time_range.end - e.time_range.start) for e in prof.events()
               if e.device_type.name == "CUDA" and contains in e.name)


def run_with_peak(fn: Fn, device: torch.device) -> tuple[Any, Optional[int]]:
    """Run ``fn`` once; return its result and the most bytes it had allocated on top of what was
    allocated before the call (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
    None on the CPU)."""
    if device.type != "cuda":
        return fn(), None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    sync(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def host_overhead(fn: Fn, device: torch.device, calls: int = 200) -> dict[str, float]:
    """µs per call of ``calls`` back-to-back calls: by CUDA events around the loop (GPU-side span)
    and by the wall clock between two ``torch.cuda.synchronize`` (what the caller waits). At a tiny
    shape both are the host's cost of one call."""
    fn()
    sync(device)
    res: dict[str, float] = {"calls": calls}
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        res["events_us_per_call"] = start.elapsed_time(end) * 1e3 / calls
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    res["wall_us_per_call"] = (time.perf_counter() - t0) * 1e6 / calls
    return res


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``, counting bytes read + written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_call(lambda: dst.copy_(src), device, reps=10)["ms"]
    return 2 * nbytes / (ms / 1e3)


def tensor_peak(device: torch.device, n: int) -> tuple[float, str]:
    """FLOP/s of an n×n×n matmul: bf16 on CUDA (tensor cores), fp32 on the CPU; and what ran."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_call(lambda: a @ b, device, reps=10)["ms"]
    return 2 * n ** 3 / (ms / 1e3), f"torch {str(dtype).replace('torch.', '')} matmul {n}^3"
