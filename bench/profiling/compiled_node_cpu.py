"""Scratch: the compiled entry's host time a call on a CPU machine, without and with autograd
history, through its CPU copy (tests/compiled_cpu_copy.py: CPU tensors, no launch;
tests/test_compiled_node_cpu.py checks that copy's gradients).

    python bench/profiling/compiled_node_cpu.py
"""
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from compiled_cpu_copy import build_cpu_copy, register  # noqa: E402

ext = build_cpu_copy()
B, H, N, D = 2, 3, 70, 16
q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
gamma = torch.nn.Parameter(torch.tensor([0.9, 0.99, 0.5], dtype=torch.float64))
n = 20000
with torch.no_grad():
    plain = (q, k, v, gamma.detach(), None, 1.0, "chunk", "bhnd", None, False, "exact")
    assert register(ext, plain, v, grad=False)
    t0 = min(timeit.repeat(lambda: ext.call(*plain), number=n, repeat=5)) / n * 1e6
tracked = (*(x.clone().requires_grad_() for x in (q, k, v)), gamma, None, 1.0, "chunk", "bhnd", None, False, "exact")
assert register(ext, tracked, v)
t1 = min(timeit.repeat(lambda: ext.call(*tracked), number=n, repeat=5)) / n * 1e6
print(f"host µs a call on this machine (CPU tensors, no launch): {t0:.2f} without autograd, {t1:.2f} with it")
