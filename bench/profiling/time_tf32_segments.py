"""Scratch (device): float32 "tf32" fwd+bwd (fixed decay) by forced segment count, the plan's own
choice first, alternating rounds in one process; per shape, ms per step back to back.

    python bench/profiling/time_tf32_segments.py [B H N D ...]
"""
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.methods import chunk

args = [int(x) for x in sys.argv[1:]] or [1, 32, 16384, 128, 2, 16, 32768, 64, 1, 8, 65536, 128, 2, 8, 16384, 64]
for b, h, n, d in zip(*[iter(args)] * 4):
    leaves = [(torch.randn(b, h, n, d, device="cuda") / d ** 0.25).requires_grad_() for _ in range(3)]
    do = torch.randn(b, h, n, d, device="cuda")
    decay = torch.full((h,), 0.999, device="cuda")

    def step():
        for x in leaves:
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, decay, method="chunk", fp32_precision="tf32").backward(do)

    res: dict = {}
    for rnd in range(2):
        for segs in (None, 2, 3, 4, 6, 8, 12, 16):
            if segs is not None and n // segs < 256:
                continue
            with chunk.override(segments=segs):
                res.setdefault(segs, []).append(back_to_back_ms(step, reps=8))
    print(f"({b}, {h}, {n}, {d}): " + ", ".join(f"{s or 'plan'}: {min(v):.3f}" for s, v in res.items()))
