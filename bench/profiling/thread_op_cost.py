"""Scratch: what small torch operations cost on the main thread, on a plain Python thread and inside
an autograd backward (autograd's device thread, where the chunk backward's host work runs), µs per
call, and a small allocation's cost right after the thread slept 1 ms (a cold core).

    python bench/profiling/thread_op_cost.py
"""
import statistics
import threading
import time

import torch

from rtkernels.autograd import backward_impl

x = torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)


def costs(n=200):
    clock, res = time.perf_counter_ns, {}
    ops = {"empty [4, 2, 32] fp32": lambda: torch.empty((4, 2, 32), dtype=torch.float32, device=x.device),
           "empty_like [4, 32, 4096, 128]": lambda: torch.empty_like(x),
           "data_ptr()": x.data_ptr, "stride()": x.stride, "backward_impl": lambda: backward_impl(x, x)}
    for name, op in ops.items():
        t = clock()
        for _ in range(n):
            op()
        res[name] = round((clock() - t) / n / 1e3, 2)
    cold = []
    for _ in range(20):
        time.sleep(0.001)
        t = clock()
        ops["empty [4, 2, 32] fp32"]()
        cold.append((clock() - t) / 1e3)
    res["empty after a 1 ms sleep"] = round(statistics.median(cold), 2)
    return res


print("main thread    ", costs())
plain: dict = {}
th = threading.Thread(target=lambda: plain.update(costs()))
th.start()
th.join()
print("plain thread   ", plain)


class Probe(torch.autograd.Function):
    seen: dict = {}

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        Probe.seen = costs()
        return g


a = x.clone().requires_grad_()
for _ in range(3):
    Probe.apply(a).backward(x)
print("autograd thread", Probe.seen)
