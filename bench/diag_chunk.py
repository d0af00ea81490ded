"""Scratch diagnostics of the chunk kernel (device calls): registers/local memory of each instance,
its error against the fp32 torch path, and kernel-only time, with parts switched off
(RTK_PROBE_* macros), experiment macros (-DNAME=VALUE) or launch overrides, for several shapes.

    python -m bench.diag_chunk [variant ...]
    variant: tokens joined by "+": "full", "NO_LOAD" (a probe), "-DX=1" (a macro),
             "wg" / "nowg" (wgmma output warpgroup on / off), "bv128" (value tile width)
"""
import math
import sys

import torch

import rtkernels
from rtkernels.decay import LogDecay
from rtkernels.methods import chunk
from rtkernels.methods._launch import fwd_args
from rtkernels.jit import get_function, launch

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128),
          "odd": (1, 3, 200, 96)}


def parse(variant: str):
    opts, wg, bv = [], None, None
    for tok in variant.split("+"):
        if tok == "full":
            continue
        if tok in ("wg", "nowg"):
            wg = tok == "wg"
        elif tok.startswith("bv"):
            bv = int(tok[2:])
        else:
            opts.append(tok if tok.startswith("-D") else f"-DRTK_PROBE_{tok}")
    return tuple(opts), wg, bv


def run(shape, variant, reps=20):
    B, H, N, D = shape
    torch.manual_seed(0)
    q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda").bfloat16()
    ref = rtkernels.causal_linear_attention(q.float(), k.float(), v.float(), 0.99, method="chunk")
    out = torch.full_like(v, float("nan"))
    ld = LogDecay(q.device, host=tuple(math.log(0.99) for _ in range(H)))
    opts, chunk.force_wgmma, chunk.force_bv = parse(variant)
    try:
        name, bv, smem, threads, base_opts = chunk._launch_config(q.dtype, D, D, True, B * H, 0, N)
    finally:
        chunk.force_wgmma = chunk.force_bv = None
    fn = get_function(chunk.SOURCE, name, 0, extra_options=base_opts + opts, dynamic_smem=smem)
    attrs = fn.attributes
    args = (*fwd_args(q, k, v, out, ld, None, None, 1.0), N, 0)
    f = lambda: launch(fn, (B * H, -(-D // bv), 1), (threads, 1, 1), args, 0, shared_mem=smem)
    f()
    torch.cuda.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    for _ in range(3):
        f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps, err, name, attrs.get("num_regs"), attrs.get("local_size_bytes")


if __name__ == "__main__":
    args = sys.argv[1:]
    shapes = list(SHAPES)
    if args and args[0].startswith("shapes="):
        shapes = args.pop(0)[7:].split(",")
    variants = args or ["full", "NO_LOAD", "NO_STATE", "NO_OUT", "NO_LOAD+NO_OUT+NO_STATE"]
    for label in shapes:
        for variant in variants:
            try:
                ms, err, name, regs, local = run(SHAPES[label], variant)
                print(f"{label:6s} {variant:28s} {ms:.4f} ms err={err:.2e} {name} regs={regs} local={local}", flush=True)
            except Exception as exc:  # keep going: one broken variant must not hide the others
                print(f"{label:6s} {variant:28s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
