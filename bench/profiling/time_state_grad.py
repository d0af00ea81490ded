"""Scratch (device): what a final-state gradient costs a single-device training step, and context
parallel's own-state pass by the kernel against the batched matmuls, at (1, 32, N, 128) bf16.

    python bench/profiling/time_state_grad.py [N ...]        (default 131072 262144)
"""
import math
import sys

import torch

import rtkernels
from rtkernels import distributed as cp
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.decay import KIND_FACTOR, LogDecay

torch.manual_seed(0)
h, d = 32, 128
gam = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
lg = torch.log(gam)
ld = LogDecay(torch.device("cuda"), raw=gam, kind=KIND_FACTOR)
for n in [int(x) for x in sys.argv[1:]] or [131072, 262144]:
    q, k, v, go = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25 for _ in range(4))
    fwd = back_to_back_ms(lambda: rtkernels.causal_linear_attention(q, k, v, gam), 10)
    mm = back_to_back_ms(lambda: cp._piece_state(k, v, lg, torch.float32), 10)
    kern = back_to_back_ms(lambda: cp._own_state(k, v, ld, lg, torch.float32), 10)
    ref = cp._piece_state(k, v, lg, torch.float32)
    diff = float((cp._own_state(k, v, ld, lg, torch.float32) - ref).norm() / ref.norm())
    print(f"N={n}: forward {fwd:.3f} ms; own state: matmuls {mm:.3f} ms, kernel {kern:.3f} ms "
          f"(relative difference {diff:.1e})", flush=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    gs = torch.randn(1, h, d, d, device="cuda")

    def step(state_loss: bool) -> None:
        out, state = rtkernels.causal_linear_attention(*leaves, gam, return_state=True)
        ((out * go).sum() + ((state * gs).sum() if state_loss else 0)).backward()

    print(f"  fwd+bwd: loss on the output {back_to_back_ms(lambda: step(False), 5, 2):.3f} ms, "
          f"on the output and the final state {back_to_back_ms(lambda: step(True), 5, 2):.3f} ms", flush=True)
    del q, k, v, go, leaves
    torch.cuda.empty_cache()
