"""Scratch: the backward's dk and dv passes as one walk (``Overrides(fused_dk_dv=True)``, the DUAL
instance of chunk/fwd16.cu) against the two separate reversed passes (``fused_dk_dv=False``), on
the bench's shapes: a training step's GPU time (torch.profiler, every kernel of forward and
backward) and its time back to back, with a fixed and a trainable decay, rounds alternating; the
largest difference between the two ways' gradients relative to each tensor's largest value.

    python bench/profiling/time_fused_dk_dv.py [SHAPE ...]
"""
import math
import statistics
import sys
from collections import defaultdict

import torch

import rtkernels
from rtkernels import call_cache
from rtkernels.cli.bench.timing import back_to_back_ms, kernel_us
from rtkernels.methods.chunk import backward, override

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128),
          "d64": (8, 16, 2048, 64), "h16-32k": (1, 16, 32768, 128)}

names = sys.argv[1:] or list(SHAPES)
print(torch.cuda.get_device_name())
print("| shape | step GPU µs fixed (separate / fused) | trainable | step ms fixed | trainable | max rel diff |")
print("|---|---|---|---|---|---|")
for name in names:
    b, h, n, d = SHAPES[name]
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    gp = torch.nn.Parameter(g.clone())
    leaves = [(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25).requires_grad_()
              for _ in range(3)]
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)

    def step(decay):
        for x in (*leaves, gp):
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, decay, method="chunk").backward(do)

    times, grads = defaultdict(lambda: defaultdict(list)), {}
    for rnd in range(3):
        for fused in (False, True):
            with override(fused_dk_dv=fused):
                call_cache.clear()
                backward.clear_plans()
                if rnd == 0:
                    step(gp)
                    grads[fused] = [x.grad.clone() for x in (*leaves, gp)]
                t = times[fused]
                t["gpu_fixed"].append(kernel_us(lambda: step(g), ""))
                t["gpu_train"].append(kernel_us(lambda: step(gp), ""))
                t["fixed"].append(back_to_back_ms(lambda: step(g), reps=10))
                t["train"].append(back_to_back_ms(lambda: step(gp), reps=10))
    diff = max(((a.float() - b_.float()).abs().max() / b_.float().abs().max()).item()
               for a, b_ in zip(grads[False], grads[True]))
    med = {f: {key: statistics.median(vals) for key, vals in t.items()} for f, t in times.items()}
    off, on = med[False], med[True]
    print(f"| {name} {(b, h, n, d)} | {off['gpu_fixed']:.1f} / {on['gpu_fixed']:.1f} | "
          f"{off['gpu_train']:.1f} / {on['gpu_train']:.1f} | {off['fixed']:.3f} / {on['fixed']:.3f} | "
          f"{off['train']:.3f} / {on['train']:.3f} | {diff:.1e} |", flush=True)
