"""Which packed calls the chunk kernels take (``rtkernels.methods.chunk.packed.takes``), on the CPU
with the GPU-side checks patched: a decay without autograd history wherever the kernel runs; a
trainable one only where the backward's dq pass sums dlog(gamma) and Dv keeps a contiguous output
gradient's rows 16-byte aligned. The GPU tests (tests/test_gpu_varlen.py) check the answers."""

from __future__ import annotations

import pytest
import torch

from rtkernels.decay import LogDecay
from rtkernels.methods.chunk import decay_grad, packed


def _views(n: int, dk: int, dv: int):
    return (torch.zeros(1, 2, n, dk), torch.zeros(1, 2, n, dk), torch.zeros(1, 2, n, dv))


def _decay(trainable: bool) -> LogDecay:
    ld = LogDecay(torch.device("cpu"), host=(-0.1, -0.2))
    if trainable:
        ld.source = torch.zeros(2, requires_grad=True)
    return ld


@pytest.mark.parametrize("kernel, sums, dv, trainable, want", [
    (True, True, 96, False, True),
    (True, False, 96, False, True),    # a fixed decay: whatever the dq pass could do
    (True, True, 96, True, True),
    (True, False, 96, True, False),    # fp16, other GPUs, unaligned rows: the torch path
    (True, True, 44, True, False),     # Dv not a multiple of 8: a contiguous dL/do row is not 16-byte aligned
    (False, True, 96, False, False),   # no kernel for these inputs at all
])
def test_takes(monkeypatch, kernel, sums, dv, trainable, want):
    seen = []
    monkeypatch.setattr(packed, "kernel_runs", lambda *a: kernel)
    monkeypatch.setattr(packed, "dq_pass_sums", lambda *a: seen.append(a[4]) or sums)
    assert packed.takes(*_views(100, 64, dv), _decay(trainable)) is want
    assert all(g is None for g in seen)  # asked without a final-state gradient: it is no obstacle


def test_no_tokens_never_take_the_kernels(monkeypatch):
    monkeypatch.setattr(packed, "kernel_runs", lambda *a: True)
    assert not packed.takes(*_views(0, 64, 64), _decay(False))


def test_partial_sums_have_a_row_per_sequence():
    q, _, v = _views(300, 200, 40)
    assert decay_grad._partials_shape(q, v, sequences=7) == (7, 4, 2)  # Dk 200: four tiles of 64
