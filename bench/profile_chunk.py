"""Scratch: host overhead of a cached kernel call, and one mid-shape chunk launch for ncu."""
import cProfile, math, pstats, sys, time
import torch
import rtkernels

mode = sys.argv[1] if len(sys.argv) > 1 else "host"
g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), 32))
if mode == "host":
    q, k, v = (torch.randn(1, 32, 16, 64, device="cuda").bfloat16() for _ in range(3))
    for m in ("chunk", "scan"):
        f = lambda: rtkernels.causal_linear_attention(q, k, v, g, method=m)
        for _ in range(20): f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000): f()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{m}: host {1e6 * (t1 - t) / 2000:.1f} us/call (CPU time of the Python call)")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2000): rtkernels.causal_linear_attention(q, k, v, g, method="chunk")
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
else:
    B, H, N, D = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128)}.get(mode, (1, 32, 16384, 128))
    q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda").bfloat16()
    for _ in range(3): rtkernels.causal_linear_attention(q, k, v, g, method="chunk")
    torch.cuda.synchronize()
