"""Scratch: the wgmma forward kernel with two or three chunk stages of q/k/v tiles
(``Overrides(stages=...)``), kernel time alone (CUDA-graph replay), rounds alternating between the
two, and the fixed-decay training step at mid; the outputs of both must be the same bits.

    python bench/profiling/time_stages.py
"""
import math
import statistics

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms, copy_bandwidth, graph_replay_ms
from rtkernels.methods import chunk

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128),
          "d64": (8, 16, 2048, 64), "mid-h16": (4, 16, 4096, 128)}
dev = torch.device("cuda")
bw = copy_bandwidth(dev, 1 << 30)
print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s")
print("| shape | dtype | 2 stages ms | 3 stages ms | 3 / 2 | % roofline (2 / 3) |")
print("|---|---|---:|---:|---:|---|")
for name, (b, h, n, d) in SHAPES.items():
    for dt in (torch.bfloat16, torch.float16):
        g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).to(dev)
        q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt) / d ** 0.25 for _ in range(3))

        def fwd():
            return rtkernels.causal_linear_attention(q, k, v, g, method="chunk")

        outs, times = {}, {2: [], 3: []}
        for st in (2, 3):
            with chunk.override(stages=st):
                outs[st] = fwd()
        same = torch.equal(outs[2], outs[3])
        for _ in range(3):
            for st in (2, 3):
                with chunk.override(stages=st):
                    times[st].append(graph_replay_ms(fwd, reps=20))
        t2, t3 = statistics.median(times[2]), statistics.median(times[3])
        ideal = 4 * q.numel() * q.element_size() / bw * 1e3
        print(f"| {name} {b}x{h}x{n}x{d} | {str(dt)[6:]} | {t2:.4f} | {t3:.4f} | {t3 / t2:.3f} | "
              f"{100 * ideal / t2:.0f} / {100 * ideal / t3:.0f} |" + ("" if same else " OUTPUTS DIFFER"))

for name in ("small", "d64", "mid"):  # the fixed-decay training step: every pass takes the stages
    b, h, n, d = SHAPES[name]
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).to(dev)
    leaves = [(torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) / d ** 0.25).requires_grad_()
              for _ in range(3)]
    do = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)

    def step():
        for x in leaves:
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, g, method="chunk").backward(do)

    steps = {2: [], 3: [], None: []}
    for _ in range(3):
        for st in steps:
            with chunk.override(stages=st):
                steps[st].append(back_to_back_ms(step, reps=20))
    print(f"{name} bf16 fwd+bwd (fixed decay, back to back ms): 2 stages {statistics.median(steps[2]):.3f}, "
          f"3 stages {statistics.median(steps[3]):.3f}, default {statistics.median(steps[None]):.3f}")
