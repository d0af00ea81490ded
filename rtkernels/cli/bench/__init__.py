"""``rtkernels bench``: the side-by-side benchmark of rtkernels against its peers (docs/benchmark.md).

The harness ships in the package (:mod:`.harness`, :mod:`.report`, :mod:`.peers`, :mod:`.timing`,
:mod:`.jit`); the peers (fla, LeetDecoding) are measured when they import and reported as missing,
with the reason, when they do not. ``python -m rtkernels.cli.bench.harness`` runs it too.
"""

from __future__ import annotations

import argparse

from ..common import require_gpu

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (:func:`.harness.add_arguments`)."""
    from . import harness

    harness.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with the arguments after ``bench``; without ``--quick`` (a CPU smoke run)
    it needs a CUDA GPU."""
    from . import harness

    if "--quick" not in args.rest:
        status = require_gpu("bench", "the benchmark (without --quick, which is a CPU smoke run)")
        if status is not None:
            return status
    return harness.main(args.rest)
