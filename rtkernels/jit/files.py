"""Where rtkernels keeps files (compiled kernels, autotune results) and how it writes them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["ENV_CACHE_DIR", "cache_dir", "atomic_write"]

#: Environment variable that overrides the cache directory.
ENV_CACHE_DIR = "RTKERNELS_CACHE_DIR"


def cache_dir() -> Path:
    """rtkernels' cache directory: ``$RTKERNELS_CACHE_DIR``, else platformdirs' user cache dir."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rtkernels", appauthor=False))


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one: a
    temporary file in the same directory, flushed to disk, then ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
