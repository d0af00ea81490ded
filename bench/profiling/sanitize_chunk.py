"""Runs the chunk kernels (one fused pass and the split-sequence strategy; the mma.sync kernel and,
on compute capability 9.0, the wgmma kernel at both value-tile widths) on one shape, forward and
forward + backward (the kernel backward: one forward pass, two reversed passes, and the dlog(gamma)
kernel for a decay that requires grad), with the split strategy's states kernel; then the fp32
kernel in both modes, one pass and split; for compute-sanitizer:
python bench/profiling/sanitize_chunk.py B H N DK DV [dtype ...]."""
import sys

import torch

import rtkernels
from rtkernels.methods import chunk

b, h, n, dk, dv = (int(x) for x in sys.argv[1:6])
dtypes = [getattr(torch, x) for x in sys.argv[6:]] or [torch.bfloat16, torch.float16]
q, k = (torch.randn(b, h, n, dk, device="cuda").bfloat16() / dk ** 0.5 for _ in range(2))
v = torch.randn(b, h, n, dv, device="cuda").half().bfloat16()
s0 = torch.randn(b, h, dk, dv, device="cuda")
variants = [(False, None)]
if torch.cuda.get_device_capability() == (9, 0):
    variants += [(True, 64), (True, 128)]

def run_16bit(dt):
    o, s = rtkernels.causal_linear_attention(q.to(dt), k.to(dt), v.to(dt), 0.99, method="chunk",
                                             initial_state=s0, return_state=True)
    leaves = [x.detach().to(dt, copy=True).requires_grad_() for x in (q, k, v)] + [s0.clone().requires_grad_()]
    leaves.append(torch.full((h,), 0.99, dtype=torch.float64, device="cuda", requires_grad=True))
    ob, sb = rtkernels.causal_linear_attention(*leaves[:3], leaves[4], method="chunk", initial_state=leaves[3],
                                               return_state=True)
    (ob.float().sum() + sb.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    return o


for wgmma, bv in variants:
    for segs in (1, 3):
        with chunk.override(wgmma=wgmma, bv=bv, segments=segs):
            for dt in dtypes:
                o = run_16bit(dt)
for segs in (1, 3):
    with chunk.override(segments=segs):
        for mode in ("exact", "tf32"):
            o32, s32 = rtkernels.causal_linear_attention(q.float(), k.float(), v.float(), 0.99, method="chunk",
                                                         initial_state=s0, return_state=True, fp32_precision=mode)
            assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
torch.cuda.synchronize()
print("ran", b, h, n, dk, dv, "variants", len(variants), "finite:", bool(torch.isfinite(o).all()))
