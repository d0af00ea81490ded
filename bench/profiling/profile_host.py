"""Scratch: the host time of one call (µs, hot loop at a tiny shape so the GPU never limits it):
the cached call for each decay form, in compiled code (rtkernels.compiled_call) and on Python's
cached path, the full path (cache cleared each call), and the pieces of Python's cached call.

    python bench/profiling/profile_host.py
"""
import contextlib
import math
import time

import torch

import rtkernels
from rtkernels import call_cache, compiled_call


def tm(fn, n=3000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


print(f"compiled entry: {compiled_call.build(wait=True) and compiled_call.status()}")
g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), 32))
gd = g.cuda()
q, k, v = (torch.randn(1, 32, 64, 128, device="cuda").bfloat16() for _ in range(3))
cla = rtkernels.causal_linear_attention
print(f"cached call, decay CPU tensor   {tm(lambda: cla(q, k, v, g, method='chunk')):.1f}")
print(f"cached call, decay float        {tm(lambda: cla(q, k, v, 0.99, method='chunk')):.1f}")
print(f"cached call, method auto        {tm(lambda: cla(q, k, v, g)):.1f}")
for name, ctx in (("compiled", contextlib.nullcontext), ("python", compiled_call.suspended)):
    with ctx():
        print(f"[{name}] cached call, decay CUDA tensor   {tm(lambda: cla(q, k, v, gd, method='chunk')):.1f}")
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        gp = torch.nn.Parameter(gd.clone())
        print(f"[{name}] cached call with autograd, CUDA decay parameter {tm(lambda: cla(*xs, gp, method='chunk')):.1f}")
for layout in ("bhnd", "bnhd"):  # autograd history: q, k, v and an nn.Parameter decay require grad
    xs = [(x.clone() if layout == "bhnd" else x.transpose(1, 2).contiguous()).requires_grad_() for x in (q, k, v)]
    gp = torch.nn.Parameter(g.cuda())
    print(f"cached call with autograd, {layout} {tm(lambda: cla(*xs, gp, method='chunk', layout=layout)):.1f}")
s0 = torch.zeros(1, 32, 128, 128, device="cuda")
print(f"cached call, state in and out   {tm(lambda: cla(q, k, v, g, initial_state=s0, return_state=True)):.1f}")


def full():
    call_cache.clear()
    return cla(q, k, v, g, method="chunk")


print(f"full path (cache cleared)       {tm(full):.1f}")
key = lambda: call_cache.call_key(q, k, v, g, None, 1.0, "chunk", "bhnd", None, False)
print(f"  call_key                      {tm(key):.1f}")
hit = call_cache.lookup(key())
out = torch.empty_like(v)
print(f"  torch.empty                   {tm(lambda: torch.empty(hit.out_shape, dtype=hit.dtype, device=hit.device)):.1f}")
print(f"  launcher                      {tm(lambda: hit.launcher(q, k, v, out, None)):.1f}")
print(f"  nothing                       {tm(lambda: None):.1f}")


class Bare(torch.autograd.Function):  # the floor of any Python autograd Function on this host
    @staticmethod
    def forward(ctx, q, k, v, g):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None


xs = [x.clone().requires_grad_() for x in (q, k, v)]
gp = torch.nn.Parameter(g.cuda())
print(f"bare autograd.Function.apply    {tm(lambda: Bare.apply(*xs, gp)):.1f}")
