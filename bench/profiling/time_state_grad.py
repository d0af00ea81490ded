"""Scratch (device): what a final-state gradient costs a single-device training step, and context
parallel's own-state pass by the kernel against the batched matmuls, at (1, 32, N, 128) bf16.

    python bench/profiling/time_state_grad.py [N ...]        (default 131072 262144)
"""
import math
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.decay import KIND_FACTOR, LogDecay
from rtkernels.methods.chunk.launch import kernel_final_state


def matmul_state(k: torch.Tensor, v: torch.Tensor, lg: torch.Tensor, block: int = 16384) -> torch.Tensor:
    """sum_t gamma^(N-1-t) k_t^T v_t by weighted copies of k and batched matmuls (fp32 results),
    in token blocks: how context parallel formed its own state before the kernel did."""
    b, h, n, dk = k.shape
    state = torch.zeros(b * h, dk, v.shape[-1], device=k.device)
    for a in range(0, n, block):
        e = min(n, a + block)
        w = torch.exp(lg[:, None] * torch.arange(n - 1 - a, n - 1 - e, -1, device=k.device, dtype=lg.dtype))
        kw = (k[:, :, a:e] * w[..., None].to(k.dtype)).reshape(b * h, e - a, dk)
        state += torch.bmm(kw.transpose(-1, -2), v[:, :, a:e].reshape(b * h, e - a, -1), out_dtype=torch.float32)
    return state.view(b, h, dk, -1)


torch.manual_seed(0)
h, d = 32, 128
gam = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
lg = torch.log(gam)
ld = LogDecay(torch.device("cuda"), raw=gam, kind=KIND_FACTOR)
for n in [int(x) for x in sys.argv[1:]] or [131072, 262144]:
    q, k, v, go = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25 for _ in range(4))
    fwd = back_to_back_ms(lambda: rtkernels.causal_linear_attention(q, k, v, gam), 10)
    mm = back_to_back_ms(lambda: matmul_state(k, v, lg), 10)
    kern = back_to_back_ms(lambda: kernel_final_state(k, v, ld), 10)
    ref = matmul_state(k, v, lg)
    diff = float((kernel_final_state(k, v, ld) - ref).norm() / ref.norm())
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
