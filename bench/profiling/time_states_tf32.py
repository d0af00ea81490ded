"""Scratch (device): float32 "tf32" split sequence, the first pass by rtk_chunk_states_tf32 (the
plan's default) against the fused kernel's states-only mode (``dedicated_states=False``), in
alternating rounds in one process. Per shape: the forward (ms per call back to back), the
fwd+bwd step (q, k, v require grad), the largest difference between the two forwards relative to
the output's largest value, and each one's error against an fp64 product on batch 0, head 0.

    python bench/profiling/time_states_tf32.py [B H N D ...]   (default 1 32 16384 128  2 16 32768 64)
"""
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.methods import chunk


def reference(q, k, v, gamma):
    qd, kd, vd = (x[0, 0].double() for x in (q, k, v))
    n = qd.shape[0]
    i = torch.arange(n, device="cuda", dtype=torch.float64)
    dist = i[:, None] - i[None, :]
    m = torch.where(dist >= 0, gamma ** dist.clamp(min=0), torch.zeros((), dtype=torch.float64, device="cuda"))
    return ((qd @ kd.T) * m) @ vd


def main():
    args = [int(x) for x in sys.argv[1:]] or [1, 32, 16384, 128, 2, 16, 32768, 64]
    for b, h, n, d in zip(*[iter(args)] * 4):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g) / d ** 0.25 for _ in range(3))
        decay = torch.full((h,), 0.999, device="cuda")
        do = torch.randn_like(v)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]

        def fwd():
            return rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", fp32_precision="tf32")

        def step():
            for x in leaves:
                x.grad = None
            rtkernels.causal_linear_attention(*leaves, decay, method="chunk", fp32_precision="tf32").backward(do)

        ref = reference(q, k, v, 0.999) if n <= 16384 else None
        outs = {}
        for rnd in range(2):
            for dedicated in (True, False):
                with chunk.override(dedicated_states=dedicated):
                    f, s = back_to_back_ms(fwd, reps=20), back_to_back_ms(step, reps=10)
                    o = fwd()
                outs[dedicated] = o
                err = "" if ref is None else f", error {((o[0, 0].double() - ref).abs().max() / ref.abs().max()).item():.2e}"
                name = "states_tf32" if dedicated else "states-only"
                print(f"({b}, {h}, {n}, {d}) round {rnd} {name:11s}: fwd {f:.3f} ms, fwd+bwd {s:.3f} ms{err}")
        diff = (outs[True] - outs[False]).abs().max() / outs[False].abs().max()
        print(f"({b}, {h}, {n}, {d}) max |difference| / max |o|: {diff.item():.2e}")


if __name__ == "__main__":
    main()
