"""Scratch: the chunk stages of the states pass's Hopper instance (``rtk_chunk_states`` by tensor
copies and wgmma): the kernel's own time (torch.profiler) and the forward replayed from a CUDA
graph, with ``states_config``'s stage count replaced for the TMA instances (a template argument:
each count is its own instance), counts alternating over three rounds; outputs against the
default count's. ``--train``: the states kernels of a training step with a trainable decay
instead (the forward's, the dk pass's and the DLOG instance of the dq pass), and the step's time.

    python bench/profiling/time_states_stages.py [--train] [counts ...]
"""
import math
import statistics
import sys
from collections import defaultdict

import torch

import rtkernels
from rtkernels import call_cache
from rtkernels.cli.bench.timing import back_to_back_ms, graph_replay_ms, kernel_us
from rtkernels.methods.chunk import backward, launch
from rtkernels.methods.chunk.plan import states_smem_bytes

SHAPES = {"long": (1, 32, 16384, 128), "h8-128k": (1, 8, 131072, 128), "d64-h8-64k": (2, 8, 65536, 64),
          "d256-h8-16k": (1, 8, 16384, 256)}
TRAIN = "--train" in sys.argv
COUNTS = [int(c) for c in sys.argv[1:] if c != "--train"] or [3, 4, 5, 6]
real = launch.states_config
count = None


def patched(*args, **kwargs):
    config = real(*args, **kwargs)
    tma = len(config) > 6 and config[6]
    fits = count is not None and states_smem_bytes(config[1], config[2], count, True) <= 227 * 1024
    return config[:4] + (count,) + config[5:] if tma and fits else config  # else the default count


launch.states_config = patched


print(torch.cuda.get_device_name())
what = "states µs, trainable step ms" if TRAIN else "states µs, fwd graph ms"
print("| shape | " + " | ".join(f"{c} stages: {what}" for c in COUNTS) + " | max rel diff |")
print("|---|" + "---|" * len(COUNTS) + "---|")
for name, (b, h, n, d) in SHAPES.items():
    g = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) / d ** 0.25 for _ in range(3))

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    gp = torch.nn.Parameter(g.clone())
    do = torch.randn_like(v)

    def fwd():
        return rtkernels.causal_linear_attention(q, k, v, g, method="chunk")

    def step():
        for x in (*leaves, gp):
            x.grad = None
        rtkernels.causal_linear_attention(*leaves, gp, method="chunk").backward(do)
        return gp.grad

    times, outs = defaultdict(lambda: defaultdict(list)), {}
    for rnd in range(3):
        for c in COUNTS:
            count = c
            call_cache.clear()
            backward.clear_plans()
            if rnd == 0:
                outs[c] = step().clone() if TRAIN else fwd()
            times[c]["states"].append(kernel_us(step if TRAIN else fwd, "rtk_chunk_states"))
            times[c]["graph"].append(back_to_back_ms(step, reps=10) if TRAIN else graph_replay_ms(fwd, reps=20))
    base = outs[COUNTS[0]].float()
    diff = max(((o.float() - base).abs().max() / base.abs().max()).item() for o in outs.values())
    cells = [f"{statistics.median(times[c]['states']):.1f}, {statistics.median(times[c]['graph']):.4f}" for c in COUNTS]
    print(f"| {name} {(b, h, n, d)} | " + " | ".join(cells) + f" | {diff:.1e} |", flush=True)
