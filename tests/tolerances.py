"""The one place where the test tolerances live.

Errors are measured against an fp64 reference computed from the *same* (already rounded) inputs,
so what remains is fp32 accumulation and the rounding of the output to the input dtype.
"""

from __future__ import annotations

import torch

#: Relative Frobenius error ||out - ref|| / ||ref|| allowed per input dtype.
REL_FRO = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
#: Largest absolute error allowed, relative to max |ref|.
REL_MAX = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
#: Sequences longer than this get fp32 tolerances grown by sqrt(N / LONG): an fp32 state summed
#: over N tokens carries a rounding error that grows like sqrt(N) (measured on the scan kernel:
#: 2.5e-5 at N = 4096, D = 128, gamma = 0.999999). 16-bit outputs are dominated by their own
#: rounding and keep their tolerance.
LONG = 1024


def _grow(dtype: torch.dtype, n: int) -> float:
    return max(1.0, (n / LONG) ** 0.5) if dtype == torch.float32 else 1.0


def close_ratio(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, n: int = 0) -> float:
    """How far :func:`assert_close` is from failing: the larger of the relative Frobenius error and
    the max error over max|ref|, each over its tolerance (above 1 fails; inf for a non-finite
    output)."""
    o = out.detach().to(ref.device, torch.float64)
    r = ref.detach().to(torch.float64)
    if not torch.isfinite(o).all():
        return float("inf")
    scale = float(r.abs().max())
    if scale == 0.0:
        return 0.0 if float(o.abs().max()) == 0.0 else float("inf")
    fro = float((o - r).norm() / r.norm()) / (REL_FRO[dtype] * _grow(dtype, n))
    mx = float((o - r).abs().max() / scale) / (REL_MAX[dtype] * _grow(dtype, n))
    return max(fro, mx)


def assert_close_to_magnitude(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                              what: str = "", n: int = 0) -> None:
    """Like :func:`assert_close`, with the errors measured against ``magnitude`` instead of ``ref``:
    the same computation on the absolute values of its inputs (every term of every sum counted
    positive), the scale that a floating-point sum's error is bounded by. For results that are
    sums of terms of both signs and may nearly cancel (a gradient summed over every token pair, a
    one-element dot product), where an error relative to the result itself says nothing about the
    arithmetic."""
    assert out.shape == ref.shape == magnitude.shape, f"{what}: shapes {tuple(out.shape)}, {tuple(ref.shape)}"
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    m = magnitude.detach().to("cpu", torch.float64).abs()
    assert torch.isfinite(o).all(), f"{what}: non-finite output where the reference is finite"
    if float(m.max()) == 0.0:
        assert float(o.abs().max()) == 0.0, f"{what}: reference is zero, output is not"
        return
    fro = float((o - r).norm() / m.norm())
    mx = float((o - r).abs().max() / m.max())
    tol_fro, tol_max = REL_FRO[dtype] * _grow(dtype, n), REL_MAX[dtype] * _grow(dtype, n)
    assert fro <= tol_fro, f"{what}: error {fro:.3g} of the magnitude > {tol_fro:.3g} ({dtype})"
    assert mx <= tol_max, f"{what}: max error {mx:.3g} of the magnitude > {tol_max:.3g} ({dtype})"


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "", n: int = 0) -> None:
    """Fail unless ``out`` matches the fp64 ``ref`` within the tolerances of ``dtype`` (for a
    sequence of ``n`` tokens; 0 when it does not matter)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    assert torch.isfinite(o).all(), f"{what}: non-finite output where the reference is finite"
    scale = r.abs().max().item()
    if scale == 0.0:
        assert o.abs().max().item() == 0.0, f"{what}: reference is zero, output is not"
        return
    fro = ((o - r).norm() / r.norm()).item()
    mx = ((o - r).abs().max() / scale).item()
    tol_fro, tol_max = REL_FRO[dtype] * _grow(dtype, n), REL_MAX[dtype] * _grow(dtype, n)
    assert fro <= tol_fro, f"{what}: relative error {fro:.3g} > {tol_fro:.3g} ({dtype})"
    assert mx <= tol_max, f"{what}: max error {mx:.3g} of max|ref| > {tol_max:.3g} ({dtype})"


# ----------------------------------------------------------------------------------- row errors
# The global errors above average over the whole output: an error confined to the rows after a
# chunk or segment boundary (a wrong power of gamma in a carry) is diluted by every other row.
# The row error is the largest error of one row, relative to the typical row of its (batch, head):
# a carry that is off by one factor gamma changes the first rows after the boundary by about
# (1 - gamma) of their size, however long the sequence.

#: Largest :func:`row_error` allowed per input dtype; ``"tf32"``: float32 inputs in the chunk
#: kernel's TF32 mode (10-bit operands). float32 grows like the global tolerance (sqrt(N / LONG)).
#: About twice the largest row error measured over tests/test_gpu_variants_gamma.py on an H100
#: (2026-11-24; every kernel variant, forward and backward, N <= 4100): fp32 1.0e-5, TF32 8.9e-4,
#: fp16 8.2e-4, bf16 6.5e-3.
ROW_REL = {torch.float64: 1e-10, torch.float32: 3e-5, "tf32": 2e-3, torch.float16: 1.5e-3, torch.bfloat16: 1.25e-2}
#: Relative error allowed for d(decay) when the inputs have a positive mean, so that no term of
#: dlog(gamma) cancels another (the tests of wrong powers): measured below 6e-6 (fp16, the
#: dlog(gamma) kernel) and 2e-7 (fp32, then the torch formula, now the float32 kernel's 3xTF32) on
#: the same run; float32 grows like the global tolerance. "tf32": float32 in that mode, the float32
#: kernel with one TF32 product (fp16's 10-bit significand, fp16's tolerance).
DECAY_REL = {torch.float32: 2e-5, "tf32": 1e-4, torch.float16: 1e-4, torch.bfloat16: 3e-3}
#: A test that claims to catch a mutant (a wrong power of gamma) needs the mutant's fp64 output at
#: least this many tolerances away from the truth: the kernel's own error is below one tolerance,
#: so a kernel with the mutant's powers is then more than (MUTANT_MARGIN - 1) tolerances away
#: (triangle inequality) and fails.
MUTANT_MARGIN = 2.0


def decay_tolerance(kind, n: int = 0) -> float:
    """:data:`DECAY_REL` for ``kind`` (a dtype or ``"tf32"``) over ``n`` tokens."""
    return DECAY_REL[kind] * _grow(kind, n)


def row_tolerance(kind, n: int = 0) -> float:
    """The :func:`row_error` allowed for ``kind`` (a dtype or ``"tf32"``) over ``n`` tokens."""
    return ROW_REL[kind] * (_grow(kind, n) if isinstance(kind, torch.dtype) else 1.0)


def row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows of ||out_row - ref_row|| / rms(||ref_row||) for ``[..., N, D]`` tensors, the rms
    taken over the N rows of the same leading index (a (batch, head)); 0 for matching zeros, inf
    for a non-finite output where the reference is finite. Computed on the device of ``ref``."""
    o = out.detach().to(ref.device, torch.float64)
    r = ref.detach().to(torch.float64)
    if not torch.isfinite(o).all():
        return float("inf")
    err = (o - r).norm(dim=-1)                                  # [..., N]
    typical = r.norm(dim=-1).pow(2).mean(dim=-1, keepdim=True).sqrt()
    floor = r.norm(dim=-1).pow(2).mean().sqrt() * 1e-6          # an all-zero (batch, head) slice
    return float((err / torch.maximum(typical, floor).clamp(min=1e-300)).max())


def assert_rows_close(out: torch.Tensor, ref: torch.Tensor, kind, what: str = "", n: int = 0) -> float:
    """Fail unless :func:`row_error` is within :func:`row_tolerance`; returns the error."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err, tol = row_error(out, ref), row_tolerance(kind, n)
    assert err <= tol, f"{what}: row error {err:.3g} > {tol:.3g} ({kind})"
    return err


def assert_catches(ratios: dict, what: str = "") -> None:
    """Fail unless a test is sure to fail on a kernel whose exact answer would be the mutant's:
    ``ratios`` maps each check of the test (output, state, ...) to the fp64 mutant's error in that
    check's metric over its tolerance; one of them must reach :data:`MUTANT_MARGIN`."""
    assert max(ratios.values()) >= MUTANT_MARGIN, (
        f"{what}: the test cannot catch this mutant: its errors are "
        + ", ".join(f"{k} {v:.3g}" for k, v in ratios.items()) + f" of the tolerances (need {MUTANT_MARGIN})")
