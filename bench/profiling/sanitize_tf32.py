"""Runs rtk_chunk_fwd_tf32 (float32, fp32_precision="tf32", wgmma) on small shapes for
compute-sanitizer: one pass and the split strategy (its states-only mode; the backward's dlog(gamma)
kernel, rtk_chunk_decay_grad_tf32, splits with it), forward and forward + backward with an initial
state and the final state, Dk < KMAX and Dv not a multiple of 64, a chunk whose v holds NaN, packed
sequences. python bench/profiling/sanitize_tf32.py"""
import torch

import rtkernels
from rtkernels.methods import chunk

torch.manual_seed(0)
for b, h, n, dk, dv, segs in ((1, 2, 200, 128, 64, None), (2, 2, 300, 40, 100, 3), (1, 1, 64, 64, 64, None),
                              (1, 2, 400, 128, 128, 2)):
    q, k, v = (torch.randn(b, h, n, d, device="cuda") / d ** 0.5 for d in (dk, dk, dv))
    s0 = torch.randn(b, h, dk, dv, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    decay = torch.full((h,), 0.95, device="cuda", requires_grad=True)
    with chunk.override(segments=segs):
        o, s = rtkernels.causal_linear_attention(*leaves[:3], decay, method="chunk", initial_state=leaves[3],
                                                 return_state=True, fp32_precision="tf32")
        (o.sum() + s.sum()).backward()
        vn = v.clone()
        vn[:, :, n // 2, 1] = float("nan")
        on = rtkernels.causal_linear_attention(q, k, vn, 0.9, method="chunk", fp32_precision="tf32")
    torch.cuda.synchronize()
    print((b, h, n, dk, dv, segs), "finite", bool(torch.isfinite(o).all()), "nan rows from", n // 2,
          bool(torch.isnan(on[:, :, n // 2:, 1]).all()), bool(torch.isfinite(on[:, :, : n // 2]).all()))
cu = torch.tensor([0, 70, 70, 250], device="cuda")
q, k, v = (torch.randn(1, 250, 3, 128, device="cuda") for _ in range(3))
o = rtkernels.causal_linear_attention(q, k, v, 0.9, method="chunk", layout="bnhd", cu_seqlens=cu, fp32_precision="tf32")
torch.cuda.synchronize()
print("packed finite", bool(torch.isfinite(o).all()))
