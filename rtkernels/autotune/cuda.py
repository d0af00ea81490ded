"""The GPU side of tuning: candidates from the method modules, inputs, timing, validation.

* :func:`candidates` -- for each method of the registry: the configs of its kernel's tune space
  (pruned by :class:`Limits`) when its CUDA kernel takes the problem, else one candidate, the
  method as it runs (a torch path; pruned when its memory would not fit).
* :func:`cuda_timer` -- median of CUDA-event times, the L2 cache flushed before each repetition
  when the inputs fit in it (docs/benchmark.md's protocol; the host's call overhead is included, as a
  user sees it).
* :func:`reference_validator` -- each output against the fp64 torch path of the registry's
  reference method on the same inputs (batch 0, as many heads as keep the reference small), with the tests' tolerances.
* :func:`tune_problem` -- all of it for one :class:`Problem`; :func:`tune` -- for many shapes,
  recorded in the device's store.

It reaches the methods only through :mod:`rtkernels.methods.registry` (imported where used, so
that the registry may import :mod:`.answers` while this package initialises). Importing this
module installs :func:`tune_problem` as the lookup's tuner for autotune-on-miss.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Optional, Sequence

from . import answers, tuner
from .keys import dtype_name
from .answers import record, store_for_device
from .space import Limits, Problem
from .tuner import Candidate, Trial, TuneResult

__all__ = ["device_limits", "heuristic_method", "candidates", "cuda_timer", "reference_validator",
           "tune_problem", "tune", "TOLERANCES", "FLUSH_BYTES"]

#: Relative Frobenius error allowed per dtype (tests/tolerances.py); fp32 grows like sqrt(N / 1024).
TOLERANCES = {"bf16": 1.2e-2, "fp16": 2e-3, "fp32": 2e-5}
FLUSH_BYTES = 256 << 20
#: Share of device memory a torch-path candidate may need before it is pruned.
MEMORY_SHARE = 0.25

#: Dynamic shared memory per CTA with the opt-in, by compute capability, where torch does not say.
_SMEM_OPTIN = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99, (9, 0): 227,
               (10, 0): 227, (12, 0): 99}


def device_limits(device_index: int) -> Limits:
    import torch

    p = torch.cuda.get_device_properties(device_index)
    optin = getattr(p, "shared_memory_per_block_optin", 0) or _SMEM_OPTIN.get((p.major, p.minor), 48) * 1024
    return Limits(sms=int(p.multi_processor_count), max_threads=1024, static_smem=48 * 1024,
                  max_smem=int(optin), memory=int(p.total_memory), cc=(int(p.major), int(p.minor)))


def _meta(problem: Problem) -> tuple[Any, Any]:
    import torch

    q = torch.empty(problem.b, problem.h, problem.n, problem.dk, dtype=problem.torch_dtype, device="meta")
    v = torch.empty(problem.b, problem.h, problem.n, problem.dv, dtype=problem.torch_dtype, device="meta")
    return q, v


def heuristic_method(problem: Problem) -> str:
    """What ``method="auto"`` runs on a CUDA device without a store entry (the registry's
    :func:`~rtkernels.methods.registry.heuristic_method`, asked with meta tensors)."""
    from ..methods.registry import Method, heuristic_method as pick

    return pick(*_meta(problem), runs_kernel=Method.kernel_takes)


def _torch_path_prune(method: "Any", p: Problem, limits: Limits) -> Optional[str]:
    """Why the torch path of ``method`` (a registry record) is not tried: too much memory, or a
    Python loop per token."""
    need = method.torch_bytes(p)
    if need > MEMORY_SHARE * limits.memory:
        return f"torch path needs about {need / 2**30:.1f} GiB"
    if method.torch_loops and p.n > 4096:
        return "torch path is a Python loop over the sequence"
    return None


def candidates(problem: Problem, limits: Limits, methods: Optional[Sequence[str]] = None
               ) -> list[tuple[Candidate, Optional[str]]]:
    """Every candidate for ``problem``, each with the reason it is pruned (None: it runs); the
    heuristic method's default config first."""
    from ..methods.registry import METHODS

    names = [m for m in METHODS if methods is None or m in methods]
    first = heuristic_method(problem)
    names.sort(key=lambda m: m != first)
    out: list[tuple[Candidate, Optional[str]]] = []
    for name in names:
        m = METHODS[name]
        space = None if m.kernel is None else m.kernel.tune_space
        if space is not None and m.kernel_takes(*_meta(problem)):
            for i, (config, why) in enumerate(space.configs(problem, limits)):
                out.append((Candidate.of(name, config, default=i == 0), why))
        else:
            out.append((Candidate.of(name, {}, default=True), _torch_path_prune(m, problem, limits)))
    return out


def cuda_timer(device_index: int, reps: int = 15, flush: Any = None, slow_ms: float = 50.0,
               hopeless: float = 5.0) -> Callable[[Callable[[], Any]], float]:
    """A timer: median of ``reps`` CUDA-event times in ms (3 when the first one exceeds ``slow_ms``;
    1 when it exceeds ``hopeless`` times the best median this timer has returned: it cannot win),
    ``flush`` (a byte tensor) overwritten before each repetition."""
    import torch

    best = [float("inf")]

    def timer(fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times: list[float] = []
        want = reps
        while len(times) < want:
            if flush is not None:
                flush.zero_()
            torch.cuda.synchronize(device_index)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if len(times) == 1 and times[0] > slow_ms:
                want = min(want, 3)
            if len(times) == 1 and times[0] > hopeless * best[0]:
                want = 1
        ms = statistics.median(times)
        best[0] = min(best[0], ms)
        return ms

    return timer


def make_inputs(problem: Problem, device_index: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """The inputs of docs/benchmark.md: q, k = randn / sqrt(Dk), v = randn, gamma spread over heads
    (1 - exp(linspace(log(1/32), log(1/512), H)), a float32 CPU tensor)."""
    import torch

    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(seed)
    p = problem
    q = torch.randn(p.b, p.h, p.n, p.dk, generator=gen, device=dev).div_(math.sqrt(p.dk)).to(p.torch_dtype)
    k = torch.randn(p.b, p.h, p.n, p.dk, generator=gen, device=dev).div_(math.sqrt(p.dk)).to(p.torch_dtype)
    v = torch.randn(p.b, p.h, p.n, p.dv, generator=gen, device=dev).to(p.torch_dtype)
    gamma = -torch.expm1(torch.linspace(math.log(1 / 32), math.log(1 / 512), p.h, dtype=torch.float64)).float()
    return q, k, v, gamma


def reference_validator(problem: Problem, q: Any, k: Any, v: Any, gamma: Any, max_tokens: int = 1 << 20
                        ) -> Callable[[Candidate, Any], Optional[str]]:
    """A validator: relative Frobenius error of batch 0 (the first heads, at most ``max_tokens``
    head-tokens) against the fp64 torch path of the registry's reference method, within
    :data:`TOLERANCES`."""
    import torch

    from ..methods.registry import REFERENCE_METHOD, run_method

    hs = max(1, min(problem.h, max_tokens // max(problem.n, 1)))
    tol = TOLERANCES[problem.dtype] * (max(1.0, (problem.n / 1024) ** 0.5) if problem.dtype == "fp32" else 1.0)
    ref: list[Any] = []

    def validate(cand: Candidate, out: Any) -> Optional[str]:
        if not ref:
            q64, k64, v64 = (t[:1, :hs].double() for t in (q, k, v))
            r = torch.empty(1, hs, problem.n, problem.dv, dtype=torch.float64, device=q.device)
            run_method(REFERENCE_METHOD, q64, k64, v64, _log_decay(gamma[:hs], q.device), 1.0, r, None, False)
            ref.append(r)
        r = ref[0]
        o = out[:1, :hs].double()
        if not bool(torch.isfinite(o).all()):
            return "non-finite output"
        err = float((o - r).norm() / r.norm())
        return None if err <= tol else f"relative error {err:.3g} > {tol:.3g}"

    return validate


def tune_problem(problem: Problem, device_index: int = 0, methods: Optional[Sequence[str]] = None,
                 reps: int = 15, progress: Optional[Callable[[Trial], None]] = None,
                 timer: Optional[Callable] = None, validate: Optional[Callable] = None) -> TuneResult:
    """Tune one problem on CUDA device ``device_index``: every candidate is compiled, run once,
    checked against the fp64 torch path, then timed; returns every trial. fp32 candidates run with
    ``fp32_precision="exact"`` (the store's buckets do not record the mode, and the tf32 mode would
    fail the fp32 tolerance)."""
    import torch

    from ..methods.registry import METHODS, run_method

    limits = device_limits(device_index)

    def run() -> TuneResult:  # its inputs and buffers are freed when it returns
        with torch.cuda.device(device_index):
            q, k, v, gamma = make_inputs(problem, device_index)
            in_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
            l2 = int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 50 << 20))
            flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=q.device) if in_bytes < 2 * l2 else None
            timing = timer or cuda_timer(device_index, reps, flush)
            checking = validate or reference_validator(problem, q, k, v, gamma)

            log_decay = _log_decay(gamma, q.device)

            def prepare(cand: Candidate) -> Callable[[], Any]:
                """A call of one candidate as the cached API call makes it: the kernel planned once
                (where the method plans) and repeated; fp32: the exact mode, which TOLERANCES checks."""
                method, m = cand.method, METHODS[cand.method]
                out = torch.empty(problem.b, problem.h, problem.n, problem.dv, dtype=q.dtype, device=q.device)
                launcher: list[Any] = []

                def call() -> Any:
                    with answers.forced(method, cand.config):
                        if m.kernel_prepare is not None and m.uses_kernel(q, v):
                            if not launcher:
                                launcher.append(m.kernel_prepare(q, k, v, log_decay, 1.0, out, False,
                                                                 fp32_precision="exact"))
                            launcher[0](q, k, v, out, None)
                        else:
                            run_method(method, q, k, v, log_decay, 1.0, out, None, False, fp32_precision="exact")
                    return out
                return call

            note = f"CUDA events, median of {reps} (3 above 50 ms), L2 " + \
                ("flushed" if flush is not None else "not flushed (inputs exceed 2x L2)")
            return tuner.tune(problem, candidates(problem, limits, methods), prepare, timing, checking, progress,
                              heuristic_method=heuristic_method(problem), timer_note=note)

    result = run()
    torch.cuda.empty_cache()
    return result


def tune(shapes: Sequence[Sequence[int]], dtypes: Sequence[str] = ("bf16",), methods: Optional[Sequence[str]] = None,
         device_index: int = 0, reps: int = 15, save: bool = True, progress: Any = None) -> list[TuneResult]:
    """Tune every ``(B, H, N, D)`` or ``(B, H, N, Dk, Dv)`` shape in every dtype (``"bf16"``,
    ``"fp16"``, ``"fp32"``) on CUDA device ``device_index`` over ``methods`` (default: all), and
    record the results in the device's store (unless ``save`` is False)."""
    store = store_for_device(device_index) if save else None
    if save and store is None:
        raise RuntimeError("autotuning needs a CUDA GPU and CuPy")
    results = []
    for shape in shapes:
        b, h, n, *d = shape
        dk, dv = (d[0], d[0]) if len(d) == 1 else d
        for dt in dtypes:
            res = tune_problem(Problem(b, h, n, dk, dv, dtype_name(dt)), device_index, methods=methods,
                                    reps=reps, progress=progress)
            if store is not None:
                record(store, res)
            results.append(res)
    return results


def _log_decay(gamma: Any, device: Any) -> Any:
    """The per-head log-decay of factors ``gamma`` (a CPU tensor), known on the host."""
    from ..decay import LogDecay

    return LogDecay(device, host=tuple(math.log(g) for g in gamma.double().tolist()))


answers.set_miss_tuner(lambda problem, device_index: tune_problem(problem, device_index))
