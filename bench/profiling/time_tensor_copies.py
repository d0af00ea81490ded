"""Scratch: the states pass (``rtk_chunk_states``) in its Hopper instance (tiles by tensor copies,
the state on wgmma: the default with aligned rows) against cp.async and mma.sync
(``Overrides(tensor_copies=False)``), on split shapes: the forward replayed from a CUDA graph, the
states kernel's own time (torch.profiler), and training steps back to back with a fixed and a
trainable decay, rounds alternating; the largest difference between the two ways' outputs and
gradients, relative to each tensor's largest value (0 on an H100: the same bits).

    python bench/profiling/time_tensor_copies.py
"""
import math
import statistics
from collections import defaultdict

import torch

import rtkernels
from rtkernels import call_cache
from rtkernels.cli.bench.timing import back_to_back_ms, graph_replay_ms, kernel_us
from rtkernels.methods.chunk import backward, override

SHAPES = {"long": (1, 32, 16384, 128, "bhnd"), "long-bnhd": (1, 32, 16384, 128, "bnhd"),
          "h16-32k": (1, 16, 32768, 128, "bhnd"), "h8-128k": (1, 8, 131072, 128, "bhnd"),
          "d64-h8-64k": (2, 8, 65536, 64, "bhnd"), "d256-h8-16k": (1, 8, 16384, 256, "bhnd")}


print(torch.cuda.get_device_name())
print("| shape | fwd graph ms (cp.async / tensor) | states µs | step fixed ms | step trainable ms | max rel diff |")
print("|---|---|---|---|---|---|")
for name, (b, h, n, d, layout) in SHAPES.items():
    shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    gp = torch.nn.Parameter(g.clone())
    leaves = [(torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / d ** 0.25).requires_grad_()
              for _ in range(3)]
    do = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.detach() for x in leaves)

    def fwd():
        return rtkernels.causal_linear_attention(q, k, v, g, method="chunk", layout=layout)

    def step(decay):
        for x in (*leaves, gp):
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, decay, method="chunk", layout=layout).backward(do)

    times, outs = defaultdict(lambda: defaultdict(list)), {}
    for rnd in range(3):
        for tma in (False, True):
            with override(tensor_copies=tma):
                call_cache.clear()
                backward.clear_plans()
                if rnd == 0:
                    step(gp)
                    outs[tma] = [fwd()] + [x.grad.clone() for x in (*leaves, gp)]
                t = times[tma]
                t["graph"].append(graph_replay_ms(fwd, reps=20))
                t["states"].append(kernel_us(fwd, "rtk_chunk_states"))
                t["fixed"].append(back_to_back_ms(lambda: step(g), reps=10))
                t["train"].append(back_to_back_ms(lambda: step(gp), reps=10))
    same = max(((a.float() - b_.float()).abs().max() / b_.float().abs().max()).item()
               for a, b_ in zip(outs[False], outs[True]))
    med = {tma: {key: statistics.median(vals) for key, vals in t.items()} for tma, t in times.items()}
    off, on = med[False], med[True]
    print(f"| {name} {shape} | {off['graph']:.4f} / {on['graph']:.4f} | {off['states']:.1f} / {on['states']:.1f} | "
          f"{off['fixed']:.3f} / {on['fixed']:.3f} | {off['train']:.3f} / {on['train']:.3f} | {same:.1e} |", flush=True)
