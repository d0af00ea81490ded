"""The autotune store's answers on the hot path: which method ``auto`` runs and each kernel
method's tuned config for a call's shape bucket (one dict lookup after a shape's first call), and
the candidate the tuner forces while it times one.

The method modules read this module only; the tuning loop and the GPU side live in
:mod:`.tuner` and :mod:`.cuda`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from .keys import bucket, device_fingerprint, dtype_name
from .space import Config, Problem, freeze
from .store import Store

if TYPE_CHECKING:
    from .tuner import TuneResult

__all__ = ["ENV_AUTOTUNE", "Selection", "selection", "tuned_config", "lookup", "record", "store_for_device",
           "use_store", "forced", "set_autotune_on_miss", "autotune_on_miss", "clear", "generation",
           "plan_state", "set_miss_tuner", "set_config_check"]

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
    def from_entry(cls, entry: dict, bucket_key: str = "") -> Optional["Selection"]:
        """The selection of a store entry, or None when its method or one of its configs is not
        one the library knows (checked by :func:`set_config_check`'s function; warned once)."""
        configs = entry.get("configs") or {}
        bad = None if isinstance(configs, dict) else f"configs {configs!r}"
        if bad is None and _config_check is not None:
            bad = _config_check(entry.get("method"), None) or next(
                (why for m, c in configs.items() if (why := _config_check(m, c))), None)
        if bad is not None:
            _warn_once(f"entry {bucket_key}", f"ignoring the autotune entry {bucket_key or '?'} ({bad}); "
                                              f"using the heuristics (rtkernels autotune rewrites it)")
            return None
        return cls(str(entry["method"]), {m: freeze(c) for m, c in configs.items()}, bucket_key)


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
            from ..jit import compiler_available

            if compiler_available():
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


#: ``(problem, device_index) -> TuneResult``: what tunes a bucket on a miss. The GPU side
#: (:mod:`.cuda`) installs it when it is imported; this module never imports it.
_miss_tuner: Optional[Callable[[Problem, int], Any]] = None


#: ``(method, config or None) -> why it is not valid, or None``: installed by the method registry
#: (this module never imports the methods); without it, entries are taken as they are.
_config_check: Optional[Callable[[Any, Optional[dict]], Optional[str]]] = None


def set_config_check(fn: Optional[Callable[[Any, Optional[dict]], Optional[str]]]) -> None:
    """Install what says whether a store entry's method name (config None) or a method's config
    is one the library can run; entries that fail are ignored with a warning."""
    global _config_check
    _config_check = fn
    clear(stores=False)


def set_miss_tuner(fn: Optional[Callable[[Problem, int], Any]]) -> None:
    """Install what tunes an untuned bucket when autotune-on-miss is on (see :mod:`.cuda`)."""
    global _miss_tuner
    _miss_tuner = fn


def _tune_on_miss(store: Store, device_index: int, problem: Problem) -> Optional[dict]:
    if _miss_tuner is None:
        return None
    _warn_once("on-miss", f"{ENV_AUTOTUNE}=1: tuning untuned shape buckets on first use "
                          f"(first: {problem.label()}); results go to {store.path}")
    return record(store, _miss_tuner(problem, device_index))


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


def record(store: Store, result: "TuneResult") -> Optional[dict]:
    """Put ``result`` into ``store`` under its bucket (nothing when no candidate passed); forget
    memoised selections. Returns the entry."""
    entry = result.entry()
    if entry is not None:
        p = result.problem
        store.put(bucket(p.dtype, p.bh, p.n, p.dk, p.dv), entry)
    clear(stores=False)
    return entry


