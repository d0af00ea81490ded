"""Scratch: the split-sequence forward with the states pass in 1 (the default here), 2, 4 or 8 parts per segment
(``fold_parts`` forced; the default keeps the states CTAs within one wave), kernel time alone
(CUDA-graph replay, rounds alternating), per kernel (torch.profiler), against the one-part output.

    python bench/profiling/time_fold_parts.py
"""
import math
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import rtkernels
from rtkernels import call_cache
from rtkernels.cli.bench.timing import graph_replay_ms
from rtkernels.methods.chunk import launch, plan

SHAPES = {"long": (1, 32, 16384, 128), "h16-32k": (1, 16, 32768, 128), "h8-128k": (1, 8, 131072, 128),
          "d64-h8-64k": (2, 8, 65536, 64)}
PARTS = (None, 2, 4, 8)
default = plan.fold_parts


def forced(parts):
    def fp(seg_len, segments, tiles, sms):
        if parts is None or segments < 2:
            return default(seg_len, segments, tiles, sms)
        chunks = seg_len // plan.CHUNK_KERNEL
        return max(r for r in range(1, parts + 1) if chunks % r == 0)
    return fp


print(torch.cuda.get_device_name())
for name, (b, h, n, d) in SHAPES.items():
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25 for _ in range(3))

    def fwd():
        return rtkernels.causal_linear_attention(q, k, v, g, method="chunk")

    ref, times, kern = None, defaultdict(list), {}
    for rnd in range(3):
        for parts in PARTS:
            launch.fold_parts = forced(parts)
            call_cache.clear()
            out = fwd()
            if ref is None:
                ref = out.float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            times[parts].append(graph_replay_ms(fwd, reps=20))
            if rnd == 0:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fwd()
                    torch.cuda.synchronize()
                per = defaultdict(float)
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        per["states" if "states" in e.name else "fused"] += e.device_time_total / 5
                kern[parts] = (per, err)
    launch.fold_parts = default
    for parts in PARTS:
        per, err = kern[parts]
        print(f"{name} {b}x{h}x{n}x{d} parts {parts or 'default'}: {statistics.median(times[parts]):.4f} ms "
              f"(states {per['states']:.1f} us, fused {per['fused']:.1f} us), rel. diff {err:.1e}")
