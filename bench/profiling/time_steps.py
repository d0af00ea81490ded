"""Scratch: ms per call, back to back, of the forward, forward + backward and the trainable-decay
forward + backward (decay a float32 CUDA ``[H]`` tensor, ``chunk``) for named shapes and dtypes:
one line per case, for comparing two trees run one after the other on the same machine. Usage:

    python bench/profiling/time_steps.py CASE [CASE ...]     CASE = shape:dtype[:fp32_precision]

shapes: small mid long d64 d256 retnet (bench/README); dtypes: bf16 fp16 fp32.
"""
import math
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms

SHAPES = {"small": (2, 32, 1024, 128, 128), "mid": (4, 32, 4096, 128, 128), "long": (1, 32, 16384, 128, 128),
          "d64": (8, 16, 2048, 64, 64), "d256": (2, 16, 4096, 256, 256), "retnet": (2, 8, 4096, 256, 512)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

for case in sys.argv[1:]:
    name, dt, *prec = case.split(":")
    b, h, n, dk, dv = SHAPES[name]
    dtype, mode = DTYPES[dt], (prec[0] if prec else "tf32")
    q, k = (torch.randn(b, h, n, dk, device="cuda", dtype=dtype) / dk ** 0.25 for _ in range(2))
    v, g = (torch.randn(b, h, n, dv, device="cuda", dtype=dtype) for _ in range(2))
    fixed = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    train = fixed.clone().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kw = {"method": "chunk", "fp32_precision": mode} if dtype == torch.float32 else {"method": "chunk"}

    def step(decay):
        for x in (*leaves, train):
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, decay, **kw).backward(g)

    with torch.no_grad():
        fwd = back_to_back_ms(lambda: rtkernels.causal_linear_attention(q, k, v, fixed, **kw), reps=20)
    fb, tr = back_to_back_ms(lambda: step(fixed), reps=10), back_to_back_ms(lambda: step(train), reps=10)
    print(f"{case}: fwd {fwd:.3f}  fwd+bwd {fb:.3f}  trainable {tr:.3f} ms", flush=True)
