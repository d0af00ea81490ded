"""Scratch: one fp32 chunk launch (tf32 mode) at (4, 32, 4096, 128) for Nsight Compute."""
import torch

import rtkernels

q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda") / 128 ** 0.25 for _ in range(3))
for _ in range(2):
    rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", fp32_precision="tf32")
torch.cuda.synchronize()
