"""Scratch: the host's timeline of one training step (bf16, decay a CUDA tensor, fixed or trainable):
microseconds from the step's start to each event (the call, the autograd Function's forward and
backward, each kernel launch, backward() returning), the median over 30 steps, the GPU idle and the
L2 flushed before each step as the bench times it. Shows where the host time between the forward's
launch and the backward's first launch goes.

    python bench/profiling/host_timeline.py [small|mid|long] [--trainable] [--detail] [--cprofile]

``--detail``: also the chunk backward's steps (its plan key, the passes, each pass's launch).
"""
import statistics
import sys
import threading
import time

import torch

import rtkernels
from rtkernels import autograd
from rtkernels.cli.bench.harness import SHAPES
from rtkernels.jit import jit

name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in SHAPES else "mid"
trainable = "--trainable" in sys.argv
b, h, n, d = SHAPES[name][0][:4]
leaves = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
decay = (1 - torch.exp(torch.linspace(-3.5, -6.2, h, device="cuda"))).requires_grad_(trainable)
do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
events: list[tuple[str, int, int]] = []
clock = time.perf_counter_ns


def mark(what: str) -> None:
    events.append((what, clock(), threading.get_ident()))


def wrap(owner, attr, label):
    fn = getattr(owner, attr)

    def wrapped(*a, **kw):
        mark(label + " in")
        try:
            return fn(*a, **kw)
        finally:
            mark(label + " out")
    setattr(owner, attr, wrapped)


bound_call, kernel_launch = jit.BoundLaunch.__call__, jit.Kernel.launch


def timed_bound(self, *head):
    mark(f"launch, grid {self.grid}")
    return bound_call(self, *head)


def timed_kernel(self, grid, *a, **kw):
    mark(f"launch, grid {grid}")
    return kernel_launch(self, grid, *a, **kw)


jit.BoundLaunch.__call__, jit.Kernel.launch = timed_bound, timed_kernel
wrap(autograd, "call_gradients", "call_gradients")
if "--detail" in sys.argv:  # the chunk backward's own steps
    from rtkernels.methods.chunk import backward, decay_grad, launch
    wrap(backward, "_plan_key", "plan key")
    wrap(backward, "gradient_passes", "gradient_passes")
    wrap(launch, "launch_pass", "launch_pass")
    wrap(decay_grad.PartialSums, "buffer", "partial sums buffer")
    wrap(decay_grad.PartialSums, "total", "partial sums total")
impls = autograd.BACKWARD_IMPLS
impls[0] = (impls[0][0], (lambda f: (lambda *a, **kw: (mark("backward impl in"), f(*a, **kw), mark("backward impl out"))[1]))(impls[0][1]))

def step():
    for x in leaves:
        x.grad = None
    decay.grad = None
    mark("call")
    out = rtkernels.causal_linear_attention(*leaves, decay, method="chunk")
    mark("call returned")
    out.backward(do)
    mark("backward() returned")


for _ in range(5):
    step()
runs: list[list[tuple[str, int, int]]] = []
for _ in range(30):
    flush.zero_()
    torch.cuda.synchronize()
    events.clear()
    step()
    torch.cuda.synchronize()
    runs.append(list(events))
main = threading.get_ident()
print(f"{name} {(b, h, n, d)} trainable={trainable}: µs from the step's start (median of 30); * = another thread")
for i, (what, _, tid) in enumerate(runs[0]):
    ts = [(r[i][1] - r[0][1]) / 1e3 for r in runs if len(r) == len(runs[0])]
    print(f"{statistics.median(ts):8.1f}  {'*' if tid != main else ' '} {what}")

if "--cprofile" in sys.argv:  # where the host time of the backward goes (its own thread) and of the call
    import cProfile
    import pstats

    prof = cProfile.Profile()
    inner = autograd.call_gradients

    def profiled(*a, **kw):
        prof.enable()
        try:
            return inner(*a, **kw)
        finally:
            prof.disable()
    autograd.call_gradients = profiled
    call_prof = cProfile.Profile()
    for _ in range(200):
        for x in leaves:
            x.grad = None
        decay.grad = None
        call_prof.enable()
        out = rtkernels.causal_linear_attention(*leaves, decay, method="chunk")
        call_prof.disable()
        out.backward(do)
        torch.cuda.synchronize()
    for title, p in (("backward (call_gradients), 200 steps", prof), ("the call, 200 steps", call_prof)):
        print("====", title)
        pstats.Stats(p).sort_stats("tottime").print_stats(22)
