"""The ``rtkernels`` command line (also ``python -m rtkernels``).

    rtkernels info      what rtkernels sees: GPUs, torch/CUDA, CuPy, NVRTC, sources, caches, tuning
    rtkernels demo      every method on one problem, checked against an fp64 reference, timed
    rtkernels check     GPU self-test: every method against the fp64 reference on odd shapes
    rtkernels autotune  tune method and kernel configs per shape bucket for this GPU
    rtkernels bench     the side-by-side benchmark vs the peers (bench/ of the source checkout)

Each subcommand is one entry of ``_COMMANDS``: a help line, a function that adds its options to
its parser, and a function that runs it and returns the exit status. ``check``, ``autotune`` and
``bench`` need a CUDA GPU: without one they print one sentence and exit with status 2.

torch is imported only by the subcommand that needs it, so ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, NamedTuple, Optional, Sequence

__all__ = ["main", "build_parser", "cupy_version", "nvrtc_version_text", "kernel_cache_dir", "no_gpu_reason"]

PROG = "rtkernels"


# ----------------------------------------------------------------------- environment helpers -- #


def cupy_version() -> Optional[str]:
    """CuPy's version with its distribution name (e.g. ``"14.2.0 (cupy-cuda12x)"``), or None."""
    try:
        import cupy
    except Exception:
        return None
    text = str(cupy.__version__)
    try:
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get("cupy")
        if dists:
            text += f" ({', '.join(sorted(set(dists)))})"
    except Exception:
        pass
    return text


def nvrtc_version_text() -> str:
    """NVRTC's version as CuPy loads it (``"12.9"``), or why it is not available."""
    try:
        from .jit import nvrtc_version

        major, minor = nvrtc_version()
        return f"{major}.{minor}"
    except ImportError:
        return "not available (CuPy is not installed)"
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"


def kernel_cache_dir() -> tuple[Path, str]:
    """rtkernels' compiled-kernel cache directory and where that setting comes from."""
    from .autotune import ENV_CACHE_DIR
    from .jit.kernel_cache import kernels_dir

    origin = f"from {ENV_CACHE_DIR}" if os.environ.get(ENV_CACHE_DIR) else f"platformdirs; set {ENV_CACHE_DIR} to move it"
    return kernels_dir(), origin


def _cuda_version_text(v: int) -> str:
    """12040 -> "12.4" (the encoding of cudaDriverGetVersion / cudaRuntimeGetVersion)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _driver_version() -> str:
    """The CUDA driver version, from torch where it says so, else from CuPy; or "unknown"."""
    try:
        import torch

        get = getattr(torch._C, "_cuda_getDriverVersion", None)  # not public API: guarded
        if get is not None and torch.cuda.is_available():
            v = int(get())
            if v > 0:
                return f"{_cuda_version_text(v)} (from torch)"
    except Exception:
        pass
    try:
        import cupy

        v = int(cupy.cuda.runtime.driverGetVersion())
        if v > 0:
            return f"{_cuda_version_text(v)} (from CuPy)"
    except Exception:
        pass
    return "unknown (no CUDA driver found)"


def no_gpu_reason() -> Optional[str]:
    """Why the CUDA kernels cannot run here (no GPU visible to torch, or no CuPy with a driver), or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA GPU" + ("" if torch.version.cuda else " (this torch is a CPU-only build)")
    except Exception as exc:
        return f"torch cannot query CUDA ({type(exc).__name__})"
    from .jit import cupy_available

    if not cupy_available():
        return "CuPy with a CUDA driver is not available (pip install 'rtkernels[cuda12]' or 'rtkernels[cuda13]')"
    return None


def _require_gpu(command: str, what: str) -> Optional[int]:
    """None when a GPU is there; else print one sentence to stderr and return exit status 2."""
    reason = no_gpu_reason()
    if reason is None:
        return None
    print(f"{PROG} {command}: {what} needs a CUDA GPU, and {reason}.", file=sys.stderr)
    return 2


def _dir_summary(path: Path) -> str:
    try:
        files = [p for p in path.rglob("*") if p.is_file()]
    except OSError as exc:
        return f"unreadable ({exc})"
    return f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"


def _writable(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return "writable" if os.access(probe, os.W_OK) else "NOT writable: tuning results stay in memory"


# ----------------------------------------------------------------------------------- info --- #


def _add_info_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options yet


def _run_info(args: argparse.Namespace) -> int:
    del args
    import torch

    import rtkernels
    from rtkernels.jit import cupy_available, source_dir, sources_hash

    def line(key: str, value: str) -> None:
        print(f"{key:<19}{value}")

    line("rtkernels", f"{rtkernels.__version__} ({Path(rtkernels.__file__).parent})")
    line("python", f"{platform.python_version()} ({platform.system()} {platform.machine()})")
    line("torch", f"{torch.__version__} (built with CUDA {torch.version.cuda})" if torch.version.cuda
         else f"{torch.__version__} (CPU-only build)")
    line("CUDA driver", _driver_version())

    gpus: list[str] = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(f"cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, "
                            f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    except Exception as exc:  # a broken driver must not break `info`
        gpus.append(f"error while listing GPUs: {type(exc).__name__}: {exc}")
    for i, text in enumerate(gpus or ["no CUDA GPU"]):
        line("GPU" if i == 0 else "", text)

    cv = cupy_version()
    line("CuPy", cv or "not installed (pip install 'rtkernels[cuda12]' or 'rtkernels[cuda13]')")
    line("NVRTC", nvrtc_version_text())
    if cupy_available():
        line("CUDA kernels", "available")
    else:
        line("CUDA kernels", "not available: " + ("CuPy sees no CUDA driver or GPU" if cv
                                                  else "CuPy is not installed") + " (torch paths only)")

    try:
        src = source_dir()
        line("CUDA sources", f"{src} ({', '.join(p.name for p in sorted(src.iterdir()) if p.suffix in ('.cu', '.cuh'))})")
        line("sources hash", sources_hash())
    except FileNotFoundError as exc:
        line("CUDA sources", f"missing: {exc}")
    cache, origin = kernel_cache_dir()
    state = _dir_summary(cache) if cache.is_dir() else "not created yet"
    line("compiled kernels", f"{cache} ({origin}; {state})")

    from .autotune import ENV_AUTOTUNE, ENV_CACHE_DIR, Store, autotune_on_miss, store_dir
    from .autotune.keys import device_fingerprint

    sdir = store_dir()
    origin = f"from {ENV_CACHE_DIR}" if os.environ.get(ENV_CACHE_DIR) else f"platformdirs; set {ENV_CACHE_DIR} to move it"
    files = sorted(sdir.glob("*.json")) if sdir.is_dir() else []
    line("autotune store", f"{sdir} ({origin}; {_writable(sdir)}; {len(files)} results file(s))")
    line("tune on first use", f"{'on' if autotune_on_miss() else 'off'} ({ENV_AUTOTUNE}=1 turns it on)")
    if not gpus or not cupy_available():
        line("tuned", "no CUDA GPU with CuPy here: nothing to look up" + (
            f" (files for other devices: {', '.join(f.name for f in files)})" if files else ""))
        return 0
    for i in range(len(gpus)):
        try:
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                store = Store(device_fingerprint(i), sdir)
            entries = store.buckets()
            note = f" ({caught[0].message})" if caught else ""
            text = f"cuda:{i}: {len(entries)} shape bucket(s) in {store.path.name}{note}"
            line("tuned", text)
            for key, e in entries.items():
                cfg = e.get("configs", {}).get(e["method"], {})
                line("", f"  {key}: {e['method']} {' '.join(f'{k}={v}' for k, v in cfg.items())} "
                         f"{e.get('ms', float('nan')):.3f} ms")
        except Exception as exc:
            line("tuned", f"cuda:{i}: cannot read ({type(exc).__name__}: {exc})")
    return 0


# ----------------------------------------------------------------------------------- demo --- #


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import add_arguments

    add_arguments(parser)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args.rest)


# ---------------------------------------------------------------------------------- bench --- #


_BENCH_MISSING = ("bench/ lives in the source checkout of rtkernels, not in the installed package: run "
                  "python -m bench.run from the checkout's root (or rtkernels bench from an editable install).")


def _bench_module() -> Optional[ModuleType]:
    """``bench.run`` of the source checkout (``bench/`` beside the ``rtkernels`` package directory,
    with ``pyproject.toml``), imported with the checkout's root on ``sys.path``; None elsewhere."""
    root = Path(__file__).resolve().parent.parent
    if not ((root / "bench" / "run.py").is_file() and (root / "pyproject.toml").is_file()):
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module("bench.run")


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    try:  # a broken bench/ must not break the other subcommands; _run_bench shows the error
        module = _bench_module()
    except Exception:
        module = None
    if module is not None:
        module.add_arguments(parser)
    else:  # take any options, so that _run_bench can say where bench/ lives
        parser.description = f"{parser.description} {_BENCH_MISSING}"
        parser.parse_known_args = lambda args=None, namespace=None: (  # type: ignore[method-assign,assignment]
            namespace or argparse.Namespace(), [])


def _run_bench(args: argparse.Namespace) -> int:
    module = _bench_module()
    if module is None:
        print(f"{PROG} bench: {_BENCH_MISSING}", file=sys.stderr)
        return 2
    if "--quick" not in args.rest:  # --quick is the CPU smoke run
        status = _require_gpu("bench", "the benchmark (without --quick, which is a CPU smoke run)")
        if status is not None:
            return status
    return module.main(args.rest)


# -------------------------------------------------------------------------------- autotune --- #


def _add_autotune_arguments(parser: argparse.ArgumentParser) -> None:
    from .autotune.presets import PRESETS

    parser.add_argument("--preset", choices=list(PRESETS), default="standard",
                        help="named set of shapes and dtypes (default: standard, BENCHMARK.md's forward shapes)")
    parser.add_argument("--shapes", nargs="+", metavar="SHAPE",
                        help="shapes of the preset by name (standard: small mid long d64 huge) or explicit "
                             "BxHxNxD / BxHxNxDkxDv (default: all of the preset)")
    parser.add_argument("--dtype", "--dtypes", dest="dtype", nargs="+", choices=("bf16", "fp16", "fp32"),
                        help="dtypes (default: those each preset shape lists; bf16 for explicit shapes)")
    parser.add_argument("--methods", nargs="+", metavar="METHOD",
                        help="methods to consider (default: all; auto picks the fastest)")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per candidate (default 15)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")


def _autotune_problems(args: argparse.Namespace) -> list:
    from .autotune.presets import PRESETS, parse_shape
    from .autotune.space import Problem

    preset = PRESETS[args.preset]
    out = []
    for name in args.shapes or list(preset):
        if name in preset:
            shape, dtypes = preset[name]
        else:
            shape, dtypes = parse_shape(name), ("bf16",)
        for dt in args.dtype or dtypes:
            if args.dtype is None or dt in args.dtype:
                out.append(Problem(*shape, dt))
    return out


class _Progress:
    """A one-line progress bar on stderr (a line per problem when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = max(total, 1), 0, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""

    def step(self, trial) -> None:
        self.done += 1
        if self.tty:
            width = 30
            fill = int(width * self.done / self.total)
            text = f"{trial.candidate.label()}: {trial.status}" + (f" {trial.ms:.3f} ms" if trial.ms is not None else "")
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {self.label} "
                              f"{text[:60]:<60}")
            self.stream.flush()

    def problem(self, label: str) -> None:
        self.label = label
        if not self.tty:
            print(f"[{self.done}/{self.total}] {label}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _run_autotune(args: argparse.Namespace) -> int:
    status = _require_gpu("autotune", "autotuning")
    if status is not None:
        return status
    import time

    from . import METHODS
    from .autotune import bucket, cuda, record, store_for_device

    try:
        problems = _autotune_problems(args)
    except ValueError as exc:
        print(f"{PROG} autotune: {exc}", file=sys.stderr)
        return 2
    bad = [m for m in args.methods or () if m not in METHODS]
    if bad:
        print(f"{PROG} autotune: unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}.",
              file=sys.stderr)
        return 2
    store = store_for_device(args.device)
    if store is None:
        print(f"{PROG} autotune: the results store could not be opened (see the warning above).", file=sys.stderr)
        return 1
    limits = cuda.device_limits(args.device)
    total = sum(len(cuda.candidates(p, limits, args.methods)) for p in problems)
    print(f"autotune: {len(problems)} problem(s), {total} candidates; results: {store.path}", flush=True)
    bar = _Progress(total)
    t0 = time.perf_counter()
    rows = []
    for p in problems:
        bar.problem(p.label())
        res = cuda.tune_problem(p, args.device, methods=args.methods, reps=args.reps, progress=bar.step)
        record(store, res)
        rows.append((p, bucket(p.dtype, p.bh, p.n, p.dk, p.dv), res))
    bar.close()
    elapsed = time.perf_counter() - t0
    print(_autotune_table(rows))
    saved = "saved to " + str(store.path) if store.writable else "kept in memory only (the store is not writable)"
    print(f"autotune: {elapsed:.1f} s; results {saved}")
    return 0 if all(r.best is not None for _, _, r in rows) else 1


def _autotune_table(rows: list) -> str:
    head = ("shape", "bucket", "best", "config", "ms", "heuristic ms", "speed-up", "ok/pruned/failed")
    lines = [head]
    for p, key, res in rows:
        best, heur = res.best, res.heuristic()
        c = res.counts()
        failed = sum(v for k, v in c.items() if k not in ("ok", "pruned"))
        counts = f"{c.get('ok', 0)}/{c.get('pruned', 0)}/{failed}"
        if best is None:
            lines.append((p.label(), key, "NONE PASSED", "", "", "", "", counts))
            continue
        hms = heur.ms if heur is not None and heur.ms is not None else None
        cfg = " ".join(f"{k}={v}" for k, v in best.candidate.config) or "-"
        lines.append((p.label(), key, best.candidate.method, cfg, f"{best.ms:.4f}",
                      "-" if hms is None else f"{hms:.4f}", "-" if hms is None else f"{hms / best.ms:.2f}x", counts))
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    out = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# ----------------------------------------------------------------------------------- check --- #


#: (B, H, N, Dk, Dv): odd sizes, one token, the largest head, a sequence of several chunks.
CHECK_SHAPES = ((1, 3, 77, 40, 24), (2, 2, 130, 64, 96), (3, 2, 1, 128, 128), (1, 2, 333, 256, 32),
                (1, 2, 1000, 128, 128))


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", "--dtypes", dest="dtype", nargs="+", choices=("bf16", "fp16", "fp32"),
                        default=["bf16", "fp16", "fp32"], help="dtypes to check (default: all three)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")


def _run_check(args: argparse.Namespace) -> int:
    status = _require_gpu("check", "the GPU self-test")
    if status is not None:
        return status
    import math

    import torch

    from . import METHODS, causal_linear_attention as cla
    from .methods import auto_method
    from .demo import TOLERANCES

    dev = torch.device("cuda", args.device)
    names = [*METHODS, "auto"]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    lines = [("shape", "dtype", *names)]
    failures = 0
    for b, h, n, dk, dv in CHECK_SHAPES:
        gen = torch.Generator(device=dev).manual_seed(n)
        gamma = -torch.expm1(torch.linspace(math.log(1 / 32), math.log(1 / 512), h, dtype=torch.float64))
        for dt in args.dtype:
            dtype = dtypes[dt]
            q, k = (torch.randn(b, h, n, dk, generator=gen, device=dev).div_(math.sqrt(dk)).to(dtype) for _ in range(2))
            v = torch.randn(b, h, n, dv, generator=gen, device=dev).to(dtype)
            ref = cla(q.double(), k.double(), v.double(), gamma, method="vanilla")
            tol = TOLERANCES[str(dtype).replace("torch.", "")] * (max(1.0, (n / 1024) ** 0.5) if dt == "fp32" else 1.0)
            row = [f"{b}x{h}x{n}x{dk}x{dv}", dt]
            for m in names:
                try:
                    out = cla(q, k, v, gamma, method=m)
                    torch.cuda.synchronize(dev)
                    err = float((out.double() - ref).norm() / ref.norm())
                    ran = auto_method(q, v) if m == "auto" else m
                    path = "k" if METHODS[ran].uses_kernel(q, v) else "t"
                    ok = math.isfinite(err) and err <= tol
                    row.append(f"{'ok' if ok else 'FAIL'} {err:.0e} {path}")
                except Exception as exc:
                    ok = False
                    row.append(f"ERROR {type(exc).__name__}")
                failures += not ok
            lines.append(tuple(row))
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    print(f"rtkernels check on {torch.cuda.get_device_name(dev)}: relative error against the fp64 reference "
          "(k: CUDA kernel, t: torch path)")
    for i, r in enumerate(lines):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    total = (len(lines) - 1) * len(names)
    print(f"check: {total - failures}/{total} passed" + ("" if failures == 0 else f", {failures} FAILED"))
    return 1 if failures else 0


# ------------------------------------------------------------------------------- registry --- #


class _Command(NamedTuple):
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Subcommands in the order ``--help`` lists them.
_COMMANDS: dict[str, _Command] = {
    "info": _Command(
        "show GPUs, torch/CUDA, CuPy, NVRTC, the CUDA sources, the caches and what is tuned",
        "Print what rtkernels sees on this machine: GPU name(s) and compute capability, the CUDA "
        "driver and torch's CUDA build, CuPy and NVRTC versions, whether the CUDA kernels can run, "
        "where the CUDA sources are and their hash, CuPy's kernel cache (what is compiled), the "
        "autotune store and the shape buckets tuned for each GPU. Exit status 0, with or without a GPU.",
        _add_info_arguments, _run_info),
    "demo": _Command(
        "run every method on one problem, check it against fp64 and time it",
        "Run every rtkernels method (and method='auto') on one random problem, check each against "
        "an fp64 reference and time it. Exit status 0 when all are within tolerance, 1 otherwise.",
        _add_demo_arguments, _run_demo),
    "check": _Command(
        "GPU self-test: every method against the fp64 reference on odd shapes",
        "Run every method (and method='auto') on a few odd shapes in bf16, fp16 and fp32 on the GPU and "
        "compare each with the fp64 reference; print a pass/fail table. Exit status 0 when all pass, 1 "
        "on any failure, 2 without a CUDA GPU.",
        _add_check_arguments, _run_check),
    "autotune": _Command(
        "tune method='auto' and every kernel's tiles for this GPU, per shape bucket",
        "Time every candidate (each method; for kernel methods every config of its space that the GPU "
        "can run) on each shape, check each output against the fp64 torch path, and store the fastest "
        "per shape bucket for this GPU (see rtkernels info for where). Exit status 0 when every shape "
        "got a result, 1 otherwise, 2 without a CUDA GPU.",
        _add_autotune_arguments, _run_autotune),
    "bench": _Command(
        "benchmark every method against the peers (fla, LeetDecoding, torch); source checkout only",
        "Run the side-by-side benchmark of BENCHMARK.md (bench/run.py of the source checkout): every "
        "rtkernels method and the peers that import, on the standard shapes; writes JSON, a Markdown "
        "table and a PNG plot. Same as python -m bench.run from the checkout's root. Needs a CUDA GPU "
        "(exit status 2 without one) unless --quick, a CPU smoke run.",
        _add_bench_arguments, _run_bench),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="rtkernels: exponentially decaying causal linear attention "
                    "(o_i = scale * sum_{j<=i} gamma_h^(i-j) (q_i . k_j) v_j).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, cmd in _COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description)
        cmd.add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``rtkernels`` / ``python -m rtkernels``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # validates every subcommand's options and answers --help
    if args.command is None:
        parser.print_help()
        return 2
    # The arguments after the subcommand's name (the top level has only --help and --version,
    # which exit, so the first occurrence of the name is the subcommand).
    args.rest = argv[argv.index(args.command) + 1:]
    return _COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
