"""Autotuning: per-GPU, per-shape-bucket choice of the method (``method="auto"``) and of every
kernel's template parameters and launch strategy.

Modules:

* :mod:`.space` -- ``Space``: a kernel method's declarative config space (each method module owns
  its ``TUNE_SPACE`` and a ``tuned_launch(config, ...)`` adapter); ``Problem``, ``Limits``.
* :mod:`.keys` -- the device fingerprint (rtkernels version, sources hash, GPU name, compute
  capability, SM count, NVRTC version) and the shape bucket (dtype, B*H, N, Dk, Dv rounded up to
  powers of two).
* :mod:`.store` -- the JSON results file per fingerprint under :func:`cache_dir` (atomic, merged
  under a lock, robust to corrupt / foreign / read-only files).
* :mod:`.tuner` -- the tuning loop over candidates ``(method, config)``, with an injectable
  timer and validator.
* :mod:`.cuda` -- the GPU side: candidates from the method modules, inputs, CUDA-event timing
  with an L2 flush, validation against the torch path.

The hot path (:func:`selection`, :func:`tuned_config`) is one dict lookup keyed by the exact call
shape; the first call of a shape resolves its bucket in the store (reading the file once per
process) and memoises the answer. A call never tunes unless asked: ``RTKERNELS_AUTOTUNE=1`` (or
:func:`set_autotune_on_miss`) makes the first call of an untuned bucket tune it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from .keys import bucket, device_fingerprint, dtype_name
from .space import Config, Limits, Problem, Space, freeze
from .store import ENV_CACHE_DIR, Store, cache_dir, store_dir
from .tuner import Candidate, Trial, TuneResult

__all__ = [
    "ENV_AUTOTUNE", "ENV_CACHE_DIR", "Selection", "Space", "Problem", "Limits", "Candidate", "Trial",
    "TuneResult", "Store", "Config", "freeze", "cache_dir", "store_dir", "bucket", "selection", "tuned_config", "lookup",
    "tune", "record", "store_for_device", "use_store", "forced", "set_autotune_on_miss",
    "autotune_on_miss", "clear", "generation", "plan_state",
]

#: Environment variable: ``1`` lets the first call of an untuned shape bucket tune it.
ENV_AUTOTUNE = "RTKERNELS_AUTOTUNE"


@dataclass(frozen=True)
class Selection:
    """What the store says for one shape bucket: the method ``auto`` runs and the tuned config of
    every kernel method that was tuned (frozen: sorted ``(name, value)`` pairs)."""

    method: str
    configs: dict  # method -> Config
    bucket: str = ""

    @classmethod
    def from_entry(cls, entry: dict, bucket_key: str = "") -> "Selection":
        configs = {m: freeze(c) for m, c in (entry.get("configs") or {}).items() if isinstance(c, dict)}
        return cls(str(entry["method"]), configs, bucket_key)


_MISS = object()
_MEMO_MAX = 4096
_selections: dict[tuple, Optional[Selection]] = {}
_stores: dict[int, Optional[Store]] = {}
_forced: Optional[dict[str, Config]] = None
_on_miss: Optional[bool] = None
_lock = threading.RLock()
_generation = 0  # bumped whenever an answer of selection() / tuned_config() may change


def generation() -> int:
    """A counter that changes whenever the store's answers to :func:`selection` and
    :func:`tuned_config` may change (store replaced or cleared, results recorded); a forced
    candidate is in :func:`plan_state`."""
    return _generation


def plan_state() -> tuple:
    """What a cached launch plan depends on in this module: :func:`generation` and the candidate
    forced by :func:`forced` (by value, so that timing one candidate call after call reuses its
    plan while a different candidate gets its own)."""
    return (_generation, None if _forced is None else tuple(sorted(_forced.items())))


def _bump() -> None:
    global _generation
    _generation += 1
_warned: set[str] = set()


# ------------------------------------------------------------------------------ hot path --- #


def selection(device_index: int, dtype: Any, bh: int, n: int, dk: int, dv: int) -> Optional[Selection]:
    """The store's :class:`Selection` for a call on CUDA device ``device_index`` with ``B*H = bh``
    and sizes ``n``, ``dk``, ``dv``, or None (no entry: the heuristics apply). One dict lookup
    after the first call of a shape."""
    sel = _selections.get((device_index, dtype, bh, n, dk, dv), _MISS)
    if sel is _MISS:
        sel = _resolve(device_index, dtype, bh, n, dk, dv)
    return sel  # type: ignore[return-value]


def tuned_config(method: str, device_index: int, dtype: Any, bh: int, n: int, dk: int,
                 dv: int) -> Optional[Config]:
    """The tuned config of ``method``'s kernel for this call (sorted ``(name, value)`` pairs), or
    None: the module's heuristic applies. While the tuner forces a candidate, that candidate's
    config."""
    if _forced is not None:
        return _forced.get(method)
    sel = _selections.get((device_index, dtype, bh, n, dk, dv), _MISS)
    if sel is _MISS:
        sel = _resolve(device_index, dtype, bh, n, dk, dv)
    return None if sel is None else sel.configs.get(method)  # type: ignore[union-attr]


@contextlib.contextmanager
def forced(method: str, config: Config) -> Iterator[None]:
    """Within the block, :func:`tuned_config` answers ``config`` for ``method`` (and None for the
    others): how the tuner runs one candidate through the ordinary call path."""
    global _forced
    prev, _forced = _forced, {method: config}
    try:
        yield
    finally:
        _forced = prev


# -------------------------------------------------------------------------- resolution --- #


def _warn_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"rtkernels: {text}", RuntimeWarning, stacklevel=4)


def set_autotune_on_miss(flag: Optional[bool]) -> None:
    """True: the first call of an untuned bucket tunes it; False: never; None: follow
    ``RTKERNELS_AUTOTUNE`` (the default)."""
    global _on_miss
    _on_miss = flag
    clear(stores=False)


def autotune_on_miss() -> bool:
    """Whether a call tunes its bucket when the store has no entry for it."""
    if _on_miss is not None:
        return _on_miss
    return os.environ.get(ENV_AUTOTUNE, "").strip().lower() in ("1", "true", "yes", "on")


def store_for_device(device_index: int) -> Optional[Store]:
    """The results store of CUDA device ``device_index`` (None without CuPy or a GPU); created,
    and its file read, once per process."""
    with _lock:
        if device_index in _stores:
            return _stores[device_index]
        store = None
        try:
            from ..jit import cupy_available

            if cupy_available():
                store = Store(device_fingerprint(device_index))
        except Exception as exc:
            _warn_once("store", f"the autotune store is unavailable ({type(exc).__name__}: {exc}); "
                                "using the heuristics")
        _stores[device_index] = store
        return store


def use_store(device_index: int, store: Optional[Store]) -> None:
    """Make ``store`` the store of ``device_index`` for this process (tests; a custom location)."""
    with _lock:
        _stores[device_index] = store
        _selections.clear()
        _bump()


def clear(stores: bool = True) -> None:
    """Forget the memoised selections (and, with ``stores``, the stores: files are re-read)."""
    with _lock:
        _selections.clear()
        _bump()
        if stores:
            _stores.clear()


def _resolve(device_index: int, dtype: Any, bh: int, n: int, dk: int, dv: int) -> Optional[Selection]:
    sel = None
    name = dtype_name(dtype)
    if name in ("bf16", "fp16", "fp32") and device_index is not None and device_index >= 0:
        try:
            store = store_for_device(device_index)
            if store is not None:
                key = bucket(name, bh, n, dk, dv)
                entry = store.get(key)
                if entry is None and autotune_on_miss() and _forced is None:
                    entry = _tune_on_miss(store, device_index, Problem(1, bh, n, dk, dv, name))
                if entry is not None:
                    sel = Selection.from_entry(entry, key)
        except Exception as exc:  # a user's call never fails because of the store
            _warn_once("resolve", f"autotune lookup failed ({type(exc).__name__}: {exc}); using the heuristics")
            sel = None
    with _lock:
        if len(_selections) >= _MEMO_MAX:
            _selections.clear()
        _selections[(device_index, dtype, bh, n, dk, dv)] = sel
    return sel


def _tune_on_miss(store: Store, device_index: int, problem: Problem) -> Optional[dict]:
    from . import cuda

    _warn_once("on-miss", f"{ENV_AUTOTUNE}=1: tuning untuned shape buckets on first use "
                          f"(first: {problem.label()}); results go to {store.path}")
    result = cuda.tune_problem(problem, device_index)
    return record(store, result)


# ----------------------------------------------------------------------------- public --- #


def lookup(q: Any, v: Any) -> Optional[dict]:
    """What the store says for a call with these ``[B, H, N, D]`` CUDA tensors: ``{"bucket",
    "method", "configs"}``, or None (no entry, or not a CUDA tensor)."""
    if not getattr(q, "is_cuda", False):
        return None
    b, h, n, dk = q.shape
    sel = selection(q.get_device(), q.dtype, b * h, n, dk, v.shape[-1])
    if sel is None:
        return None
    return {"bucket": sel.bucket, "method": sel.method, "configs": {m: dict(c) for m, c in sel.configs.items()}}


def record(store: Store, result: TuneResult) -> Optional[dict]:
    """Put ``result`` into ``store`` under its bucket (nothing when no candidate passed); forget
    memoised selections. Returns the entry."""
    entry = result.entry()
    if entry is not None:
        p = result.problem
        store.put(bucket(p.dtype, p.bh, p.n, p.dk, p.dv), entry)
    clear(stores=False)
    return entry


def tune(shapes: Sequence[Sequence[int]], dtypes: Sequence[str] = ("bf16",), methods: Optional[Sequence[str]] = None,
         device_index: int = 0, reps: int = 15, save: bool = True, progress: Any = None) -> list[TuneResult]:
    """Tune every ``(B, H, N, D)`` or ``(B, H, N, Dk, Dv)`` shape in every dtype (``"bf16"``,
    ``"fp16"``, ``"fp32"``) on CUDA device ``device_index`` over ``methods`` (default: all), and
    record the results in the device's store (unless ``save`` is False)."""
    from . import cuda

    store = store_for_device(device_index) if save else None
    if save and store is None:
        raise RuntimeError("autotuning needs a CUDA GPU and CuPy")
    results = []
    for shape in shapes:
        b, h, n, *d = shape
        dk, dv = (d[0], d[0]) if len(d) == 1 else d
        for dt in dtypes:
            res = cuda.tune_problem(Problem(b, h, n, dk, dv, dtype_name(dt)), device_index, methods=methods,
                                    reps=reps, progress=progress)
            if store is not None:
                record(store, res)
            results.append(res)
    return results
