"""Wrong powers of gamma, caught in every kernel variant (marker ``gpu``).

A kernel that carries its state across a chunk boundary with gamma^(C+1) instead of gamma^C (or
across a segment boundary, or steps a token with gamma^2) still produces plausible numbers: at
gamma close to 1 the rows after each boundary are off by about 1 - gamma of their size, which a
global relative error averages away. These tests run every variant of every kernel -- the chunk
kernel's mma.sync and wgmma value tiles (64, 128) with two or three tile stages, tuned tile widths, the split-sequence strategy
with the dedicated states kernel and with the states-only pass + seg_scan, both float32 modes, the
kernel backward's three passes and the dlog(gamma) kernel at both tile widths, the scan, fleet
and block kernels -- at gamma in {0.9, 0.99} over shapes of several chunks and segments, and at
the edges {1e-6, 1}, against the fp64 masked product (tests/fp64_models.py), with the row error
of tests/tolerances.py. For each case they also build the fp64 *mutants* (the same operator with
the wrong powers: :func:`fp64_models.state_carry` and friends, each one plausible slip in one
place of the kernel: the state update's carry, the outputs' factor on the state, the key weights,
the carry between segments, the states pass's carry, the scan's step), measure them with the
test's own metrics (output row error, final-state error) and assert that one of them is at least
twice its tolerance (:func:`tolerances.assert_catches`), so each test proves it would fail on such
a kernel. The data have a positive mean (q . k > 0), so the
contributions that cross a boundary add up instead of cancelling, in the outputs and in
dlog(gamma).

Variants are forced through the library's own switches: :func:`rtkernels.methods.chunk.override`
(kernel, value tile, segments, states pass) and :func:`rtkernels.autotune.answers.forced` (a
config of a method's tune space, as the autotuner runs a candidate: tile widths the heuristic does
not pick, scan's T/NT, fleet's rank tile, block's BV).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Iterator, Optional

import pytest
import torch

import rtkernels
from rtkernels.autograd import backward_impl
from rtkernels.autotune import answers
from rtkernels.autotune.space import Limits, Problem, freeze
from rtkernels.methods import METHODS, chunk
from rtkernels.methods.chunk import decay_grad
from rtkernels.methods.chunk.backward import kernel_backward

import fp64_models as fm
from tolerances import (assert_catches, assert_close, assert_rows_close, close_ratio, decay_tolerance, row_error,
                        row_tolerance)

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
#: Tokens per chunk of the chunk kernels and of the dlog(gamma) kernel, per block of block.cu
#: (docs/design.md); the scan and fleet kernels step one token at a time.
CHUNK, BLOCK_C = 64, 32
CAUGHT = (0.9, 0.99)
EDGES = (1e-6, 1.0)
SCALE = 0.8


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel variant: the method, the chunk overrides and/or the forced tuned config that
    select it, the float32 mode, the dtypes it runs, and whether it needs compute capability 9.0."""

    method: str
    overrides: tuple = ()                 # (name, value) pairs for chunk.override
    config: Optional[tuple] = None        # a frozen config of the method's tune space
    precision: Optional[str] = None       # fp32_precision ("exact", "tf32"); None for 16-bit
    dtypes: tuple = (F16, BF16)
    hopper: bool = False

    @property
    def segments(self) -> int:
        return dict(self.overrides).get("segments") or dict(self.config or ()).get("segments") or 1

    @contextlib.contextmanager
    def forced(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.overrides:
                stack.enter_context(chunk.override(**dict(self.overrides)))
            if self.config is not None:
                stack.enter_context(answers.forced(self.method, self.config))
            yield

    def kind(self, dtype: torch.dtype):
        """The tolerance key: the dtype, or "tf32" for float32 in the TF32 mode."""
        return "tf32" if dtype == F32 and self.precision == "tf32" else dtype


def _v(method: str, *, config: Optional[dict] = None, precision: Optional[str] = None, dtypes=(F16, BF16),
       hopper: bool = False, **overrides) -> Variant:
    return Variant(method, tuple(sorted(overrides.items())), None if config is None else freeze(config),
                   precision, dtypes, hopper)


_F32 = (F32,)
_ALL = (F32, F16, BF16)
VARIANTS = {
    # 16-bit chunk kernel, one pass
    "chunk-mma": _v("chunk", wgmma=False, segments=1),
    "chunk-mma-bv32": _v("chunk", config={"wgmma": False, "bv": 32, "segments": 1}),
    "chunk-wgmma-bv64": _v("chunk", wgmma=True, bv=64, segments=1, hopper=True),
    "chunk-wgmma-bv128": _v("chunk", wgmma=True, bv=128, segments=1, hopper=True),
    "chunk-wgmma-bv64-stages3": _v("chunk", wgmma=True, bv=64, segments=1, stages=3, hopper=True),
    "chunk-wgmma-bv128-stages3": _v("chunk", wgmma=True, bv=128, segments=1, stages=3, hopper=True),
    # 16-bit split sequence: rtk_chunk_states + the folding pass, or states-only pass + seg_scan
    "chunk-mma-split3": _v("chunk", wgmma=False, segments=3),
    "chunk-mma-split3-segscan": _v("chunk", wgmma=False, segments=3, dedicated_states=False),
    "chunk-wgmma-bv128-split3": _v("chunk", wgmma=True, bv=128, segments=3, hopper=True),
    "chunk-wgmma-bv128-split3-stages3": _v("chunk", wgmma=True, bv=128, segments=3, stages=3, hopper=True),
    "chunk-wgmma-bv64-split7": _v("chunk", wgmma=True, bv=64, segments=7, hopper=True),
    # float32 kernel: both modes, both tile widths, one pass and split (states-only pass + seg_scan)
    "chunk-f32-exact": _v("chunk", segments=1, precision="exact", dtypes=_F32),
    "chunk-f32-tf32": _v("chunk", segments=1, precision="tf32", dtypes=_F32),
    "chunk-f32-exact-bv32": _v("chunk", config={"wgmma": False, "bv": 32, "segments": 1}, precision="exact",
                               dtypes=_F32),
    "chunk-f32-tf32-bv32": _v("chunk", config={"wgmma": False, "bv": 32, "segments": 1}, precision="tf32",
                              dtypes=_F32),
    "chunk-f32-exact-split3": _v("chunk", segments=3, precision="exact", dtypes=_F32),
    "chunk-f32-tf32-split3": _v("chunk", segments=3, precision="tf32", dtypes=_F32),
    # the other kernels
    "scan": _v("scan", dtypes=_ALL),
    "scan-t8-nt128": _v("scan", config={"t": 8, "nt": 128}, dtypes=_ALL),
    "fleet-tile32": _v("fleet", config={"rank_tile": 32}, dtypes=_ALL),
    "fleet-tile64": _v("fleet", config={"rank_tile": 64}, dtypes=_ALL),
    "block-bv32": _v("block", config={"bv": 32}, dtypes=_ALL),
    "block-bv64": _v("block", config={"bv": 64}, dtypes=_ALL),
}
#: (B, H, N, Dk, Dv, layout): 3 to 65 chunks and a short last one (2 to 8 tokens: the final state
#: then carries nearly every key across a boundary), KMAX 64 / 128 / 256, Dv over one and several
#: value tiles, both layouts, and more CTAs than an H100 has SMs (2 x 40 heads x 2 tiles: the 16-bit
#: mma kernel's MINB 2 instance). Split in 3 segments: 2 (200, 130 tokens) or 3 (1030, 644, 4100).
SHAPES = [(1, 2, 200, 64, 64, "bhnd"), (1, 2, 1030, 128, 96, "bnhd"), (1, 1, 4100, 64, 128, "bhnd"),
          (1, 2, 644, 200, 40, "bhnd"), (2, 40, 130, 64, 128, "bhnd")]


def _shape_id(s) -> str:
    return "x".join(map(str, s))


def _cases(variants: dict) -> list:
    return [pytest.param(name, dt, id=f"{name}-{str(dt).replace('torch.', '')}")
            for name, v in variants.items() for dt in v.dtypes]


def _require(variant: Variant) -> None:
    if variant.hopper and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")


def _claims(dtype: torch.dtype, gamma: float) -> bool:
    """Whether the test claims to catch wrong powers at this gamma: 0.9 and 0.99 in fp32 and fp16,
    0.9 in bf16 (at 0.99 an error of 1 - gamma is within bf16's own rounding)."""
    return gamma in CAUGHT and (dtype != BF16 or gamma == 0.9)


def _mutants(variant: Variant, n: int, gamma: float, kind, outputs_only: bool = False,
             device="cuda") -> dict[str, tuple]:
    """The wrong powers the test claims to catch in this variant at this gamma, each as (extra
    exponents of the outputs, of the final state) for :func:`fp64_models.masked` and
    :func:`fp64_models.final_state` (tests/fp64_models.py models each one).

    * One pass (the fused kernels; block.cu with its 32-token blocks): the outputs' factor on the
      state and the key weights (about 1 - gamma of every row after a boundary) and the state
      update's carry. The carry multiplies the state before the block's own keys are added, so it
      reaches the outputs only through keys two blocks back (weight gamma^(C+1): 1e-3 at 0.9) and
      the final state through every key before the last block: the tests' N leave a short last
      chunk, so the final state shows it at 0.9 too (``outputs_only``, the backward: claimed at
      0.99 only).
    * Scan and fleet: the token step.
    * Split sequence (the fused pass's code is claimed by the one-pass variants): the states pass's
      chunk carry reaches keys more than a chunk before a segment's end (gamma^65 or less): claimed
      at 0.99 over several segments (N >= 1000). The carry between segments reaches only keys a
      whole segment back (gamma^L, L >= 128 here): claimed in fp32 at 0.99 with at least three
      segments of at most 512 tokens; no 16-bit test can see it at gamma <= 0.99.
    """
    if variant.method in ("scan", "fleet"):
        return {"token step gamma^2": fm.token_step(n, device)}
    block = BLOCK_C if variant.method == "block" else CHUNK
    seg_len = fm.segment_length(n, variant.segments)
    nseg = -(-n // seg_len)
    if nseg == 1:
        out = {"output factor gamma^(t+2)": fm.output_factor(n, block, device),
               "key weight gamma^(len-s)": fm.key_weight(n, block, device)}
        if gamma == 0.99 or not outputs_only:
            out["state carry gamma^(len+1)"] = fm.state_carry(n, block, device)
        return out
    out = {}
    if gamma == 0.99 and n >= 1000:
        out["states-pass carry gamma^(C+1)"] = fm.states_pass_carry(n, seg_len, CHUNK, device)
    if kind == F32 and gamma == 0.99 and nseg >= 3 and seg_len <= 512:
        out["segment carry gamma^(len+1)"] = fm.segment_carry(n, seg_len, device)
    return out


def _inputs(b: int, h: int, n: int, dk: int, dv: int, dtype: torch.dtype, seed: int, grad_out: bool = False):
    """[B, H, N, D] q, k, v (and dL/do) on the GPU, rounded to ``dtype``: normal values plus 1, scaled
    by D^-1/2, so q . k and do . v are about 1 and positive (the terms across a boundary add up)
    and the fp16 gradients stay far from overflow at gamma = 1 (dq ~ N / sqrt(Dk))."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(d: int) -> torch.Tensor:
        return ((torch.randn(b, h, n, d, generator=g, device="cuda") + 1.0) * d ** -0.5).to(dtype)

    q, k, v = draw(dk), draw(dk), draw(dv)
    return (q, k, v, draw(dv)) if grad_out else (q, k, v)


def _in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The argument for ``layout`` from a [B, H, N, D] tensor (bnhd: the transposed view)."""
    return x if layout == "bhnd" else x.transpose(1, 2)


def _check_variant_config(variant: Variant, b: int, h: int, n: int, dk: int, dv: int, dtype: torch.dtype) -> None:
    """A forced config must be one the autotuner would accept for the problem (else the test would
    exercise a launch no user call makes)."""
    if variant.config is None:
        return
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    limits = Limits(sms=props.multi_processor_count, max_smem=props.shared_memory_per_block_optin,
                    cc=torch.cuda.get_device_capability(dev))
    name = {F16: "fp16", BF16: "bf16", F32: "fp32"}[dtype]
    why = METHODS[variant.method].kernel.tune_space.check(Problem(b, h, n, dk, dv, name), dict(variant.config), limits)
    assert why is None, f"forced config {dict(variant.config)} is not valid here: {why}"


def _record(record_property, key: str, rows: list) -> None:
    """The measured and mutant errors of a test, in the JUnit XML (``--junitxml``) for calibration."""
    record_property(key, json.dumps(rows))


# ----------------------------------------------------------------------------------- forward --- #

@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("name, dtype", _cases(VARIANTS))
def test_forward_catches_wrong_powers(name, dtype, shape, record_property):
    """Output (row error) and final state of the variant at gamma 0.9, 0.99, 1e-6 and 1 against
    the fp64 masked product; every claimed mutant of the variant is at least MUTANT_MARGIN
    tolerances away from the truth in the output's row error or the final state's error."""
    variant = VARIANTS[name]
    _require(variant)
    b, h, n, dk, dv, layout = shape
    _check_variant_config(variant, b, h, n, dk, dv, dtype)
    q, k, v = _inputs(b, h, n, dk, dv, dtype, seed=n + dk)
    assert METHODS[variant.method].uses_kernel(q, v), "the kernel must run, not a torch path"
    kind, tol = variant.kind(dtype), row_tolerance(variant.kind(dtype), n)
    log = []
    for gamma in (*CAUGHT, *EDGES):
        decay = torch.full((h,), gamma, device="cuda")
        gam = decay.double()  # the factor the kernel reads (fp32-rounded)
        with variant.forced():
            out, state = rtkernels.causal_linear_attention(
                *(_in_layout(x, layout) for x in (q, k, v)), decay, scale=SCALE, method=variant.method,
                layout=layout, return_state=True, fp32_precision=variant.precision)
        out = _in_layout(out, layout)
        ref = fm.masked(q, k, v, gam, SCALE)
        what = f"{name} {dtype} {shape} gamma={gamma}"
        entry = {"gamma": gamma, "err": row_error(out, ref), "tol": tol, "mutants": {}}
        log.append(entry)
        # the chunk kernels' state takes 16-bit (TF32) operands: the dtype's tolerance, else fp32's
        state_kind = (BF16 if kind == "tf32" else dtype) if variant.method == "chunk" else F32
        ref_state = fm.final_state(k, v, gam)
        if _claims(dtype, gamma):
            for mutant, (extra, to_end) in _mutants(variant, n, gamma, kind).items():
                ratios = {"output": row_error(fm.masked(q, k, v, gam, SCALE, extra), ref) / tol}
                if to_end is not None:
                    ratios["state"] = close_ratio(fm.final_state(k, v, gam, to_end), ref_state, state_kind, n)
                entry["mutants"][mutant] = ratios
                assert_catches(ratios, f"{what}: {mutant}")
        assert_rows_close(out, ref, kind, what, n)
        assert_close(state, ref_state, state_kind, f"{what} state", n=n)
    _record(record_property, "forward", log)


# ---------------------------------------------------------------------------------- backward --- #

BWD_VARIANTS = {name: VARIANTS[name] for name in (
    "chunk-mma", "chunk-wgmma-bv64", "chunk-wgmma-bv128", "chunk-mma-split3", "chunk-wgmma-bv128-split3",
    "chunk-f32-exact", "chunk-f32-tf32", "chunk-f32-exact-split3", "chunk-f32-tf32-split3")}
#: Several chunks and segments, KMAX 64 / 128 / 256, Dk != Dv, unaligned rows (37 values).
BWD_SHAPES = [(1, 2, 200, 64, 64, "bhnd"), (1, 2, 1030, 128, 96, "bnhd"), (1, 1, 4100, 64, 128, "bhnd"),
              (1, 2, 516, 200, 37, "bhnd")]


def _backward_mutants(variant: Variant, n: int, gamma: float, kind, device="cuda") -> dict[str, tuple]:
    """The claimed mutants (:func:`_mutants`, outputs only: the backward's loss has no state term)
    as exponents of the dq pass (token order) and of the dk and dv passes (reversed order: the same
    mutant counted from the end of the sequence)."""
    return {name: (extra, fm.in_reverse(extra))
            for name, (extra, _) in _mutants(variant, n, gamma, kind, outputs_only=True, device=device).items()}


def _dlog_claims(kind, gamma: float) -> bool:
    """Where a wrong carry of the dlog(gamma) recurrences is claimed (``kind``: the dtype, or "tf32"
    for float32 in that mode): fp16 at 0.99 (the 16-bit kernel), "tf32" likewise (the float32 kernel
    with one TF32 product), fp32 "exact" at 0.9 and 0.99 (the float32 kernel, 3xTF32). It changes the gradient by about
    (1 - gamma) times the weight of pairs two chunks apart: 1e-5 relative at 0.9, below bf16's and
    fp16's rounding."""
    return (kind == F32 and gamma in CAUGHT) or (kind in (F16, "tf32") and gamma == 0.99)


def _dlog_mutant(n: int, device="cuda") -> torch.Tensor:
    """The dlog(gamma) kernel's carry of S and W with gamma^(len+1): the derivative of a forward
    whose state carry has that power (the outputs' exponents of :func:`fp64_models.state_carry`)."""
    return fm.state_carry(n, CHUNK, device)[0]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative error over the heads."""
    return float(((x.double() - ref) / ref.abs().clamp(min=1e-300)).abs().max())


@pytest.mark.parametrize("shape", BWD_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("name, dtype", _cases(BWD_VARIANTS))
def test_backward_catches_wrong_powers(name, dtype, shape, record_property):
    """dq, dk, dv (row error) and d(decay) of the kernel backward (three forward-kernel passes, two
    reversed, and for 16-bit inputs the dlog(gamma) kernel) against the fp64 gradient, with the
    mutants of each pass (a wrong chunk or segment carry in token order for dq, in reversed order
    for dk and dv; a wrong carry of the dlog(gamma) recurrence) shown to be caught."""
    variant = VARIANTS[name]
    _require(variant)
    b, h, n, dk, dv, layout = shape
    q, k, v, g = _inputs(b, h, n, dk, dv, dtype, seed=7 * n + dk, grad_out=True)
    assert backward_impl(q, v) is kernel_backward, "the kernel backward must run"
    kind, tol = variant.kind(dtype), row_tolerance(variant.kind(dtype), n)
    dtol = decay_tolerance(kind, n)
    log = []
    for gamma in (*CAUGHT, *EDGES):
        decay = torch.full((h,), gamma, device="cuda", requires_grad=True)
        gam = decay.detach().double()
        leaves = [_in_layout(x, layout).detach().clone().requires_grad_(True) for x in (q, k, v)]
        with variant.forced():
            out = rtkernels.causal_linear_attention(*leaves, decay, scale=SCALE, method="chunk", layout=layout,
                                                    fp32_precision=variant.precision)
            (out.float() * _in_layout(g, layout).float()).sum().backward()
        got = [_in_layout(x.grad, layout) for x in leaves]
        want = fm.masked_grads(q, k, v, g, gam, SCALE)
        want_dlog = fm.masked_log_decay_grad(q, k, v, g, gam, SCALE)
        what = f"{name} {dtype} {shape} gamma={gamma}"
        entry = {"gamma": gamma, "err": {nm: row_error(x, r) for nm, x, r in zip("qkv", got, want)},
                 "tol": tol, "decay_err": _rel(decay.grad, want_dlog / gam), "decay_tol": dtol, "mutants": {}}
        log.append(entry)
        if _claims(dtype, gamma):
            for mutant, (fwd, rev) in _backward_mutants(variant, n, gamma, kind).items():
                wrong = fm.masked_grads(q, k, v, g, gam, SCALE, fwd, rev)
                ratios = {f"d{nm}": row_error(x, r) / tol for nm, x, r in zip("qkv", wrong, want)}
                entry["mutants"][mutant] = ratios
                # each pass runs the mutated kernel: dq's (token order) and dk's, dv's (reversed)
                assert_catches({"dq": ratios["dq"]}, f"{what}: dq, {mutant}")
                assert_catches({"dk": ratios["dk"], "dv": ratios["dv"]}, f"{what}: dk/dv, {mutant}")
        if _dlog_claims(kind, gamma):
            wrong_dlog = fm.masked_log_decay_grad(q, k, v, g, gam, SCALE, _dlog_mutant(n))
            entry["mutants"]["dlog state carry"] = ratio = _rel(wrong_dlog, want_dlog) / dtol
            assert_catches({"d(decay)": ratio}, f"{what}: d(decay), state carry gamma^(len+1)")
        for nm, x, r in zip("qkv", got, want):
            assert x.dtype == dtype, f"d{nm}: {x.dtype}"
            assert_rows_close(x, r, kind, f"{what} d{nm}", n)
        assert entry["decay_err"] <= dtol, f"{what} d(decay): relative error {entry['decay_err']:.3g} > {dtol:.3g}"
    _record(record_property, "backward", log)


# ---------------------------------------------------------------------------- dlog(gamma) --- #

@pytest.mark.parametrize("shape", BWD_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("tile", ("bv64", "bv32"))
@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=str)
def test_decay_gradient_kernel_tiles(dtype, tile, shape, monkeypatch, record_property):
    """The dlog(gamma) kernels (float32 in the "exact" mode, 16-bit) at both value-tile widths (it takes 32-wide tiles when 64-wide ones
    would leave SMs idle: forced here by the SM count it sees), against the fp64 dL/dlog(gamma),
    with a wrong carry of its S and W recurrences (gamma^(C+1)) shown to be caught."""
    b, h, n, dk, dv, layout = shape
    monkeypatch.setattr(decay_grad, "_sm_count", (lambda dev: 1 << 30) if tile == "bv32" else (lambda dev: 0))
    q, k, v, g = _inputs(b, h, n, dk, dv, dtype, seed=3 * n + dv, grad_out=True)
    tol = decay_tolerance(dtype, n)
    log = []
    for gamma in (*CAUGHT, *EDGES):
        decay = torch.full((h,), gamma, device="cuda", requires_grad=True)
        gam = decay.detach().double()
        out = rtkernels.causal_linear_attention(q, k, v, decay, scale=SCALE, method="chunk")
        (got,) = torch.autograd.grad((out.float() * g.float()).sum(), decay)
        want = fm.masked_log_decay_grad(q, k, v, g, gam, SCALE)
        what = f"dlog(gamma) {tile} {dtype} {shape} gamma={gamma}"
        entry = {"gamma": gamma, "err": _rel(got, want / gam), "tol": tol}
        log.append(entry)
        if _dlog_claims(dtype, gamma):
            wrong = fm.masked_log_decay_grad(q, k, v, g, gam, SCALE, _dlog_mutant(n))
            entry["mutant"] = ratio = _rel(wrong, want) / tol
            assert_catches({"d(decay)": ratio}, f"{what}: state carry gamma^(len+1)")
        assert entry["err"] <= tol, f"{what}: relative error {entry['err']:.3g} > {tol:.3g}"
    _record(record_property, "decay_grad", log)
