"""The trainable decay's backward with the Z split's 128-wide dq pass forced (DLOG 3: the fused dk/dv
pass, one segment), on a small shape, for compute-sanitizer: B = 1, H = 2, Dk = Dv = 128, N = 200
and 64, no initial state, with and without the final state in the loss.

    compute-sanitizer --tool racecheck python bench/profiling/sanitize_dlog_wide.py
"""
import torch

import rtkernels
from rtkernels.methods.chunk import decay_grad, plan

torch.manual_seed(0)
for n in (200, 64):
    for with_state in (False, True):
        with plan.override(dlog_split=True, dlog_wide=True, fused_dk_dv=True, segments=1):
            assert plan.dlog_launch(torch.bfloat16, 128, 128, 2, n, 0, plan.current_overrides(), True).bv == 128
            q, k, v = (torch.randn(1, 2, n, 128, device="cuda").bfloat16().requires_grad_() for _ in range(3))
            assert decay_grad.z_split_applies(q, k, v, q) is not None
            decay = torch.tensor([0.9, 0.99], device="cuda", requires_grad=True)
            out = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", return_state=with_state)
            loss = out[0].float().sum() + out[1].sum() if with_state else out.float().sum()
            loss.backward()
            torch.cuda.synchronize()
            print(n, with_state, decay.grad.tolist())
