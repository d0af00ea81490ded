"""The trainable decay's backward with the W form's dq pass (DLOG 1: on Hopper its tensor-copy
twin), B = 1, H = 2, Dk = Dv = 128, N = 200 (a short last chunk) and 64, for compute-sanitizer:

    compute-sanitizer --tool memcheck --kernel-name kns=rtk_chunk_fwd python bench/profiling/sanitize_dlog_w.py
"""
import torch

import rtkernels
from rtkernels.methods.chunk import decay_grad, plan

torch.manual_seed(0)
for n in (200, 64):
    with plan.override(dlog_split=False):
        q, k, v = (torch.randn(1, 2, n, 128, device="cuda").bfloat16().requires_grad_() for _ in range(3))
        assert decay_grad.z_split_applies(q, k, v, q) is None
        print("TMA twin:", plan.tma_variant(plan.dlog_launch(torch.bfloat16, 128, 128, 2, n, 0).name) is not None)
        decay = torch.tensor([0.9, 0.99], device="cuda", requires_grad=True)
        rtkernels.causal_linear_attention(q, k, v, decay, method="chunk").float().sum().backward()
        torch.cuda.synchronize()
        print(n, decay.grad.tolist())
