"""Config spaces: what each kernel method may be tuned over, declared by the method module itself.

A method module that wants tuning defines ``TUNE_SPACE = Space(...)`` (its template parameters and
launch strategies, e.g. ``{"bv": (32, 64), "minb": (1, 2), "segments": (1, 2, 4, 8)}``, plus a
function giving today's heuristic as a config and one saying why a config cannot run) and one
adapter, ``tuned_launch(config, ...)``, that turns a config dict into what its launch needs. The
tuner knows nothing else about the module: a candidate is ``(method, config dict)``.

This module imports neither torch nor CuPy, so method modules can import it freely.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

__all__ = ["Problem", "Limits", "Space", "Config", "freeze", "DTYPE_NAMES"]

#: Short dtype names used in bucket keys and on the command line.
DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp64")

#: A config in hashable form: sorted ``(name, value)`` pairs (``dict(config)`` gives the dict back).
Config = tuple


def freeze(config: Mapping[str, Any]) -> Config:
    """``{"bv": 64, "minb": 2}`` -> ``(("bv", 64), ("minb", 2))`` (hashable, order-independent)."""
    return tuple(sorted(config.items()))


@dataclass(frozen=True)
class Problem:
    """One problem size: ``[B, H, N, Dk]`` q and k, ``[B, H, N, Dv]`` v, of ``dtype`` (a short name:
    ``"bf16"``, ``"fp16"``, ``"fp32"``)."""

    b: int
    h: int
    n: int
    dk: int
    dv: int
    dtype: str

    @property
    def bh(self) -> int:
        return self.b * self.h

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp64": torch.float64}[self.dtype]

    def label(self) -> str:
        return f"{self.b}x{self.h}x{self.n}x{self.dk}" + (f"x{self.dv}" if self.dv != self.dk else "") + \
            f" {self.dtype}"


@dataclass(frozen=True)
class Limits:
    """What the GPU allows a launch: multiprocessors, threads per CTA, shared memory per CTA
    (static: 48 KiB; dynamic with the opt-in), device memory in bytes."""

    sms: int = 132
    max_threads: int = 1024
    static_smem: int = 48 * 1024
    max_smem: int = 227 * 1024
    memory: int = 80 << 30
    cc: tuple = (0, 0)  # compute capability (major, minor); (0, 0): unknown


def _no_check(problem: Problem, config: dict, limits: Limits) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Space:
    """The declarative config space of one kernel method.

    ``params``: parameter name -> the values to try (template parameters and strategies alike).
    ``default``: today's heuristic as a config (always a candidate, listed first).
    ``check``: the reason a config cannot run or is redundant for a problem (shared memory,
    threads, registers, a segment count the sequence cannot give, ...), or None when it is valid;
    such configs are pruned before anything is compiled.
    ``open_params``: parameters whose value may be any positive integer (the default may pick one
    the list does not hold, e.g. a segment count); the others take only the listed values.
    ``optional_params``: parameters added to the space after stores were written, which a stored
    config may lack; the method's adapter reads a missing one as the choice made before it was
    tuned (so an older store keeps working unchanged instead of being dropped).
    """

    params: Mapping[str, tuple]
    default: Callable[[Problem, Limits], dict]
    check: Callable[[Problem, dict, Limits], Optional[str]] = field(default=_no_check)
    open_params: tuple[str, ...] = ()
    optional_params: tuple[str, ...] = ()

    def invalid(self, config: Any) -> Optional[str]:
        """Why ``config`` (e.g. read from a store file) is not a config of this space, or None:
        the space's parameters (:attr:`optional_params` may be missing), each value of its
        parameter's type and among its values (a positive integer for :attr:`open_params`)."""
        required = set(self.params) - set(self.optional_params)
        if not isinstance(config, Mapping) or not required <= set(config) <= set(self.params):
            return f"config {config!r}: expected the keys {sorted(self.params)}"
        for key, value in config.items():
            allowed = self.params[key]
            if type(value) is not type(allowed[0]):
                return f"{key}={value!r}: expected a {type(allowed[0]).__name__}"
            if key in self.open_params:
                if value < 1:
                    return f"{key}={value!r}: expected a positive integer"
            elif value not in allowed:
                return f"{key}={value!r}: expected one of {list(allowed)}"
        return None

    def configs(self, problem: Problem, limits: Limits) -> list[tuple[dict, Optional[str]]]:
        """Every config of the space for ``problem``, the heuristic one first, each with the reason
        it is pruned (None: it runs). Duplicates are dropped."""
        default = self.default(problem, limits)
        names = list(self.params)
        out: list[tuple[dict, Optional[str]]] = []
        seen = set()
        for values in itertools.chain([tuple(default[k] for k in names)], itertools.product(*self.params.values())):
            config = dict(zip(names, values))
            key = freeze(config)
            if key in seen:
                continue
            seen.add(key)
            out.append((config, self.check(problem, config, limits)))
        return out
