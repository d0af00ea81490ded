"""The ``rtkernels`` command line (also ``python -m rtkernels``).

    rtkernels info     what rtkernels sees: GPUs, torch/CUDA, CuPy, NVRTC, kernel sources, caches
    rtkernels demo     every method on one problem, checked against an fp64 reference, timed
    rtkernels bench    the side-by-side benchmark vs the peers (bench/ of the source checkout)

Each subcommand is one entry of ``_COMMANDS``: a help line, a function that adds its options to
its parser, and a function that runs it and returns the exit status. Later subcommands
(``autotune``, ``check``, ``bench``; DESIGN.md §2) are added the same way.

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

__all__ = ["main", "build_parser", "cupy_version", "nvrtc_version_text", "cupy_cache_dir"]

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
        from .runtime import nvrtc_version

        major, minor = nvrtc_version()
        return f"{major}.{minor}"
    except ImportError:
        return "not available (CuPy is not installed)"
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"


def cupy_cache_dir() -> tuple[Path, str]:
    """CuPy's kernel cache directory and where that setting comes from."""
    env = os.environ.get("CUPY_CACHE_DIR")
    if env:
        return Path(env).expanduser(), "from CUPY_CACHE_DIR"
    return Path("~/.cupy/kernel_cache").expanduser(), "CuPy's default; set CUPY_CACHE_DIR to move it"


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


# ----------------------------------------------------------------------------------- info --- #


def _add_info_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options yet


def _run_info(args: argparse.Namespace) -> int:
    del args
    import torch

    import rtkernels
    from rtkernels.runtime import cupy_available, source_dir, sources_hash

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
    cache, origin = cupy_cache_dir()
    state = "exists" if cache.is_dir() else "not created yet"
    line("CuPy kernel cache", f"{cache} ({origin}; {state})")
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
    return module.main(args.rest)


# ------------------------------------------------------------------------------- registry --- #


class _Command(NamedTuple):
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Subcommands in the order ``--help`` lists them. autotune and check go here later.
_COMMANDS: dict[str, _Command] = {
    "info": _Command(
        "show GPUs, torch/CUDA, CuPy, NVRTC, the CUDA sources and the kernel cache",
        "Print what rtkernels sees on this machine: GPU name(s) and compute capability, the CUDA "
        "driver and torch's CUDA build, CuPy and NVRTC versions, whether the CUDA kernels can run, "
        "where the CUDA sources are and their hash, and CuPy's kernel cache directory. "
        "Exit status 0, with or without a GPU.",
        _add_info_arguments, _run_info),
    "demo": _Command(
        "run every method on one problem, check it against fp64 and time it",
        "Run every rtkernels method (and method='auto') on one random problem, check each against "
        "an fp64 reference and time it. Exit status 0 when all are within tolerance, 1 otherwise.",
        _add_demo_arguments, _run_demo),
    "bench": _Command(
        "benchmark every method against the peers (fla, LeetDecoding, torch); source checkout only",
        "Run the side-by-side benchmark of BENCHMARK.md (bench/run.py of the source checkout): every "
        "rtkernels method and the peers that import, on the standard shapes; writes JSON, a Markdown "
        "table and a PNG plot. Same as python -m bench.run from the checkout's root.",
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
