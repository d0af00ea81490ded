"""Shared input generation for the CPU tests: layouts, decay forms, random q/k/v, hypothesis strategies.

Every tensor is drawn in float64 from a seeded ``torch.Generator`` and then rounded to the test
dtype, so the fp64 reference (tests/reference.py) sees exactly the values the library sees.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from hypothesis import strategies as st

import rtkernels

#: Every accepted ``method`` value, "auto" included.
METHOD_NAMES = tuple(rtkernels.METHOD_NAMES)
LAYOUTS = ("bhnd", "bnhd")
#: How the decay is passed: no decay, one shared float factor, per-head factors, one shared float
#: rate, per-head rates.
DECAY_FORMS = ("none", "decay_float", "decay_tensor", "rate_float", "rate_tensor")
#: Memory layouts of the inputs (the values are the same; only the strides differ).
MEMORY = ("contiguous", "transposed", "strided")

#: Sequence lengths that sit on or next to the block sizes of the torch paths (16, 32, 64) and primes.
SPECIAL_N = (1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 131, 257, 300)
SPECIAL_D = (1, 2, 3, 16, 31, 32, 33, 63, 64, 65, 79, 80)
GAMMA_MIN = 1e-6


def compute_state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the state the library returns for inputs of ``dtype`` (its docstring)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------- layouts

def layout_shape(b: int, h: int, n: int, d: int, layout: str) -> tuple[int, int, int, int]:
    return (b, h, n, d) if layout == "bhnd" else (b, n, h, d)


def seq_dim(layout: str) -> int:
    """The sequence axis of a 4-D tensor in ``layout``."""
    return 2 if layout == "bhnd" else 1


def seq_slice(x: torch.Tensor, start: int, stop: int, layout: str) -> torch.Tensor:
    return x.narrow(seq_dim(layout), start, stop - start)


def to_bhnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A [B, H, N, D] view of a tensor in ``layout``."""
    return x if layout == "bhnd" else x.transpose(1, 2)


# --------------------------------------------------------------------------------------- tensors

def randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    """Standard normal values times ``std``, drawn in float64 and rounded to ``dtype``."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def with_memory(x: torch.Tensor, memory: str) -> torch.Tensor:
    """The same values as ``x`` with other strides: ``transposed`` swaps the storage order of the
    two middle axes, ``strided`` gives the last axis a stride of 2."""
    if memory == "contiguous":
        return x.contiguous()
    if memory == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if memory == "strided":
        return torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]
    raise ValueError(memory)


def make_qkv(seed: int, b: int, h: int, n: int, dk: int, dv: int, dtype: torch.dtype,
             layout: str = "bhnd", memory: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k ~ randn / sqrt(Dk), v ~ randn, in ``layout``, already rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, layout_shape(b, h, n, dk, layout), dtype, 1 / math.sqrt(dk))
    k = randn(gen, layout_shape(b, h, n, dk, layout), dtype, 1 / math.sqrt(dk))
    v = randn(gen, layout_shape(b, h, n, dv, layout), dtype)
    return tuple(with_memory(x, memory) for x in (q, k, v))


def make_state(seed: int, b: int, h: int, dk: int, dv: int, dtype: torch.dtype) -> torch.Tensor:
    """A random [B, H, Dk, Dv] initial state of the size a state of that many tokens has."""
    return randn(torch.Generator().manual_seed(seed), (b, h, dk, dv), dtype, 1 / math.sqrt(dk))


def backward_inputs(seed: int, b: int, h: int, n: int, dk: int, dv: int, with_s0: bool, with_g: bool
                    ) -> tuple[torch.Tensor, ...]:
    """fp64 ``[B, H, N, D]`` q, k, v, dL/do, and the initial state and dL/d(final state) (or None):
    the arguments of a backward implementation."""
    q, k, v = make_qkv(seed, b, h, n, dk, dv, torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    g = randn(gen, (b, h, n, dv), torch.float64)
    s0 = make_state(seed + 2, b, h, dk, dv, torch.float64) if with_s0 else None
    g_state = randn(gen, (b, h, dk, dv), torch.float64) if with_g else None
    return q, k, v, g, s0, g_state


def decay_args(form: str, gammas: list[float], decay_dtype: torch.dtype = torch.float64
               ) -> tuple[dict[str, Any], torch.Tensor]:
    """(keyword arguments for ``causal_linear_attention``, the per-head factors [H] in float64 that
    the reference must use). The float forms share ``gammas[0]`` between all heads; the tensor
    forms are rounded to ``decay_dtype`` first and the reference gets the rounded values."""
    h = len(gammas)
    g = torch.tensor(gammas, dtype=torch.float64)
    if form == "none":
        return {}, torch.ones(h, dtype=torch.float64)
    if form == "decay_float":
        return {"decay": gammas[0]}, torch.full((h,), gammas[0], dtype=torch.float64)
    if form == "decay_tensor":
        t = g.to(decay_dtype)
        return {"decay": t}, t.to(torch.float64)
    if form == "rate_float":
        r = -math.log(gammas[0])
        return {"decay_rate": r}, torch.full((h,), math.exp(-r), dtype=torch.float64)
    if form == "rate_tensor":
        r = (-torch.log(g)).to(decay_dtype)
        return {"decay_rate": r}, torch.exp(-r.to(torch.float64))
    raise ValueError(form)


# ---------------------------------------------------------------------------------- strategies

def seq_lens(max_n: int = 300, min_n: int = 1) -> st.SearchStrategy[int]:
    special = [n for n in SPECIAL_N if min_n <= n <= max_n]
    return st.one_of(st.sampled_from(special), st.integers(min_n, max_n))


def head_dims(max_d: int = 80) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([d for d in SPECIAL_D if d <= max_d]), st.integers(1, max_d))


def gamma_values() -> st.SearchStrategy[float]:
    """Decay factors in [1e-6, 1]: the two ends exactly, log-uniform values, and values close to 1
    (1 - 10^u for u in [-6, -1]), where long sequences keep everything."""
    log_uniform = st.floats(math.log10(GAMMA_MIN), 0.0).map(lambda e: min(1.0, max(GAMMA_MIN, 10.0 ** e)))
    near_one = st.floats(-6.0, -1.0).map(lambda e: 1.0 - 10.0 ** e)
    return st.one_of(st.sampled_from([GAMMA_MIN, 1.0]), log_uniform, near_one)


@dataclass(frozen=True)
class Problem:
    """One drawn problem, everything but the dtype (tests parametrize or draw that separately)."""

    b: int
    h: int
    n: int
    dk: int
    dv: int
    layout: str = "bhnd"
    form: str = "decay_tensor"
    gammas: tuple[float, ...] = field(default=(0.9,))
    decay_dtype: torch.dtype = torch.float64
    scale: float = 1.0
    memory: str = "contiguous"
    seed: int = 0

    def __post_init__(self):
        assert len(self.gammas) == self.h, "one gamma per head"

    def build(self, dtype: torch.dtype) -> "Case":
        q, k, v = make_qkv(self.seed, self.b, self.h, self.n, self.dk, self.dv, dtype, self.layout, self.memory)
        kwargs, gamma = decay_args(self.form, list(self.gammas), self.decay_dtype)
        kwargs.update(layout=self.layout)
        if self.scale != 1.0:
            kwargs["scale"] = self.scale
        return Case(q, k, v, kwargs, gamma, self.scale, self.layout)


@dataclass
class Case:
    """Built inputs: call ``causal_linear_attention(q, k, v, **kwargs, method=...)``; the reference
    is ``reference(q, k, v, gamma, scale, layout)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict[str, Any]
    gamma: torch.Tensor
    scale: float
    layout: str


@st.composite
def problems(draw, max_n: int = 300, min_n: int = 1, max_b: int = 3, max_h: int = 3,
             max_d: int = 80) -> Problem:
    h = draw(st.integers(1, max_h))
    return Problem(
        b=draw(st.integers(1, max_b)),
        h=h,
        n=draw(seq_lens(max_n, min_n)),
        dk=draw(head_dims(max_d)),
        dv=draw(head_dims(max_d)),
        layout=draw(st.sampled_from(LAYOUTS)),
        form=draw(st.sampled_from(DECAY_FORMS)),
        gammas=tuple(draw(st.lists(gamma_values(), min_size=h, max_size=h))),
        decay_dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        scale=draw(st.one_of(st.just(1.0), st.floats(0.1, 3.0))),
        memory=draw(st.sampled_from(MEMORY)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------------------------- assertions

def check_output_format(out: Any, q: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """The output is a contiguous tensor in the input dtype, shaped [B, H, N, Dv] in ``layout``."""
    assert isinstance(out, torch.Tensor), f"output is a {type(out).__name__}, not a tensor"
    b, h, n, _ = to_bhnd(q, layout).shape
    dv = v.shape[-1]
    assert tuple(out.shape) == layout_shape(b, h, n, dv, layout), \
        f"output shape {tuple(out.shape)} for q {tuple(q.shape)}, v {tuple(v.shape)}, layout={layout!r}"
    assert out.dtype == q.dtype, f"output dtype {out.dtype} != input dtype {q.dtype}"
    assert out.device == q.device
    assert out.is_contiguous(), f"output strides {out.stride()} are not contiguous"


def check_state_format(state: Any, q: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    """The state is a [B, H, Dk, Dv] tensor, float64 for float64 inputs and float32 otherwise."""
    assert isinstance(state, torch.Tensor), f"state is a {type(state).__name__}, not a tensor"
    b, h, _, dk = to_bhnd(q, layout).shape
    assert tuple(state.shape) == (b, h, dk, v.shape[-1]), f"state shape {tuple(state.shape)}"
    assert state.dtype == compute_state_dtype(q.dtype), f"state dtype {state.dtype} for {q.dtype} inputs"


def state_tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """States are accumulated in float32 (float64 for float64 inputs) and not rounded to 16 bits."""
    return compute_state_dtype(dtype)


def assert_unchanged(copies: list[Optional[torch.Tensor]], tensors: list[Optional[torch.Tensor]],
                     what: str = "inputs") -> None:
    """Fail unless ``tensors`` still hold the values of their ``copies`` (taken before a call)."""
    for c, t in zip(copies, tensors):
        if t is not None:
            torch.testing.assert_close(t, c, rtol=0, atol=0, equal_nan=True, msg=f"the call modified its {what}")


def force_chunk(monkeypatch, **changes) -> None:
    """Force fields of the chunk kernel's plan (:class:`rtkernels.methods.chunk.Overrides`) for the
    rest of a test; monkeypatch restores the original object afterwards."""
    import dataclasses

    from rtkernels.methods.chunk import plan

    monkeypatch.setattr(plan, "overrides", dataclasses.replace(plan.overrides, **changes))


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside the block a host sync raises (torch.cuda.set_sync_debug_mode("error")); the GPU is
    synchronized first, so earlier work does not count."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def run_without_host_sync(step: Callable[[], object]) -> None:
    """``step()`` once (first-call work: compiles, plans, caches), then again under :func:`no_host_sync`."""
    step()
    with no_host_sync():
        step()
