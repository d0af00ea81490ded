"""Scratch: a training step (forward + backward, CUDA decay, bf16) with the backward's passes
folding other passes' states-pass slots (``launch.transposed_slots``): none (every pass runs its
own states pass), the dq pass folding the forward's, and that plus the dv pass folding the dk
pass's (the default); fixed and trainable decay, steps back to back (the GPU-bound time), rounds
alternating; the gradients of each way against the first.

    python bench/profiling/time_slot_reuse.py
"""
import math
import statistics
from collections import defaultdict

import torch

import rtkernels
from rtkernels import call_cache
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.methods.chunk import backward, launch

SHAPES = {"long": (1, 32, 16384, 128), "h16-32k": (1, 16, 32768, 128), "h8-128k": (1, 8, 131072, 128),
          "d64-h8-64k": (2, 8, 65536, 64), "mid": (4, 32, 4096, 128)}
MODES = ("none", "dq", "dq+dv")
real = launch.transposed_slots
mode = "dq+dv"
used = []


def spy(launcher, slots, fold):
    reversed_pass = getattr(launcher, "offsets", None) is not None  # the dv pass; the dq pass runs forward
    got = None if mode == "none" or (mode == "dq" and reversed_pass) else real(launcher, slots, fold)
    used.append(("dv" if reversed_pass else "dq", got is not None))
    return got


launch.transposed_slots = spy
print(torch.cuda.get_device_name())
print("| shape | decay | " + " | ".join(f"{m} ms" for m in MODES) + " | slots taken | grad rel diff |")
print("|---|---|" + "---|" * len(MODES) + "---|---|")
for name, (b, h, n, d) in SHAPES.items():
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    gp = torch.nn.Parameter(g.clone())
    leaves = [(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25).requires_grad_()
              for _ in range(3)]
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    for decay_name, decay in (("fixed", g), ("trainable", gp)):
        def step():
            for x in (*leaves, gp):
                x.grad = None
            rtkernels.causal_linear_attention(*leaves, decay, method="chunk").backward(do)

        times, grads, taken = defaultdict(list), {}, []
        for rnd in range(3):
            for m in MODES:
                mode = m
                call_cache.clear()
                backward.clear_plans()
                used.clear()
                step()
                if rnd == 0:
                    grads[m] = [x.grad.float() for x in leaves]
                    if m == "dq+dv":
                        taken = sorted(set(used))
                times[m].append(back_to_back_ms(step, reps=20))
        errs = [((a - b_).norm() / b_.norm()).item() for m in MODES[1:] for a, b_ in zip(grads[m], grads["none"])]
        cells = " | ".join(f"{statistics.median(times[m]):.4f}" for m in MODES)
        print(f"| {name} | {decay_name} | {cells} | {taken} | {max(errs):.1e} |", flush=True)
launch.transposed_slots = real
