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
