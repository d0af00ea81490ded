"""Scratch: where a training step's time goes without a profiler attached (bf16, decay a CUDA
tensor, q, k, v requiring grad), the fixed and the trainable step interleaved as the bench times
them (L2 flushed, GPU idle, then start event, call, backward, end event). CUDA events split each
step into: the forward (start to the event recorded after the call, which fires when the forward's
kernels finish), the wait before the backward's first launch (to an event recorded just before it:
it fires at the later of the forward's end and the host reaching that launch, so it measures how
long the GPU sat idle waiting for the host), and the backward (from there to the end). Medians.

    python bench/profiling/step_phases.py [small|mid|long] [--steps N]

Session 39 (H200, mid) with it: the trainable step waited 28 µs before its first backward launch
against the fixed step's 23; the rest of the difference was the backward's kernels.
"""
import statistics
import sys

import torch

import rtkernels
from rtkernels.cli.bench.harness import SHAPES
from rtkernels.methods.chunk import launch

name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in SHAPES else "mid"
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 250
b, h, n, d = SHAPES[name][0][:4]
leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
decays = {t: (1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))).requires_grad_(t) for t in (False, True)}
events: list[torch.cuda.Event] = []


def record() -> None:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    events.append(e)


launch_pass = launch.launch_pass


def first_launch_marked(*args, **kwargs):
    if len(events) == 2:  # the backward's first pass (a planned backward replays through here)
        record()
    return launch_pass(*args, **kwargs)


launch.launch_pass = first_launch_marked


def step(trainable: bool) -> None:
    for x in leaves:
        x.grad = None
    decays[trainable].grad = None
    record()
    out = rtkernels.causal_linear_attention(*leaves, decays[trainable], method="chunk")
    record()
    out.backward(do)
    record()


phases: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
for i in range(steps + 10):
    for trainable in (False, True):
        flush.zero_()
        torch.cuda.synchronize()
        events.clear()
        step(trainable)
        torch.cuda.synchronize()
        if i >= 10 and len(events) == 4:  # after warm-up; 4: the backward went through launch_pass
            e0, e1, e2, e3 = events
            phases[trainable].append((e0.elapsed_time(e1), e1.elapsed_time(e2), e2.elapsed_time(e3), e0.elapsed_time(e3)))
print(f"{name} {(b, h, n, d)} bf16, µs, median of {steps} steps each, interleaved")
for trainable in (False, True):
    fwd, wait, bwd, total = (statistics.median(c) * 1000 for c in zip(*phases[trainable]))
    print(f"{'trainable' if trainable else 'fixed    '}: forward {fwd:6.1f} | wait before the backward's first launch "
          f"{wait:6.1f} | backward {bwd:6.1f} | step {total:6.1f} ({len(phases[trainable])} steps)")
