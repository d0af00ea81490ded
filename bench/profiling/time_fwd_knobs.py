"""Scratch: the 16-bit forward's plan knobs on this GPU, kernel time alone (CUDA-graph replay, the
decay a float32 CUDA tensor), rounds alternating between the configs so that the card's drift
touches all alike; every config's output must be the same values as the default's up to the
rounding of its own state copy.

    python bench/profiling/time_fwd_knobs.py [--tma] [SHAPE ...]    (small, mid, long, d64; default mid)
"""
import math
import statistics
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import copy_bandwidth, graph_replay_ms
from rtkernels.methods import chunk

SHAPES = {"small": (2, 32, 1024, 128), "mid": (4, 32, 4096, 128), "long": (1, 32, 16384, 128),
          "d64": (8, 16, 2048, 64)}
KNOBS = {"default": {}, "cp.async and row copies": {"tma_io": False}, "stages 3": {"stages": 3},
         "bv 64": {"bv": 64}, "segments 2": {"segments": 2}}
if "--tma" in sys.argv:  # the TMA instance against the cp.async one only
    sys.argv.remove("--tma")
    KNOBS = {k: KNOBS[k] for k in ("default", "cp.async and row copies")}
dev = torch.device("cuda")
bw = copy_bandwidth(dev, 1 << 30)
print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s")
print("| shape | config | ms (rounds) | median | % roofline | max |diff| vs default |")
print("|---|---|---|---:|---:|---:|")
for name in sys.argv[1:] or ["mid"]:
    b, h, n, d = SHAPES[name]
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).to(dev)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) / d ** 0.25 for _ in range(3))

    def fwd():
        return rtkernels.causal_linear_attention(q, k, v, g, method="chunk")

    outs, times = {}, {kn: [] for kn in KNOBS}
    for kn, ch in KNOBS.items():
        with chunk.override(**ch):
            outs[kn] = fwd().float()
    for _ in range(6):
        for kn, ch in KNOBS.items():
            with chunk.override(**ch):
                times[kn].append(graph_replay_ms(fwd, reps=20))
    ideal = 4 * q.numel() * q.element_size() / bw * 1e3
    for kn in KNOBS:
        t = statistics.median(times[kn])
        diff = (outs[kn] - outs["default"]).abs().max().item()
        print(f"| {name} | {kn} | {', '.join(f'{x:.4f}' for x in times[kn])} | {t:.4f} | "
              f"{100 * ideal / t:.1f} | {diff:.2e} |", flush=True)
