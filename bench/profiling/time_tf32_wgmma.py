"""Scratch: float32 in the TF32 mode on rtk_chunk_fwd_tf32 (wgmma) against rtk_chunk_fwd_f32
(mma.sync, ``override(wgmma=False)``), forward and forward + backward (decay a CUDA tensor,
trainable or not), ms per call back to back, and the forward's error against fp64 (batch 0).
python bench/profiling/time_tf32_wgmma.py [small mid long]"""
import sys

import torch

import rtkernels
from rtkernels.cli.bench.harness import SHAPES
from rtkernels.cli.bench.timing import back_to_back_ms
from rtkernels.methods import chunk


def error(o, q, k, v, decay):
    qd, kd, vd = (x[:1].double() for x in (q, k, v))
    i = torch.arange(q.shape[2], device="cuda", dtype=torch.float64)
    dist = i[:, None] - i[None, :]
    lg = torch.log(decay.double())[:, None, None]
    m = torch.where(dist >= 0, torch.exp(lg * dist.clamp(min=0)), torch.zeros((), dtype=torch.float64, device="cuda"))
    ref = ((qd @ kd.transpose(-1, -2)) * m) @ vd
    return ((o[:1].double() - ref).norm() / ref.norm()).item()


for name in sys.argv[1:] or ["small", "mid", "long"]:
    b, h, n, d = SHAPES[name][0][:4]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g) / d ** 0.25 for _ in range(3))
    do = torch.randn(b, h, n, d, device="cuda", generator=g)
    decay = (1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))).float()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    trainable = decay.clone().requires_grad_()
    row = [f"{name} {(b, h, n, d)}"]
    for wg in (True, False):
        with chunk.override(wgmma=wg):
            fwd = back_to_back_ms(lambda: rtkernels.causal_linear_attention(q, k, v, decay, method="chunk",
                                                                            fp32_precision="tf32"), reps=20)
            err = error(rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", fp32_precision="tf32"),
                        q, k, v, decay) if n <= 4096 else float("nan")

            def step(dec):
                for x in leaves:
                    x.grad = None
                rtkernels.causal_linear_attention(*leaves, dec, method="chunk", fp32_precision="tf32").backward(do)

            fb = back_to_back_ms(lambda: step(decay), reps=10)
            tr = back_to_back_ms(lambda: step(trainable), reps=10)
        row.append(f"{'wgmma' if wg else 'mma.sync'}: fwd {fwd:.3f} ms (err {err:.2e}), fwd+bwd {fb:.3f}, trainable {tr:.3f}")
    print(" | ".join(row), flush=True)
