"""rtkernels' own on-disk cache of compiled kernels (cubin, or PTX where the compiler does not know the GPU).

A cached kernel is found from the text that was compiled, so that a new process with a warm cache
loads it through the CUDA driver without importing CuPy (about 85 ms on an H200 host) or loading
NVRTC: the first call of a process costs the module load (about 15 ms).

Key: sha256 over the inlined source text (headers included), the template instance, the compile
options and the target architecture, and for a compiler other than NVRTC its tag (nvcc's format
and version: :func:`rtkernels.jit.compiler_nvcc.cache_tag`), so NVRTC's and nvcc's images never
mix while NVRTC's keys stay what they were. Files, under :func:`kernels_dir`
(``cache_dir()/"kernels"``, ``$RTKERNELS_CACHE_DIR`` overrides the root): ``<key>.bin`` (the
image) and ``<key>.json`` (``lowered`` name, ``kind`` "cubin" or "ptx", ``compiler`` "nvrtc" or
"nvcc" and its ``version`` (an NVRTC entry also as ``nvrtc``), ``arch``, the image's ``sha256``,
checked at every load: a truncated or garbage image is compiled again), both written
atomically (temporary file, then ``os.replace``), the JSON last, so a reader that finds the JSON
finds the whole image. ``nvrtc.json`` records the NVRTC version of the newest NVRTC compile: what
the kernels a warm process runs were compiled with, and what the autotune store's device
fingerprint names without loading NVRTC (nvcc compiles leave it alone). A directory that cannot
be written is warned about once and the kernels are kept in memory only (each process compiles
what it uses).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from .files import atomic_write, cache_dir

__all__ = ["kernels_dir", "cache_key", "load", "save", "recorded_nvrtc", "CachedKernel"]

_FORMAT = "rtkernels-kernel-cache-2"  # 2: the JSON records the image's sha256
_warned = False


def kernels_dir() -> Path:
    """Where compiled kernels are kept: ``cache_dir() / "kernels"``."""
    return cache_dir() / "kernels"


def cache_key(text: str, name_expression: str, options: Sequence[str], arch: str, compiler: str = "") -> str:
    """The cache key of one compile: 40 hex digits of sha256. ``compiler``: the tag of a compiler
    other than NVRTC (hashed only when given, so NVRTC's keys are those of earlier versions)."""
    h = hashlib.sha256()
    for part in (_FORMAT, text, name_expression, "\0".join(options), arch, *([compiler] if compiler else [])):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()[:40]


class CachedKernel:
    """A compiled image and what is needed to load it."""

    __slots__ = ("image", "lowered", "kind")

    def __init__(self, image: bytes, lowered: str, kind: str):
        self.image, self.lowered, self.kind = image, lowered, kind


def load(key: str) -> Optional[CachedKernel]:
    """The cached kernel of ``key``, or None (absent, or unreadable: then it is compiled again)."""
    d = kernels_dir()
    try:
        meta = json.loads((d / f"{key}.json").read_text())
        image = (d / f"{key}.bin").read_bytes()
        # a truncated or overwritten image (a crash, a disk error, two writers' halves) is a miss
        if meta.get("format") != _FORMAT or not image or meta.get("sha256") != hashlib.sha256(image).hexdigest():
            return None
        return CachedKernel(image, str(meta["lowered"]), str(meta.get("kind", "cubin")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(key: str, kernel: CachedKernel, nvrtc: Sequence[int], arch: str, compiler: str = "nvrtc") -> None:
    """Keep ``kernel`` under ``key``, compiled by ``compiler`` ("nvrtc" or "nvcc") of version
    ``nvrtc`` (and record an NVRTC version in ``nvrtc.json``); warn once if impossible."""
    global _warned
    d = kernels_dir()
    version = ".".join(str(x) for x in nvrtc)
    meta = {"format": _FORMAT, "lowered": kernel.lowered, "kind": kernel.kind, "compiler": compiler,
            "version": version, **({"nvrtc": version} if compiler == "nvrtc" else {}), "arch": arch,
            "sha256": hashlib.sha256(kernel.image).hexdigest()}
    try:
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / f"{key}.bin", kernel.image)
        atomic_write(d / f"{key}.json", json.dumps(meta, indent=1).encode())
        if compiler == "nvrtc":
            atomic_write(d / "nvrtc.json", json.dumps({"format": _FORMAT, "nvrtc": version}).encode())
    except OSError as exc:
        if not _warned:
            _warned = True
            warnings.warn(f"rtkernels: cannot write the kernel cache {d} ({exc}); compiled kernels are kept "
                          f"in memory only", RuntimeWarning, stacklevel=3)


def recorded_nvrtc() -> Optional[tuple[int, int]]:
    """The NVRTC version of the newest compile recorded in the cache, or None."""
    try:
        meta: Any = json.loads((kernels_dir() / "nvrtc.json").read_text())
        major, minor = (int(x) for x in str(meta["nvrtc"]).split(".")[:2])
        return major, minor
    except (OSError, ValueError, KeyError, TypeError):
        return None
