"""What the subcommands share: the program name and the one-sentence exit without a GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from ..env import no_gpu_reason

__all__ = ["PROG", "require_gpu", "dir_summary", "writable"]

PROG = "rtkernels"


def require_gpu(command: str, what: str) -> Optional[int]:
    """None when a GPU is there; else print one sentence to stderr and return exit status 2."""
    reason = no_gpu_reason()
    if reason is None:
        return None
    print(f"{PROG} {command}: {what} needs a CUDA GPU, and {reason}.", file=sys.stderr)
    return 2


def dir_summary(path: Path) -> str:
    try:
        files = [p for p in path.rglob("*") if p.is_file()]
    except OSError as exc:
        return f"unreadable ({exc})"
    return f"{len(files)} files, {sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"


def writable(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return "writable" if os.access(probe, os.W_OK) else "NOT writable: tuning results stay in memory"
