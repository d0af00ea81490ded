"""The one-instruction TF32 rounding of the Hopper float32 kernels (``rtk_tf32_operand`` in
cuda_src/include/tf32.cuh: max(bits + 2^12, bits) as signed 32-bit integers, whose 13 low bits the
tensor cores then drop), restated in numpy and held against rounding to nearest, ties away from
zero, computed in float64 from the value (cvt.rna.tf32's definition): equal on every finite float
(normal, subnormal, near the largest), and the NaN an fp32 multiply makes stays a NaN."""

import numpy as np


def _operand_bits(x: np.ndarray) -> np.ndarray:
    """What the tensor cores read after rtk_tf32_operand: the kernel's arithmetic, then the top 19
    bits."""
    s = x.view(np.int32).astype(np.int64)
    r = np.maximum(((s + 0x1000 + 2**31) % 2**32) - 2**31, s)  # wrapping 32-bit add, then max
    return (r.astype(np.int64) & 0xFFFFE000).astype(np.uint32)


def _rna_tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to 10 explicit mantissa bits, ties away from zero, in float64 (fp32's exponent
    range: subnormals keep the fixed ulp 2^-136), as float32 bits."""
    a = np.abs(x.astype(np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    ulp = np.exp2(np.maximum(e, -126.0) - 10.0)
    y = np.floor(a / ulp + 0.5) * ulp
    with np.errstate(over="ignore"):
        return np.copysign(y, x.astype(np.float64)).astype(np.float32).view(np.uint32)


def test_matches_round_to_nearest_ties_away_on_finite_values():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    ties = (np.arange(1, 2000, dtype=np.uint32) << 13 | 0x1000).view(np.float32)  # exact halves
    edges = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                      1e-45, -1e-45, 0.0, -0.0, 1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 3.4e38], dtype=np.float32)
    for v in (x, ties, -ties, edges):
        assert np.array_equal(_operand_bits(v), _rna_tf32(v)), v[_operand_bits(v) != _rna_tf32(v)][:5]


def test_the_multiply_nan_stays_nan_and_inf_is_non_finite():
    canonical = np.array([0x7FFFFFFF], dtype=np.uint32).view(np.float32)
    assert np.isnan(_operand_bits(canonical).view(np.float32)).all()
    infs = np.array([np.inf, -np.inf], dtype=np.float32)
    assert not np.isfinite(_operand_bits(infs).view(np.float32)).any()
