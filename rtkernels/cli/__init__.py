"""The ``rtkernels`` command line (also ``python -m rtkernels``).

    rtkernels info      what rtkernels sees: GPUs, torch/CUDA, CuPy, NVRTC, sources, caches, tuning
    rtkernels demo      every method on one problem, checked against an fp64 reference, timed
    rtkernels check     GPU self-test: every method against the fp64 reference on odd shapes
    rtkernels autotune  tune method and kernel configs per shape bucket for this GPU
    rtkernels bench     the side-by-side benchmark vs the peers (the harness ships in the package)
    rtkernels compile   every kernel instance into the disk cache ahead of the first call

One module per subcommand (:mod:`.info`, :mod:`.demo`, :mod:`.check`, :mod:`.autotune`,
:mod:`.bench`, :mod:`.compile`), each with ``add_arguments(parser)`` and a function that runs it and returns the
exit status; :data:`COMMANDS` lists them. ``check``, ``autotune`` and ``bench`` need a CUDA GPU:
without one they print one sentence and exit with status 2. The environment helpers they share
(versions, GPU checks) are public names of :mod:`rtkernels.env`; nothing in rtkernels but
``__main__`` imports this package.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple, Optional, Sequence

from . import autotune, bench, check, compile, demo, info
from .common import PROG

__all__ = ["main", "build_parser", "COMMANDS", "Command"]


class Command(NamedTuple):
    """A subcommand: its one-line help, its description, how it adds its options, how it runs."""

    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Subcommands in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {
    "info": Command(
        "show GPUs, torch/CUDA, CuPy, NVRTC, the CUDA sources, the caches and what is tuned",
        "Print what rtkernels sees on this machine: GPU name(s) and compute capability, the CUDA "
        "driver and torch's CUDA build, CuPy and NVRTC versions, whether the CUDA kernels can run, "
        "where the CUDA sources are and their hash, CuPy's kernel cache (what is compiled), the "
        "autotune store and the shape buckets tuned for each GPU. Exit status 0, with or without a GPU.",
        info.add_arguments, info.run),
    "demo": Command(
        "run every method on one problem, check it against fp64 and time it",
        "Run every rtkernels method (and method='auto') on one random problem, check each against "
        "an fp64 reference and time it. Exit status 0 when all are within tolerance, 1 otherwise.",
        demo.add_arguments, lambda args: demo.main(args.rest)),
    "check": Command(
        "GPU self-test: every method against the fp64 reference on odd shapes",
        "Run every method (and method='auto') on a few odd shapes in bf16, fp16 and fp32 on the GPU and "
        "compare each with the fp64 reference; print a pass/fail table. Exit status 0 when all pass, 1 "
        "on any failure, 2 without a CUDA GPU.",
        check.add_arguments, check.run),
    "autotune": Command(
        "tune method='auto' and every kernel's tiles for this GPU, per shape bucket",
        "Time every candidate (each method; for kernel methods every config of its space that the GPU "
        "can run) on each shape, check each output against the fp64 torch path, and store the fastest "
        "per shape bucket for this GPU (see rtkernels info for where). Exit status 0 when every shape "
        "got a result, 1 otherwise, 2 without a CUDA GPU.",
        autotune.add_arguments, autotune.run),
    "bench": Command(
        "benchmark every method against the peers (fla, LeetDecoding, torch)",
        "Run the side-by-side benchmark of docs/benchmark.md: every "
        "rtkernels method and the peers that import, on the standard shapes; writes JSON, a Markdown "
        "table and a PNG plot. Peers that do not import are reported as such. Needs a CUDA GPU "
        "(exit status 2 without one) unless --quick, a CPU smoke run.",
        bench.add_arguments, bench.run),
    "compile": Command(
        "compile every kernel instance into the disk cache ahead of the first call",
        "Compile every CUDA kernel instance rtkernels can request on a GPU of one architecture (the "
        "current GPU's, or --arch: no GPU needed, e.g. in a container build) into the kernel cache, on "
        "all cores, so that no call pays the JIT compile. Instances already cached are kept. Exit status "
        "0 when every instance compiled, 1 when one failed, 2 without a compiler or an architecture.",
        compile.add_arguments, compile.run),
}


def build_parser() -> argparse.ArgumentParser:
    from ..env import VERSION as __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="rtkernels: exponentially decaying causal linear attention "
                    "(o_i = scale * sum_{j<=i} gamma_h^(i-j) (q_i . k_j) v_j).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, cmd in COMMANDS.items():
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
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
