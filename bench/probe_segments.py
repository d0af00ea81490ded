"""Scratch: chunk kernel time at the long shape for several segment counts (back-to-back calls)."""
import math
import torch
import rtkernels
from rtkernels.methods import chunk

B, H, N, D = 1, 32, 16384, 128
g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))
q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
v = torch.randn(B, H, N, D, device="cuda").bfloat16()
row = []
for segs in (1, 2, 3, 4, 5, 6, 8, 12, 16):
    chunk.force_segments = segs
    f = lambda: rtkernels.causal_linear_attention(q, k, v, g, method="chunk")
    for _ in range(3): f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(20): f()
    e.record(); torch.cuda.synchronize()
    row.append(f"{segs}:{s.elapsed_time(e) / 20:.3f}")
print("long, segments:ms", " ".join(row))
