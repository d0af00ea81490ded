"""Scratch: float32 training steps with a fixed and a trainable decay, in both ``fp32_precision``
modes: GPU µs (torch.profiler's sum over every kernel of forward and backward) and wall ms of steps
back to back, medians of three rounds. Usage:

    python bench/profiling/time_fp32_trainable.py [small|mid|long ...]   (default: all three)
"""
import math
import statistics
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms, kernel_us

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128)}

print(torch.cuda.get_device_name())
for prec in ("exact", "tf32"):
    for name in sys.argv[1:] or list(SHAPES):
        b, h, n, d = SHAPES[name]
        g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
        gp = torch.nn.Parameter(g.clone())
        leaves = [(torch.randn(b, h, n, d, device="cuda") / d ** 0.25).requires_grad_() for _ in range(3)]
        do = torch.randn(b, h, n, d, device="cuda")

        def step(decay):
            for x in (*leaves, gp):
                x.grad = None
            rtkernels.causal_linear_attention(*leaves, decay, method="chunk", fp32_precision=prec).backward(do)

        step(g)
        step(gp)
        r = {"fixed": [], "train": [], "wall_fixed": [], "wall_train": []}
        for _ in range(3):
            r["fixed"].append(kernel_us(lambda: step(g), ""))
            r["train"].append(kernel_us(lambda: step(gp), ""))
            r["wall_fixed"].append(back_to_back_ms(lambda: step(g), reps=5))
            r["wall_train"].append(back_to_back_ms(lambda: step(gp), reps=5))
        m = {key: statistics.median(vals) for key, vals in r.items()}
        print(f"{prec} {name} {(b, h, n, d)}: GPU µs fixed {m['fixed']:.0f}, trainable {m['train']:.0f} "
              f"({m['train'] / m['fixed']:.2f}x); wall ms {m['wall_fixed']:.2f} / {m['wall_train']:.2f} "
              f"({m['wall_train'] / m['wall_fixed']:.2f}x)", flush=True)
