"""Time the fp32 chunk kernel in both modes (and bf16 for comparison) at one shape; check the error
of one batch against fp64. Usage: python bench/profiling/time_fp32.py [B H N D]  (default 4 32 4096 128)."""

import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms


def main():
    b, h, n, d = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (4, 32, 4096, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g) / d ** 0.25 for _ in range(3))
    decay = 1 - torch.exp(torch.linspace(-3.5, -6.2, h, dtype=torch.float64))
    ref = None
    if n <= 8192:
        qd, kd, vd = (x[:1].double() for x in (q, k, v))
        i = torch.arange(n, device="cuda", dtype=torch.float64)
        dist = i[:, None] - i[None, :]
        lg = torch.log(decay.cuda())[:, None, None]
        m = torch.where(dist >= 0, torch.exp(lg * dist.clamp(min=0)), torch.zeros((), dtype=torch.float64, device="cuda"))
        ref = ((qd @ kd.transpose(-1, -2)) * m) @ vd
    for mode in ("exact", "tf32"):
        def fn():
            return rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", fp32_precision=mode)
        ms = back_to_back_ms(fn, reps=20)
        err = ""
        if ref is not None:
            o = fn()[:1].double()
            err = f"  rel. error (batch 0) {((o - ref).norm() / ref.norm()).item():.3g}"
        print(f"fp32 {mode:5s} ({b}, {h}, {n}, {d}): {ms:.3f} ms{err}")
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    ms = back_to_back_ms(lambda: rtkernels.causal_linear_attention(qb, kb, vb, decay, method="chunk"), reps=20)
    print(f"bf16       ({b}, {h}, {n}, {d}): {ms:.3f} ms")


if __name__ == "__main__":
    main()
