"""Scratch: a training step (forward + backward, fixed CUDA decay, bf16) with the backward's dq pass
folding the forward's states-pass slots (the default) against it running its own states pass
(``launch.transposed_slots`` patched to None); steps back to back (the GPU-bound time), rounds
alternating; the gradients of the two against each other.

    python bench/profiling/time_dq_slots.py
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
real = launch.transposed_slots
used = []


def spy(*args):
    got = real(*args)
    used.append(got is not None)
    return got


print(torch.cuda.get_device_name())
for name, (b, h, n, d) in SHAPES.items():
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    leaves = [(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25).requires_grad_()
              for _ in range(3)]
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)

    def step():
        for x in leaves:
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, g, method="chunk").backward(do)

    times, grads = defaultdict(list), {}
    for rnd in range(3):
        for reuse in (True, False):
            launch.transposed_slots = spy if reuse else (lambda *a: None)
            call_cache.clear()
            backward.clear_plans()
            used.clear()
            step()
            if rnd == 0:
                grads[reuse] = [x.grad.float() for x in leaves]
                if reuse:
                    print(f"{name}: slots taken {used}")
            times[reuse].append(back_to_back_ms(step, reps=20))
    errs = [((a - b_).norm() / b_.norm()).item() for a, b_ in zip(grads[True], grads[False])]
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{name:12s} reuse {on:.4f} ms  own states pass {off:.4f} ms  ({(off - on) / off * 100:+.1f} %)  "
          f"grad rel diff {max(errs):.2e}")
launch.transposed_slots = real
