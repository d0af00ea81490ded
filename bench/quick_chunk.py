"""Scratch timing of the chunk kernel against fla (replaced by bench/run.py)."""
import math, sys, time
import torch
import rtkernels

def t_ms(fn, reps=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]

try:
    from fla.ops.simple_gla import chunk_simple_gla
except Exception as ex:
    chunk_simple_gla = None; print("no fla:", ex)
for (B, H, N, D) in [(2, 32, 1024, 128), (4, 32, 4096, 128), (1, 32, 16384, 128), (8, 16, 2048, 64)]:
    H_ = H
    g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))
    q, k = (torch.randn(B, H, N, D, device="cuda") / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda")
    q, k, v = (x.bfloat16() for x in (q, k, v))
    row = [f"{B}x{H}x{N}x{D}"]
    for m in ("chunk", "scan", "fleet"):
        row.append(f"{m} {t_ms(lambda: rtkernels.causal_linear_attention(q, k, v, g, method=m)):.3f}")
    if chunk_simple_gla is not None:
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        gg = torch.log(g).float().cuda()
        row.append(f"fla {t_ms(lambda: chunk_simple_gla(qt, kt, vt, g_gamma=gg, scale=1.0)):.3f}")
        o1 = rtkernels.causal_linear_attention(q, k, v, g, method="chunk").float()
        o2 = chunk_simple_gla(qt, kt, vt, g_gamma=gg, scale=1.0)[0].transpose(1, 2).float()
        row.append(f"diff {((o1 - o2).norm() / o2.norm()).item():.2e}")
    print("  ".join(row), flush=True)
