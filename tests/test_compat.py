"""rtkernels.compat.leetdecoding.causal_linear_decoder equals causal_linear_attention."""

import pytest
import torch

import rtkernels
from rtkernels.compat.leetdecoding import METHOD_MAP, causal_linear_decoder

NAMES = [m for m in METHOD_MAP if m is not None] + [None]


def _qkv(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 3, 77, 24, generator=g) / 5 for _ in range(2))
    v = torch.randn(2, 3, 77, 40, generator=g)
    return tuple(x.to(device, dtype) for x in (q, k, v))


def _check(device, dtype):
    q, k, v = _qkv(device, dtype)
    gamma = torch.tensor([0.05, 0.5, 1.3], device=device)  # rates for is_need_exp=True
    factors = torch.tensor([0.3, 0.9, 1.0], device=device)
    for name in NAMES:
        ours = METHOD_MAP[name]
        ours = "auto" if ours == "auto" else ours
        got = causal_linear_decoder(q, k, v, True, gamma, True, name)
        want = rtkernels.causal_linear_attention(q, k, v, decay_rate=gamma, method=ours)
        assert got.dtype == dtype and torch.equal(got, want), name
        got = causal_linear_decoder(q, k, v, True, factors, False, name)
        want = rtkernels.causal_linear_attention(q, k, v, decay=factors, method=ours)
        assert torch.equal(got, want), name
        got = causal_linear_decoder(q, k, v, attn_method=name)
        want = rtkernels.causal_linear_attention(q, k, v, method=ours)
        assert torch.equal(got, want), name
    # the two gamma conventions agree where they should: rate r == factor exp(-r)
    a = causal_linear_decoder(q, k, v, True, gamma, True, "vanilla")
    b = causal_linear_decoder(q, k, v, True, torch.exp(-gamma), False, "vanilla")
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 1e-2  # exp(-r) rounds differently
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_compat_cpu():
    _check("cpu", torch.float32)
    _check("cpu", torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compat_gpu(dtype):
    _check("cuda", dtype)


def test_compat_errors():
    q, k, v = _qkv("cpu")
    with pytest.raises(ValueError, match="gamma.*is_mask_weight=True"):
        causal_linear_decoder(q, k, v, False, torch.ones(3))
    with pytest.raises(ValueError, match="is_mask_weight=True needs gamma"):
        causal_linear_decoder(q, k, v, True, None)
    with pytest.raises(ValueError, match="attn_method must be"):
        causal_linear_decoder(q, k, v, attn_method="lightningAttention3")
    with pytest.raises(ValueError, match="decay_rate"):
        causal_linear_decoder(q, k, v, True, torch.tensor([-1.0, 0.1, 0.1]), True)
    with pytest.raises(ValueError, match="decay"):
        causal_linear_decoder(q, k, v, True, torch.tensor([0.0, 0.1, 0.1]), False)
