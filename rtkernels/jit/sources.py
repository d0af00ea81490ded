"""Locating and preparing the CUDA sources shipped with rtkernels.

The sources live in ``cuda_src/``: at the top of a source checkout (editable installs) and inside
the package as ``rtkernels/cuda_src`` in a built wheel; ``include/`` holds the headers by topic,
``chunk/`` the chunk method's kernels, one kernel per ``.cu`` file. Sources are named by their
path under ``cuda_src`` (``"scan.cu"``, ``"chunk/fwd16.cu"``). :func:`load_source` returns a
source with every ``#include "..."`` inlined once, each path resolved against the including
file's directory as a C compiler would (with ``#line`` markers, so NVRTC's messages still name
the original file and line). The compiled text therefore contains every header, and
any cache keyed on the text is keyed on the headers too.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
import re
from pathlib import Path

__all__ = ["source_dir", "list_sources", "load_source", "sources_hash"]

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


@functools.lru_cache(maxsize=1)
def source_dir() -> Path:
    """Directory holding the ``.cu`` and ``.cuh`` files (wheel layout first, then checkout)."""
    here = Path(__file__).resolve().parent.parent  # the rtkernels package directory
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "include" / "types.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"rtkernels cannot find its CUDA sources: looked for cuda_src/ in {here} and {here.parent}"
    )


def _files(suffixes: tuple[str, ...]) -> list[str]:
    root = source_dir()
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in suffixes)


def list_sources() -> list[str]:
    """Every kernel source (``*.cu``) as its path under ``cuda_src``, sorted."""
    return _files((".cu",))


def _inline(name: str, seen: set[str]) -> str:
    path = source_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {name!r} not found in {source_dir()}")
    text = path.read_text()
    out: list[str] = [f'#line 1 "{name}"\n']
    pos = 0
    for m in _INCLUDE.finditer(text):
        out.append(text[pos:m.start()])
        header = posixpath.normpath(posixpath.join(posixpath.dirname(name), m.group(1)))
        if header not in seen:
            seen.add(header)
            out.append(_inline(header, seen))
        line = text.count("\n", 0, m.end()) + 2  # the line after the #include
        out.append(f'\n#line {line} "{name}"')
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


@functools.lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """The text of ``cuda_src/<name>`` with its local headers inlined once each."""
    return _inline(name, {name})


@functools.lru_cache(maxsize=1)
def sources_hash() -> str:
    """sha256 over every shipped source and header (path and content), hex, 16 characters."""
    h = hashlib.sha256()
    root = source_dir()
    for name in _files((".cu", ".cuh")):
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]
