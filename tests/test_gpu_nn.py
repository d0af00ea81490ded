"""``rtkernels.nn.DecayingLinearAttention`` on a GPU (marker ``gpu``): forward against the fp64 model
of the layer (``test_nn_cpu.model_fp64``) in float32, bfloat16 and fp32 weights under bf16
autocast; prefill then ``step`` calls of T = 1 and T = 3 against a permuted pool (the decode
kernel) equal to forward on the whole sequence, with no host sync in ``step``; a trainable
decay's gradient on the device; ``examples/tiny_lm.py --smoke --device cuda``."""

from __future__ import annotations

import contextlib

import pytest
import torch

from test_nn_cpu import DIM, H, check_tiny_lm_smoke, inputs, make_layer, model_fp64
from tolerances import assert_close
from inputs import no_host_sync

pytestmark = pytest.mark.gpu

#: (parameter dtype, autocast): bf16 weights, fp32 weights, fp32 weights with bf16 matmuls.
MODES = [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)]
IDS = ["bf16", "fp32", "fp32-autocast"]


def context(autocast: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


def close(out: torch.Tensor, ref: torch.Tensor, sixteen_bit: bool, what: str) -> None:
    """fp32: the library's tolerances. 16-bit: every projection, norm and the attention output
    round to bfloat16 on the way (measured on the CPU's bf16 path: relative Frobenius <= 6.4e-3,
    max error <= 2.3e-2 of max |ref|), so twice the library's bf16 attention tolerances."""
    if not sixteen_bit:
        assert_close(out, ref, torch.float32, what)
        return
    o, r = out.detach().double(), ref.detach().double()
    assert torch.isfinite(o).all(), what
    fro = float((o - r).norm() / r.norm())
    mx = float((o - r).abs().max() / r.abs().max())
    assert fro <= 2.4e-2 and mx <= 5e-2, f"{what}: relative Frobenius {fro:.2e}, max {mx:.2e}"


@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("dtype, autocast", MODES, ids=IDS)
def test_forward_matches_the_fp64_model(dtype, autocast, trainable):
    layer = make_layer(dtype, device="cuda", trainable_decay=trainable, bias=True)
    x = inputs(2, 300, dtype, device="cuda")
    s0 = torch.randn(2, H, DIM // H, DIM // H, generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad(), context(autocast):
        y, state = layer(x, state=s0, return_state=True)
    ref, ref_state = model_fp64(layer, x, s0)
    sixteen = dtype == torch.bfloat16 or autocast
    assert state.dtype == torch.float32 and y.dtype == (torch.bfloat16 if sixteen else torch.float32)
    close(y, ref, sixteen, "output")
    close(state, ref_state, sixteen, "state")


@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("dtype, autocast", MODES, ids=IDS)
def test_prefill_then_steps_equal_forward_without_host_sync(dtype, autocast, trainable):
    b, prefill, sizes, slots = 3, 70, (1, 3, 1, 3, 2), 6
    layer = make_layer(dtype, device="cuda", trainable_decay=trainable)
    x = inputs(b, prefill + sum(sizes), dtype, device="cuda")
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    pool = torch.randn(slots, H, DIM // H, DIM // H, generator=torch.Generator().manual_seed(9)).cuda()
    spare = pool[[1, 3, 5]].clone()
    with context(autocast):
        for t in set(sizes):  # compile the kernels outside the sync check, on a scratch pool
            layer.step(x[:, :t], pool.clone(), state_indices=idx)
        out, state = layer(x[:, :prefill], return_state=True)
        pool[idx.long()] = state.detach()
        outs, t0 = [out.detach()], prefill
        with no_host_sync():
            for t in sizes:
                outs.append(layer.step(x[:, t0:t0 + t], pool, state_indices=idx))
                t0 += t
        with torch.no_grad():
            whole, final = layer(x, return_state=True)
    sixteen = dtype == torch.bfloat16 or autocast
    stepped = torch.cat(outs, 1)
    close(stepped, whole, sixteen, "steps vs forward")
    close(stepped, model_fp64(layer, x)[0], sixteen, "steps vs the fp64 model")
    close(pool[idx.long()], final, sixteen, "pool rows vs the final state")
    assert torch.equal(pool[[1, 3, 5]], spare)


def test_trainable_decay_gradient_on_the_device():
    layer = make_layer(torch.float32, device="cuda", trainable_decay=True, decay=[0.6, 0.95, 0.999])
    x = inputs(2, 200, torch.float32, device="cuda")
    w = torch.randn(2, 200, DIM, generator=torch.Generator().manual_seed(3)).cuda()
    (layer(x) * w).sum().backward()
    got = layer.log_decay_rate.grad.clone()
    layer.zero_grad()
    (model_fp64(layer, x)[0] * w).sum().backward()
    expected = layer.log_decay_rate.grad.double()
    err = float((got.double() - expected).norm() / expected.norm())
    assert err <= 1e-3, f"d loss / d log rate: relative error {err:.2e}"
    opt = torch.optim.Adam(layer.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        with context(True):
            layer(x).float().pow(2).mean().backward()
        opt.step()
    gamma = layer.decay()
    assert ((gamma > 0) & (gamma <= 1)).all(), gamma


def test_tiny_lm_smoke_on_cuda():
    check_tiny_lm_smoke("cuda", timeout=600)
