"""Scratch: the split-sequence strategy's states pass at (1, 32, 16384, 128) bf16 and the like:
rtk_chunk_states (the default for 16-bit inputs) against the fused kernel's states-only mode plus
the scan kernel (Overrides(dedicated_states=False); on Hopper its state warps update S with
wgmma), per kernel (torch.profiler) and back to back, forward and the fixed-decay training step.

    python bench/profiling/time_states_pass.py [segments ...]
"""
import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.methods import chunk

B, H, N, D = 1, 32, 16384, 128
g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))).cuda()
q, k, v = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.25 for _ in range(3))
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
do = torch.randn(B, H, N, D, device="cuda").bfloat16()
ref = rtkernels.causal_linear_attention(q.float(), k.float(), v.float(), g, method="chunk")


def fwd():
    return rtkernels.causal_linear_attention(q, k, v, g, method="chunk")


def step():
    for x in leaves:
        x.grad = None
    rtkernels.causal_linear_attention(*leaves, g, method="chunk").backward(do)


for segs in [int(a) for a in sys.argv[1:]] or [None]:
    for dedicated in (True, False):
        with chunk.override(dedicated_states=dedicated, segments=segs):
            err = ((fwd().float() - ref).norm() / ref.norm()).item()
            t_fwd, t_step = back_to_back_ms(fwd), back_to_back_ms(step, reps=20)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fwd()
                torch.cuda.synchronize()
            by = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    by[e.name[:60]] = by.get(e.name[:60], 0.0) + (e.time_range.end - e.time_range.start) / 1000
        print(f"segments={segs} dedicated={dedicated}: fwd {t_fwd:.4f} ms, fwd+bwd step {t_step:.4f} ms, "
              f"rel err {err:.1e}")
        for name, t in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"   {t:.4f} ms  {name}")
