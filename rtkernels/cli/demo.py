"""``rtkernels demo``: run every method on one problem and check each against an fp64 reference.

For one random problem (RetNet-style per-head decays) the demo calls
:func:`rtkernels.causal_linear_attention` with every method in :data:`rtkernels.METHODS` and with
``method="auto"``, and prints, per method, the path it ran (CUDA kernel or torch), its relative
Frobenius error against ``method="vanilla"`` computed in float64 on the CPU from the same rounded
inputs, the time of its first call and the median time of the later calls, and ok/FAIL.
Exit status 0 when every method is within the tolerance of the dtype, 1 otherwise.

torch is imported only when the demo runs, so ``rtkernels --help`` stays quick.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["main", "run", "add_arguments", "build_parser", "DEFAULT_SHAPES", "DEFAULT_DTYPES", "TOLERANCES"]

#: Default problem (B, H, N, Dk, Dv) per device. The CPU one keeps the whole demo well under 20 s
#: on 2 cores (the torch path of ``scan`` is a loop over the N tokens).
DEFAULT_SHAPES = {"cpu": (2, 4, 1000, 64, 96), "cuda": (2, 8, 4096, 128, 128)}
#: Default input dtype per device.
DEFAULT_DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
#: Relative Frobenius error allowed per input dtype (the same numbers as tests/tolerances.py).
TOLERANCES = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.2e-2}
_DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "double": "float64", "float": "float32"}


def _dtype_name(text: str) -> str:
    name = _DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in TOLERANCES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}: choose float64, float32, float16 or bfloat16 "
            "(or fp64, fp32, fp16, bf16)")
    return name


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options to ``parser`` (used by :func:`build_parser` and ``rtkernels demo``)."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run: cuda when torch sees a GPU, else cpu (default: auto)")
    parser.add_argument("--dtype", type=_dtype_name, default=None, metavar="DTYPE",
                        help="input dtype: float64, float32, float16 or bfloat16 "
                             "(default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--shape", type=_positive_int, nargs=5, default=None,
                        metavar=("B", "H", "N", "DK", "DV"),
                        help="batch, heads, tokens, key and value dimension "
                             "(default: 2 4 1000 64 96 on cpu, 2 8 4096 128 128 on cuda)")
    parser.add_argument("--repeats", type=_positive_int, default=5,
                        help="timed calls per method after the first one; the median is shown "
                             "(default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    return parser


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run every rtkernels method (and method='auto') on one random problem, check "
                    "each against an fp64 reference and time it. Exit status 0 when all are "
                    "within tolerance, 1 otherwise.")
    return add_arguments(parser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the demo; ``argv`` defaults to ``sys.argv[1:]``."""
    args = build_parser().parse_args(argv)
    return run(args)


# --------------------------------------------------------------------------------------------- #


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _device_line(device: "torch.device") -> str:
    import torch

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{device} {p.name} (compute capability {p.major}.{p.minor}, "
                f"{p.multi_processor_count} SMs)")
    return f"cpu {_cpu_name()} ({torch.get_num_threads()} torch threads)"


def _timer(device: "torch.device") -> Callable[[Callable[[], Any]], tuple[float, Any]]:
    """A function that runs ``fn()`` once and returns (milliseconds, result)."""
    import torch

    if device.type == "cuda":
        def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), result
    else:
        def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
            t0 = time.perf_counter()
            result = fn()
            return (time.perf_counter() - t0) * 1e3, result
    return timed


def _relative_error(out: "torch.Tensor", ref: "torch.Tensor") -> float:
    import torch

    o = out.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(o).all()):
        return math.nan
    ref_norm = ref.norm().item()
    diff = (o - ref).norm().item()
    if ref_norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref_norm


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c]) for c in range(len(r))]
        lines.append(" | ".join(cells).rstrip())
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return lines


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed arguments (see :func:`add_arguments`); return the exit status."""
    import torch

    import rtkernels
    from rtkernels import METHODS, causal_linear_attention
    from rtkernels.methods import auto_method
    from rtkernels.jit import compiler_available

    from ..env import cupy_version, nvrtc_version_text

    if args.device == "auto":
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            print("rtkernels demo: --device cuda, but torch sees no CUDA GPU "
                  f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    kind = device.type
    dtype_name = args.dtype or DEFAULT_DTYPES[kind]
    dtype = getattr(torch, dtype_name)
    tol = TOLERANCES[dtype_name]
    b, h, n, dk, dv = args.shape or DEFAULT_SHAPES[kind]
    scale = dk ** -0.5

    kernels = compiler_available()
    if kernels and kind == "cuda":
        kernel_note = "yes"
    elif kernels:
        kernel_note = "yes (but the device is the CPU: the kernels are CUDA-only)"
    elif cupy_version() is None:
        kernel_note = ("no: CuPy is not installed (rtkernels[cuda12] or rtkernels[cuda13] installs "
                       "it); CUDA tensors run the torch paths")
    else:
        kernel_note = "no: CuPy sees no CUDA driver; CUDA tensors run the torch paths"

    print(f"rtkernels {rtkernels.__version__} demo:  o_i = scale * sum_{{j<=i}} gamma_h^(i-j) "
          "(q_i . k_j) v_j")
    print(f"  device        {_device_line(device)}")
    print(f"  torch         {torch.__version__}")
    print(f"  CuPy          {cupy_version() or 'not installed'}")
    print(f"  NVRTC         {nvrtc_version_text()}")
    print(f"  CUDA kernels  {kernel_note}")
    print(f"  problem       B={b} H={h} N={n} Dk={dk} Dv={dv}, {dtype_name}, layout 'bhnd', "
          f"scale = Dk^-0.5 = {scale:.4g}")

    # RetNet's per-head decays, as factors gamma (decay=...), in float64.
    gamma = 1.0 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h, dtype=torch.float64))
    shown = ", ".join(f"{g:.6g}" for g in gamma.tolist()[:4]) + (", ..." if h > 4 else "")
    print(f"  decay         gamma_h = 1 - exp(linspace(log(1/32), log(1/512), H)) = [{shown}]")

    gen = torch.Generator().manual_seed(args.seed)
    q_cpu, k_cpu, v_cpu = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float32).to(dtype)
                           for d in (dk, dk, dv))
    q, k, v = (x.to(device) for x in (q_cpu, k_cpu, v_cpu))

    # The fp64 reference, from the same rounded inputs, one (batch, head) at a time (bounded memory).
    t0 = time.perf_counter()
    q64, k64, v64 = (x.to(torch.float64) for x in (q_cpu, k_cpu, v_cpu))
    ref = torch.empty(b, h, n, dv, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            sl = (slice(bi, bi + 1), slice(hi, hi + 1))
            ref[sl] = causal_linear_attention(q64[sl], k64[sl], v64[sl], gamma[hi:hi + 1], scale=scale,
                                              method="vanilla")
    print(f"  reference     method='vanilla' in float64 on the CPU from the same {dtype_name} inputs "
          f"({(time.perf_counter() - t0):.1f} s)")
    print(f"  tolerance     relative Frobenius error ||o - ref|| / ||ref|| <= {tol:g} ({dtype_name})")
    print(f"  timing        first call alone, then the median of {args.repeats} "
          f"call{'s' if args.repeats > 1 else ''}"
          + (" (torch.cuda.Event, synchronized)" if kind == "cuda" else " (wall clock)"))
    print()

    timed = _timer(device)
    header = ("method", "path", "rel. error", "first call (ms)", "median (ms)", "status")
    rows: list[tuple[str, ...]] = [header]
    notes: list[str] = []
    failures = 0
    compiled: set[str] = set()
    with warnings.catch_warnings():
        # The kernel-availability warning says what the header line above already says.
        warnings.filterwarnings("ignore", message="rtkernels: CuPy", category=RuntimeWarning)
        for name in (*METHODS, "auto"):
            label = name
            try:
                picked = auto_method(q, v) if name == "auto" else name
                if name == "auto":
                    label = f"auto -> {picked}"
                path = "CUDA kernel" if METHODS[picked].uses_kernel(q, v) else "torch"

                def call() -> Any:
                    return causal_linear_attention(q, k, v, gamma, scale=scale, method=name)

                first_ms, out = timed(call)
                err = _relative_error(out, ref)
                del out
                times = [timed(call)[0] for _ in range(args.repeats)]
            except Exception as exc:  # report and go on with the other methods
                failures += 1
                rows.append((label, "-", "-", "-", "-", "FAIL"))
                first_line = (str(exc).strip().splitlines() or [""])[0]
                notes.append(f"{label}: raised {type(exc).__name__}: {first_line}")
                continue
            ok = math.isfinite(err) and err <= tol
            failures += not ok
            err_text = "non-finite" if math.isnan(err) else f"{err:.2e}"
            rows.append((label, path, err_text, f"{first_ms:.2f}", f"{statistics.median(times):.2f}",
                         "ok" if ok else "FAIL"))
            if path == "CUDA kernel" and picked not in compiled:
                compiled.add(picked)
                notes.append(f"{picked}: first call (JIT compile) {first_ms:.1f} ms, then "
                             f"{statistics.median(times):.3f} ms per call (CuPy's disk cache makes "
                             "the first call of a later process shorter)")

    for line in _table(rows, right={2, 3, 4}):
        print("  " + line)
    if notes:
        print()
        for line in notes:
            print("  " + line)
    print()
    total = len(rows) - 1
    if failures:
        print(f"{failures} of {total} FAIL")
        return 1
    print(f"all {total} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
