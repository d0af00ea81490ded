"""``rtkernels.nn.DecayingLinearAttention`` on the CPU: shapes and dtypes; forward against an fp64
model of the layer written here (the attention core from ``reference.py``); prefill then ``step``
calls of T = 1 and T = 3 against a permuted pool equal to forward on the whole sequence; a
trainable decay's gradient against autograd through the fp64 model, and its range after
optimizer steps; the options off; bad arguments; the import layering; ``examples/tiny_lm.py
--smoke`` end to end."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference import reference
from tolerances import assert_close
from rtkernels.nn import DecayingLinearAttention, retnet_decay

REPO = Path(__file__).resolve().parents[1]
DIM, H = 24, 3


def make_layer(dtype=torch.float32, seed=0, device="cpu", **kw) -> DecayingLinearAttention:
    """A layer with seeded weights (the same on every device); also used by test_gpu_nn.py."""
    torch.manual_seed(seed)
    layer = DecayingLinearAttention(DIM, H, dtype=dtype, **kw)
    with torch.no_grad():  # non-trivial norm affine and biases, so a wrong formula shows
        for name, p in layer.named_parameters():
            if name.startswith("norm.") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return layer.to(device)


def inputs(b, n, dtype=torch.float32, seed=1, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, DIM, generator=g, dtype=torch.float64).to(device, dtype)


def model_fp64(layer: DecayingLinearAttention, x: torch.Tensor, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer in float64 from its own weights: projections, ``reference`` for the attention
    core, a per-head normalization over Dv, the swish gate and the output projection."""
    b, n, _ = x.shape
    h, dk, dv = layer.num_heads, layer.head_dim_k, layer.head_dim_v

    def linear(mod, t):
        y = t @ mod.weight.double().t()
        return y if mod.bias is None else y + mod.bias.double()

    proj = linear(layer.in_proj, x.double())
    q = proj[..., :h * dk].reshape(b, n, h, dk)
    k = proj[..., h * dk:2 * h * dk].reshape(b, n, h, dk)
    v = proj[..., 2 * h * dk:2 * h * dk + h * dv].reshape(b, n, h, dv)
    gamma = torch.exp(-layer.rates().double())
    o, final = reference(q, k, v, gamma, layer.scale, layout="bnhd", initial_state=state)
    if layer.norm is not None:
        mean = o.mean(-1, keepdim=True)
        var = ((o - mean) ** 2).mean(-1, keepdim=True)
        o = (o - mean) / torch.sqrt(var + layer.norm.eps)
        o = o * layer.norm.weight.double().view(h, dv) + layer.norm.bias.double().view(h, dv)
    o = o.reshape(b, n, h * dv)
    if layer.output_gate:
        gate = proj[..., 2 * h * dk + h * dv:]
        o = o * gate * torch.sigmoid(gate)
    return linear(layer.out_proj, o), final


# ---------------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_shape_and_dtype(dtype):
    layer = make_layer(dtype)
    x = inputs(2, 9, dtype)
    y, state = layer(x, return_state=True)
    assert y.shape == (2, 9, DIM) and y.dtype == dtype
    assert state.shape == (2, H, DIM // H, DIM // H)
    assert state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert layer(x).shape == (2, 9, DIM)
    assert layer.init_state(4).shape == (4, H, DIM // H, DIM // H) and layer.init_state(4).dtype == torch.float32


OPTIONS = [
    {},
    {"head_dim_k": 5, "head_dim_v": 7, "bias": True},
    {"group_norm": False},
    {"output_gate": False},
    {"group_norm": False, "output_gate": False, "decay": 0.8, "scale": 0.3},
    {"trainable_decay": True, "decay": [0.5, 0.9, 0.99]},
    {"decay": 1.0, "method": "scan"},
]


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_matches_the_fp64_model(kw, dtype):
    layer = make_layer(dtype, **kw)
    x = inputs(2, 70, dtype)  # longer than one 64-token chunk
    s0 = torch.randn(2, H, layer.head_dim_k, layer.head_dim_v, generator=torch.Generator().manual_seed(5))
    s0 = s0.to(torch.float64 if dtype == torch.float64 else torch.float32)
    with torch.no_grad():
        y, state = layer(x, state=s0, return_state=True)
        ref, ref_state = model_fp64(layer, x, s0)
    assert_close(y, ref, dtype, f"output {kw}")
    assert_close(state, ref_state, dtype, f"state {kw}")


def test_options_change_the_structure():
    plain = DecayingLinearAttention(DIM, H, group_norm=False, output_gate=False)
    assert plain.norm is None and plain.in_proj.out_features == 3 * DIM
    assert DecayingLinearAttention(DIM, H).in_proj.out_features == 4 * DIM
    assert DecayingLinearAttention(DIM, H, head_dim_k=4, head_dim_v=6).in_proj.out_features == H * (4 + 4 + 6 + 6)
    default = DecayingLinearAttention(DIM, H)
    assert torch.allclose(default.decay().double(), retnet_decay(H), rtol=0, atol=1e-7)
    assert default.scale == pytest.approx((DIM // H) ** -0.5)


def test_forward_continues_from_a_state():
    layer = make_layer()
    x = inputs(2, 40)
    with torch.no_grad():
        whole = layer(x)
        first, s = layer(x[:, :17], return_state=True)
        second = layer(x[:, 17:], state=s)
    assert_close(torch.cat([first, second], 1), whole.double(), torch.float32, "split forward")


# ------------------------------------------------------------------------------------------ step

@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefill_then_steps_equal_forward(dtype, trainable):
    """Prefill 5 tokens, then steps of 1, 3, 1, 3, 2 tokens from a pool whose rows are permuted
    (state_indices) and whose other rows must stay untouched."""
    b, prefill, sizes, slots = 3, 5, (1, 3, 1, 3, 2), 6
    layer = make_layer(dtype, trainable_decay=trainable)  # trainable: step runs in grad mode
    x = inputs(b, prefill + sum(sizes), dtype)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pool = torch.randn(slots, H, DIM // H, DIM // H, generator=torch.Generator().manual_seed(9)).to(pool_dtype)
    spare = pool[[1, 3, 5]].clone()

    out, state = layer(x[:, :prefill], return_state=True)
    pool[idx.long()] = state.detach()
    outs, t0 = [out.detach()], prefill
    for t in sizes:
        o = layer.step(x[:, t0:t0 + t], pool, state_indices=idx)
        assert o.shape == (b, t, DIM) and o.dtype == dtype and not o.requires_grad
        outs.append(o)
        t0 += t
    with torch.no_grad():
        whole, final = layer(x, return_state=True)
        ref, ref_final = model_fp64(layer, x)
    stepped = torch.cat(outs, 1)
    assert_close(stepped, whole.double(), dtype, "steps vs forward")
    assert_close(stepped, ref, dtype, "steps vs the fp64 model")
    assert_close(pool[idx.long()], final, dtype, "pool rows vs the final state")
    assert_close(pool[idx.long()], ref_final, dtype, "pool rows vs the fp64 model")
    assert torch.equal(pool[[1, 3, 5]], spare)


def test_step_without_indices_uses_row_b():
    layer = make_layer()
    x = inputs(2, 6)
    pool = layer.init_state(2)
    outs = [layer.step(x[:, i:i + 1], pool) for i in range(6)]
    with torch.no_grad():
        whole, final = layer(x, return_state=True)
    assert_close(torch.cat(outs, 1), whole.double(), torch.float32, "token by token")
    assert_close(pool, final.double(), torch.float32, "pool")


# ----------------------------------------------------------------------------- trainable decay

def test_trainable_decay_gradient_matches_autograd_of_the_fp64_model():
    layer = make_layer(torch.float64, trainable_decay=True, decay=[0.6, 0.95, 0.999])
    x = inputs(2, 70, torch.float64)
    w = torch.randn(2, 70, DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (layer(x) * w).sum().backward()
    got = layer.log_decay_rate.grad.clone()
    layer.zero_grad()
    (model_fp64(layer, x)[0] * w).sum().backward()  # autograd through reference()'s log(gamma)
    expected = layer.log_decay_rate.grad
    assert torch.isfinite(got).all() and got.abs().min() > 0
    assert_close(got, expected, torch.float64, "d loss / d log rate")


def test_trainable_decay_stays_in_range_after_optimizer_steps():
    layer = make_layer(trainable_decay=True)
    x = inputs(2, 20)
    opt = torch.optim.Adam(layer.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        layer(x).pow(2).mean().backward()
        assert layer.log_decay_rate.grad is not None and torch.isfinite(layer.log_decay_rate.grad).all()
        opt.step()
        gamma = layer.decay()
        assert ((gamma > 0) & (gamma <= 1)).all(), gamma
    # a wild step either way: the rate stays finite and >= 0 (gamma in (0, 1]), and the layer runs
    with torch.no_grad():
        layer.log_decay_rate.copy_(torch.tensor([1e6, -1e6, 0.0]))
    rates = layer.rates()
    assert torch.isfinite(rates).all() and (rates >= 0).all()
    assert torch.isfinite(layer(x)).all()


# -------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw, name", [
    ({"dim": 0}, "dim"),
    ({"num_heads": 0}, "num_heads"),
    ({"dim": 10, "num_heads": 3}, "num_heads"),
    ({"head_dim_k": 0}, "head_dim_k"),
    ({"head_dim_v": -2}, "head_dim_v"),
    ({"decay": 1.5}, "decay"),
    ({"decay": 0.0}, "decay"),
    ({"decay": math.nan}, "decay"),
    ({"decay": [0.9, 0.9]}, "decay"),
    ({"decay": 1.0, "trainable_decay": True}, "trainable_decay"),
    ({"scale": math.inf}, "scale"),
    ({"method": "fastest"}, "method"),
])
def test_bad_constructor_values(kw, name):
    args = {"dim": DIM, "num_heads": H, **kw}
    with pytest.raises(ValueError, match=name):
        DecayingLinearAttention(**args)


@pytest.mark.parametrize("kw, name", [
    ({"dim": 2.5}, "dim"), ({"num_heads": "3"}, "num_heads"), ({"decay": "0.9"}, "decay"),
    ({"group_norm": 1}, "group_norm"), ({"method": None}, "method"), ({"scale": "1"}, "scale"),
])
def test_bad_constructor_types(kw, name):
    with pytest.raises(TypeError, match=name):
        DecayingLinearAttention(**{"dim": DIM, "num_heads": H, **kw})


def test_bad_x():
    layer = make_layer()
    with pytest.raises(ValueError, match="x must"):
        layer(torch.randn(2, DIM))
    with pytest.raises(ValueError, match="x must"):
        layer(torch.randn(2, 3, DIM + 1))
    with pytest.raises(ValueError, match="x must"):
        layer.step(torch.randn(2, DIM), layer.init_state(2))


# ------------------------------------------------------------------------------------------ layout

def test_nn_imports_only_the_public_modules_and_nothing_imports_it():
    from test_imports import cycles, import_graph

    g = import_graph()
    assert g["rtkernels.nn"] <= {"rtkernels.api", "rtkernels.decode"}, g["rtkernels.nn"]
    assert not [m for m, deps in g.items() if "rtkernels.nn" in deps]
    assert cycles(g) == []


# ------------------------------------------------------------------------------------------ example

def check_tiny_lm_smoke(device: str, timeout: float) -> None:
    """``examples/tiny_lm.py --smoke`` on ``device`` learns and generates; also used by test_gpu_nn.py."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, str(REPO / "examples" / "tiny_lm.py"), "--smoke", "--device", device],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = re.search(r"first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+)", res.stdout)
    assert m, res.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last < first - 0.5, (first, last)
    assert "generation check passed" in res.stdout


def test_tiny_lm_smoke():
    check_tiny_lm_smoke("cpu", timeout=120)
