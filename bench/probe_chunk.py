"""Scratch: time the chunk kernel alone with parts switched off (RTK_PROBE_* macros)."""
import math, sys
import torch
from rtkernels.decay import LogDecay
from rtkernels.methods import chunk
from rtkernels.methods._launch import fwd_args, operands
from rtkernels.runtime import get_function, launch

def run(shape, probes, reps=20):
    B, H, N, D = shape
    q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda").bfloat16()
    out = torch.empty_like(v)
    ld = LogDecay(q.device, host=tuple(math.log(0.99) for _ in range(H)))
    name, bv, smem, threads = chunk._launch_config(q.dtype, D, D, True, B * H, 0)
    opts = tuple(p if p.startswith("-D") else f"-DRTK_PROBE_{p}" for p in probes)
    fn = get_function(chunk.SOURCE, name, 0, extra_options=opts, dynamic_smem=smem)
    args = (*fwd_args(q, k, v, out, ld, None, None, 1.0), N, 0)
    f = lambda: launch(fn, (B * H, -(-D // bv), 1), (threads, 1, 1), args, 0, shared_mem=smem)
    for _ in range(3): f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

for shape in [(4, 32, 4096, 128), (2, 32, 1024, 128)]:
    row = [f"{shape}"]
    for probes in [(), ("NO_LOAD",), ("NO_STATE",), ("NO_OUT",), ("NO_LOAD", "NO_OUT", "NO_STATE")]:
        row.append(f"{'+'.join(probes) or 'full'} {run(shape, probes):.3f}")
    print("  ".join(row), flush=True)
