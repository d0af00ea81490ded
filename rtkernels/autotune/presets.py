"""Named sets of shapes for ``rtkernels autotune --preset``.

``standard`` is the forward shapes of docs/benchmark.md, each with the dtypes its row lists; ``quick`` is a
few small shapes for a smoke run.
"""

from __future__ import annotations

__all__ = ["PRESETS", "parse_shape"]

#: preset -> shape name -> ((B, H, N, Dk, Dv), dtypes)
PRESETS: dict[str, dict[str, tuple[tuple[int, int, int, int, int], tuple[str, ...]]]] = {
    "standard": {
        "small": ((2, 32, 1024, 128, 128), ("bf16", "fp32")),
        "mid": ((4, 32, 4096, 128, 128), ("bf16", "fp16", "fp32")),
        "long": ((1, 32, 16384, 128, 128), ("bf16", "fp32")),
        "d64": ((8, 16, 2048, 64, 64), ("bf16",)),
        "d256": ((2, 16, 4096, 256, 256), ("bf16",)),
        "retnet": ((2, 8, 4096, 256, 512), ("bf16",)),  # RetNet's heads: Dv = 2 Dk
        "huge": ((1, 8, 1048576, 128, 128), ("bf16",)),
    },
    "quick": {
        "tiny": ((2, 4, 256, 64, 64), ("bf16", "fp32")),
        "few-heads": ((1, 2, 4096, 128, 128), ("bf16",)),
    },
}


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``"4x32x4096x128"`` or ``"4,32,4096,128,96"`` -> (B, H, N, Dk, Dv)."""
    parts = [int(p) for p in text.replace(",", "x").lower().split("x") if p]
    if len(parts) == 4:
        parts.append(parts[3])
    if len(parts) != 5 or min(parts) < 1:
        raise ValueError(f"a shape is BxHxNxD or BxHxNxDkxDv with positive sizes, got {text!r}")
    return tuple(parts)  # type: ignore[return-value]
