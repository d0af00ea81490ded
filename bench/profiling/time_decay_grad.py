"""Scratch: forward + backward time at (4, 32, 4096, 128) bf16 with the decay fixed and with a
trainable decay (the dlog(gamma) kernel), and the kernel's dlog(gamma) alone against the torch
four-term formula. python bench/profiling/time_decay_grad.py"""
import math

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.autograd import log_decay_grad
from rtkernels.decay import LogDecay
from rtkernels.methods.chunk.decay_grad import kernel_log_decay_grad


def ms(fn, reps=10):
    return back_to_back_ms(fn, reps, warmup=2)


B, H, N, D = 4, 32, 4096, 128
q, k, v, g = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.25 for _ in range(4))
gam = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H, dtype=torch.float64)).cuda()
leaves = [x.clone().requires_grad_() for x in (q, k, v)]


def step(decay):
    o = rtkernels.causal_linear_attention(*leaves, decay, method="chunk")
    o.backward(g)


d_train = gam.clone().requires_grad_()
print(f"fwd+bwd, decay fixed: {ms(lambda: step(gam)):.3f} ms; trainable: {ms(lambda: step(d_train)):.3f} ms")
ld = LogDecay(q.device, host=tuple(math.log(x) for x in gam.tolist()))
print(f"dlog(gamma) alone: kernel {ms(lambda: kernel_log_decay_grad(q, k, v, ld, 1.0, None, g, None)):.3f} ms, "
      f"torch formula {ms(lambda: log_decay_grad(q, k, v, ld, 1.0, None, g, None), reps=3):.3f} ms")
