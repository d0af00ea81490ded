"""One forward of the chunk kernel (mma.sync, or wgmma with a sixth argument), for
compute-sanitizer's racecheck: python bench/profiling/race_probe.py DK DV STATE SEGS DTYPE [WG]"""
import sys

import torch

import rtkernels
from rtkernels.methods import chunk

dk, dv, state, segs = (int(x) for x in sys.argv[1:5])
dt = getattr(torch, sys.argv[5])
chunk.override(wgmma=len(sys.argv) > 6, segments=segs).__enter__()  # for the rest of this process
q, k = (torch.randn(1, 2, 200, dk, device="cuda").to(dt) / 8 for _ in range(2))
v = torch.randn(1, 2, 200, dv, device="cuda").to(dt)
s0 = torch.randn(1, 2, dk, dv, device="cuda") if state else None
o = rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", initial_state=s0, return_state=bool(state))
torch.cuda.synchronize()
print("ok")
