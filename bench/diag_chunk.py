"""Scratch diagnostics of the chunk kernel (device calls): registers/local memory of each instance,
and kernel-only time with parts switched off (RTK_PROBE_* macros) or experiment macros
(-DNAME=VALUE) for several shapes.

    python -m bench.diag_chunk [variant ...]   variant: "full", "NO_LOAD", "-DRTK_KUNROLL=2", "A+B"
"""
import math
import sys

import torch

from rtkernels.decay import LogDecay
from rtkernels.methods import chunk
from rtkernels.methods._launch import fwd_args
from rtkernels.runtime import get_function, launch

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128)}


def options(variant: str) -> tuple:
    if variant == "full":
        return ()
    return tuple(p if p.startswith("-D") else f"-DRTK_PROBE_{p}" for p in variant.split("+"))


def run(shape, variant, reps=20):
    B, H, N, D = shape
    q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda").bfloat16()
    out = torch.empty_like(v)
    ld = LogDecay(q.device, host=tuple(math.log(0.99) for _ in range(H)))
    name, bv, smem, threads = chunk._launch_config(q.dtype, D, D, True, B * H, 0)
    fn = get_function(chunk.SOURCE, name, 0, extra_options=options(variant), dynamic_smem=smem)
    attrs = fn.function.attributes
    args = (*fwd_args(q, k, v, out, ld, None, None, 1.0), N, 0)
    f = lambda: launch(fn, (B * H, -(-D // bv), 1), (threads, 1, 1), args, 0, shared_mem=smem)
    for _ in range(3):
        f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps, name, attrs.get("num_regs"), attrs.get("local_size_bytes")


if __name__ == "__main__":
    variants = sys.argv[1:] or ["full", "NO_LOAD", "NO_STATE", "NO_OUT", "NO_LOAD+NO_OUT+NO_STATE"]
    for label, shape in SHAPES.items():
        for variant in variants:
            ms, name, regs, local = run(shape, variant)
            print(f"{label:6s} {variant:32s} {ms:.4f} ms  {name} regs={regs} local={local}", flush=True)
