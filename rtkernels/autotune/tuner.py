"""The tuning loop, generic over candidates ``(method, config dict)``.

:func:`tune` runs every candidate of one problem through three injected functions:

* ``prepare(candidate)`` returns a zero-argument callable that computes the problem with that
  candidate (on a GPU: compiles the kernel instance and binds the inputs);
* ``validate(candidate, output)`` returns why the output is wrong, or None;
* ``timer(fn)`` returns the time of ``fn`` in ms (on a GPU: CUDA events, L2 flushed).

A pruned candidate is recorded as such and never run. A candidate whose compile, first call,
validation or timing fails is recorded with the error and skipped: only a candidate whose output
was checked can win. Nothing here needs a GPU, so the tests drive it with a fake timer.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from .space import Config, Problem, freeze

__all__ = ["Candidate", "Trial", "TuneResult", "tune", "STATUSES"]

#: Trial outcomes: ``ok`` (checked and timed), ``pruned`` (never run), ``compile-error``,
#: ``launch-error``, ``wrong`` (failed validation), ``timing-error``.
STATUSES = ("ok", "pruned", "compile-error", "launch-error", "wrong", "timing-error")


@dataclass(frozen=True)
class Candidate:
    """A method and a config of its kernel (``()``: the method as it runs without a tuned config,
    e.g. a torch path); ``default`` marks the config today's heuristic would choose."""

    method: str
    config: Config = ()
    default: bool = False

    @classmethod
    def of(cls, method: str, config: Optional[dict] = None, default: bool = False) -> "Candidate":
        return cls(method, freeze(config or {}), default)

    @property
    def params(self) -> dict:
        return dict(self.config)

    def label(self) -> str:
        text = " ".join(f"{k}={v}" for k, v in self.config)
        return self.method + (f" {text}" if text else "")


@dataclass
class Trial:
    candidate: Candidate
    status: str
    ms: Optional[float] = None
    error: Optional[str] = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"method": self.candidate.method, "config": self.candidate.params,
                             "status": self.status}
        if self.candidate.default:
            d["heuristic"] = True
        if self.ms is not None:
            d["ms"] = round(self.ms, 6)
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class TuneResult:
    """Every trial of one problem; ``best`` is the fastest ``ok`` trial (None when none passed)."""

    problem: Problem
    trials: list[Trial]
    heuristic_method: Optional[str] = None
    timer_note: str = ""
    tuned_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
                          .isoformat(timespec="seconds"))

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self.trials if t.status == "ok"]

    @property
    def best(self) -> Optional[Trial]:
        ok = self.ok
        return min(ok, key=lambda t: t.ms) if ok else None  # min keeps the first of equal times

    def best_per_method(self) -> dict[str, Trial]:
        out: dict[str, Trial] = {}
        for t in self.ok:
            cur = out.get(t.candidate.method)
            if cur is None or t.ms < cur.ms:
                out[t.candidate.method] = t
        return out

    def heuristic(self) -> Optional[Trial]:
        """The trial of what ``method="auto"`` runs without an entry (its method, default config)."""
        for t in self.trials:
            if t.candidate.method == self.heuristic_method and (t.candidate.default or not t.candidate.config):
                return t
        return None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.status] = out.get(t.status, 0) + 1
        return out

    def entry(self) -> Optional[dict]:
        """The store entry of this result, or None when no candidate passed."""
        best = self.best
        if best is None:
            return None
        p = self.problem
        h = self.heuristic()
        return {
            "method": best.candidate.method,
            "ms": round(best.ms, 6),
            "configs": {m: t.candidate.params for m, t in sorted(self.best_per_method().items())},
            "heuristic": {"method": self.heuristic_method,
                          "ms": None if h is None or h.ms is None else round(h.ms, 6)},
            "shape": {"B": p.b, "H": p.h, "N": p.n, "Dk": p.dk, "Dv": p.dv, "dtype": p.dtype},
            "tuned_at": self.tuned_at,
            "timer": self.timer_note,
            "counts": self.counts(),
            "trials": [t.to_json() for t in self.trials],
        }


def _err(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


def _is_compile_error(exc: BaseException) -> bool:
    from ..jit.compiler import KernelCompileError

    return isinstance(exc, KernelCompileError) or "CompileException" in type(exc).__name__


def tune(problem: Problem, candidates: Iterable[tuple[Candidate, Optional[str]]],
         prepare: Callable[[Candidate], Callable[[], Any]],
         timer: Callable[[Callable[[], Any]], float],
         validate: Callable[[Candidate, Any], Optional[str]],
         progress: Optional[Callable[[Trial], None]] = None,
         heuristic_method: Optional[str] = None, timer_note: str = "",
         slow_factor: Optional[float] = 10.0) -> TuneResult:
    """Run ``candidates`` (each with the reason it is pruned, or None) and return every trial.

    With ``slow_factor``, a method whose first timed candidate (its heuristic config: spaces list
    it first) is more than ``slow_factor`` times slower than the best so far has its other
    configs pruned: they are never compiled or run (this keeps e.g. the sequential scan on a
    million tokens from costing seconds per config)."""
    trials: list[Trial] = []
    best = float("inf")
    first_done: set[str] = set()
    slow: dict[str, str] = {}
    for cand, pruned in candidates:
        if not pruned and cand.method in slow:
            pruned = slow[cand.method]
        if pruned:
            trial = Trial(cand, "pruned", error=pruned)
        else:
            trial = _run_one(cand, prepare, timer, validate)
            if trial.status == "ok":
                if slow_factor and cand.method not in first_done and trial.ms > slow_factor * best:
                    slow[cand.method] = (f"{cand.method}'s first config took {trial.ms:.3g} ms, over "
                                         f"{slow_factor:g}x the best so far ({best:.3g} ms)")
                best = min(best, trial.ms)
            first_done.add(cand.method)
        trials.append(trial)
        if progress is not None:
            progress(trial)
    return TuneResult(problem, trials, heuristic_method, timer_note)


def _run_one(cand: Candidate, prepare, timer, validate) -> Trial:
    try:
        fn = prepare(cand)
    except Exception as exc:
        return Trial(cand, "compile-error" if _is_compile_error(exc) else "launch-error", error=_err(exc))
    try:
        out = fn()  # the first call: compiles what prepare did not, and is checked
    except Exception as exc:
        return Trial(cand, "compile-error" if _is_compile_error(exc) else "launch-error", error=_err(exc))
    try:
        why = validate(cand, out)
    except Exception as exc:
        why = _err(exc)
    del out
    if why:
        return Trial(cand, "wrong", error=str(why)[:400])
    try:
        ms = float(timer(fn))
    except Exception as exc:
        return Trial(cand, "timing-error", error=_err(exc))
    if not ms == ms or ms < 0:  # NaN or negative: not a time
        return Trial(cand, "timing-error", error=f"timer returned {ms}")
    return Trial(cand, "ok", ms=ms)
