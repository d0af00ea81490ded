"""The per-device results store: one human-readable JSON file per device fingerprint.

Location: ``$RTKERNELS_CACHE_DIR/autotune/`` when that variable is set, else
``platformdirs.user_cache_dir("rtkernels")/autotune/``. The file is named by the fingerprint
(:func:`rtkernels.autotune.keys.file_stem`) and holds::

    {"format": "rtkernels-autotune/1",
     "fingerprint": {"rtkernels": ..., "sources": ..., "gpu": ..., "capability": ..., "sms": ..., "nvrtc": ...},
     "entries": {"<bucket>": {"method": ..., "configs": {...}, "ms": ..., "trials": [...], ...}, ...}}

Robustness:

* Writes are atomic (a temporary file in the same directory, then ``os.replace``), under an
  exclusive ``flock`` on ``<file>.lock`` where the platform has one; the file on disk is re-read
  under the lock and this process's entries are merged into it, so concurrent tuners all keep
  their results and the file is always valid JSON.
* A file that is not UTF-8, not valid JSON, or not this format, gives one warning, is ignored,
  and is rewritten at the next save. An entry whose method or configs the library does not know
  (a hand edit, an older version) is dropped with a warning when it is looked up
  (:mod:`.answers`), and the call uses the heuristics; a config that lacks only parameters its
  space added later (``Space.optional_params``) is used as it is. A file recorded for another
  fingerprint (another GPU, another source hash, ...) is not used.
* When the directory cannot be written, the store warns once and keeps its results in memory
  for the process.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

from ..jit.files import ENV_CACHE_DIR, atomic_write, cache_dir
from .keys import Fingerprint, file_stem

__all__ = ["FORMAT", "ENV_CACHE_DIR", "cache_dir", "store_dir", "Store"]

FORMAT = "rtkernels-autotune/1"
try:
    import fcntl
except ImportError:  # Windows: atomic replace only
    fcntl = None  # type: ignore[assignment]


def store_dir() -> Path:
    """Where the autotune results files live: ``cache_dir() / "autotune"``."""
    return cache_dir() / "autotune"


class Store:
    """The tuning results of one device fingerprint, on disk at :attr:`path` and in memory.

    ``get(bucket)`` and ``buckets()`` read memory only (the file is read once, at construction);
    ``put(bucket, entry)`` updates memory and saves (merging with whatever other processes wrote).
    """

    def __init__(self, fingerprint: Fingerprint, directory: Optional[Path] = None):
        self.fingerprint = dict(fingerprint)
        self.directory = Path(directory) if directory is not None else store_dir()
        self.path = self.directory / (file_stem(self.fingerprint) + ".json")
        self._lock = threading.Lock()
        self._mine: dict[str, dict] = {}   # entries put by this process (they win a merge)
        self.writable = True               # False after a failed save: results stay in memory
        self.warnings: list[str] = []
        self._entries = self._read()

    # ---------------------------------------------------------------------------------------- #
    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        warnings.warn(f"rtkernels: {text}", RuntimeWarning, stacklevel=3)

    def _read(self, quiet: bool = False) -> dict[str, dict]:
        """The entries of the file on disk (empty when it is missing, corrupt or foreign)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            if not quiet:
                self._warn(f"cannot read the autotune results {self.path} ({exc}); using heuristics")
            return {}
        try:
            data = json.loads(raw.decode("utf-8"))  # bad bytes: UnicodeDecodeError, a ValueError
            if not isinstance(data, dict) or data.get("format") != FORMAT or \
                    not isinstance(data.get("entries"), dict) or not isinstance(data.get("fingerprint"), dict):
                raise ValueError(f"not a {FORMAT} file")
            entries = {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("method"), str)}
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            if not quiet:
                self._warn(f"ignoring the corrupt autotune results file {self.path} "
                           f"({type(exc).__name__}: {str(exc)[:120]}); it will be rebuilt")
            return {}
        if data["fingerprint"] != self.fingerprint:
            if not quiet:
                self._warn(f"ignoring {self.path}: it was written for another device or source "
                           f"version ({data['fingerprint']}); it will be rebuilt")
            return {}
        return entries

    # ---------------------------------------------------------------------------------------- #
    def get(self, bucket: str) -> Optional[dict]:
        """The entry of ``bucket``, or None."""
        return self._entries.get(bucket)

    def buckets(self) -> dict[str, dict]:
        """Every entry, by bucket (a copy)."""
        return dict(self._entries)

    def put(self, bucket: str, entry: dict) -> bool:
        """Record ``entry`` for ``bucket`` and save; True when it reached the disk."""
        with self._lock:
            self._mine[bucket] = entry
            self._entries[bucket] = entry
            return self._save()

    def reload(self) -> None:
        """Re-read the file (entries put by this process win)."""
        with self._lock:
            self._entries = {**self._read(quiet=True), **self._mine}

    def _save(self) -> bool:
        if not self.writable:
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                if fcntl is not None:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                try:
                    merged = {**self._read(quiet=True), **self._mine}
                    self._write(merged)
                finally:
                    if fcntl is not None:
                        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        except OSError as exc:
            self.writable = False
            self._warn(f"cannot write the autotune results to {self.directory} ({exc}); results are kept "
                       f"in memory for this process (set {ENV_CACHE_DIR} to a writable directory)")
            return False
        self._entries = {**merged, **self._mine}
        return True

    def _write(self, entries: dict[str, dict]) -> None:
        data: dict[str, Any] = {"format": FORMAT, "fingerprint": self.fingerprint,
                                "entries": dict(sorted(entries.items()))}
        atomic_write(self.path, (json.dumps(data, indent=1, sort_keys=False) + "\n").encode("utf-8"))
