"""Scratch: float32 dlog(gamma) in the "tf32" mode, the wgmma kernel (``chunk/decay_grad_tf32.cu``)
against the mma.sync kernel (``chunk/decay_grad_f32.cu``, ``override(wgmma=False)``) in the same
process: ms per call back to back, relative error against the fp64 W recurrence, and the training
step (fwd+bwd in the "tf32" mode, decay fixed and trainable). Usage:

    python bench/profiling/time_decay_grad_tf32.py [small|mid|long|d64 ...]   (default: all four)
"""
import math
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.decay import LogDecay
from rtkernels.methods.chunk import override
from rtkernels.methods.chunk.decay_grad import kernel_log_decay_grad, torch_w_recurrence

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128),
          "d64": (8, 16, 2048, 64)}

print(torch.cuda.get_device_name())
print("| shape | dlog wgmma ms (err) | dlog mma.sync ms (err) | step fixed | trainable |")
print("|---|---:|---:|---:|---:|")
for name in sys.argv[1:] or list(SHAPES):
    b, h, n, d = SHAPES[name]
    gam = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h, dtype=torch.float64))
    q, k, v, g = (torch.randn(b, h, n, d, device="cuda") / d ** 0.25 for _ in range(4))
    ld = LogDecay(q.device, host=tuple(math.log(x) for x in gam.tolist()))
    want = torch_w_recurrence(*(x[:1].double() for x in (q, k, v)), gam.log().cuda(), 1.0, None, g[:1].double(), None)

    def dlog():
        return kernel_log_decay_grad(q[:1], k[:1], v[:1], ld, 1.0, None, g[:1], None, fp32_precision="tf32")

    def err():
        return float(((dlog().double() - want).norm() / want.norm()))

    def full():
        return kernel_log_decay_grad(q, k, v, ld, 1.0, None, g, None, fp32_precision="tf32")

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fixed = gam.float().cuda()
    train = fixed.clone().requires_grad_()

    def step(decay):
        for x in (*leaves, train):
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, decay, method="chunk", fp32_precision="tf32").backward(g)

    e_new, t_new = err(), back_to_back_ms(full, reps=10)
    s_fixed, s_new = back_to_back_ms(lambda: step(fixed), reps=5), back_to_back_ms(lambda: step(train), reps=5)
    with override(wgmma=False):
        e_old, t_old = err(), back_to_back_ms(full, reps=10)
    print(f"| {name} | {t_new:.3f} ({e_new:.1e}) | {t_old:.3f} ({e_old:.1e}) | {s_fixed:.3f} | {s_new:.3f} "
          f"({s_new / s_fixed:.2f}x) |", flush=True)
