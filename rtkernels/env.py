"""The package version and the versions of what rtkernels runs on (for ``rtkernels info`` and the bench)."""

from __future__ import annotations

__all__ = ["VERSION"]

#: rtkernels' version (``rtkernels.__version__``).
VERSION = "0.1.0"
