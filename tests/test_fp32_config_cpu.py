"""fp32 on the chunk kernel, the parts that need no GPU: how ``fp32_precision`` is resolved and
passed on, and which ``rtk_chunk_fwd_f32`` configuration each device and head size gets."""

import pytest
import torch

import rtkernels
import rtkernels.api as api
from rtkernels.methods import chunk, kernel_instances

from inputs import make_qkv

Q, K, V = make_qkv(0, 2, 3, 5, 4, 6, torch.float32)


@pytest.fixture
def captured(monkeypatch):
    """The fp32_precision each call hands to run_method (the computation itself is skipped)."""
    seen = []

    def fake_run_method(name, q, k, v, log_decay, scale, out, s0, need_state, torch_only, fp32_precision):
        seen.append(fp32_precision)
        out.zero_()
        return None

    monkeypatch.setattr(api, "run_method", fake_run_method)
    before = torch.get_float32_matmul_precision()
    yield seen
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("setting, expected", [("highest", "exact"), ("high", "tf32"), ("medium", "tf32")])
def test_default_follows_torch_matmul_precision(captured, setting, expected):
    torch.set_float32_matmul_precision(setting)
    rtkernels.causal_linear_attention(Q, K, V, 0.9)
    rtkernels.causal_linear_attention(Q, K, V, 0.9, fp32_precision=None, method="chunk")
    assert captured == [expected, expected]


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
def test_explicit_precision_overrides_torch(captured, setting):
    torch.set_float32_matmul_precision(setting)
    rtkernels.causal_linear_attention(Q, K, V, 0.9, fp32_precision="exact")
    rtkernels.causal_linear_attention(Q, K, V, 0.9, fp32_precision="tf32", method="scan")
    assert captured == ["exact", "tf32"]


def test_precision_changes_nothing_on_the_torch_paths():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        q, k, v = (x.to(dtype) for x in (Q, K, V))
        runs = [rtkernels.causal_linear_attention(q, k, v, 0.9, fp32_precision=p) for p in (None, "exact", "tf32")]
        assert all(torch.equal(runs[0], r) for r in runs[1:])


# ---- configurations ------------------------------------------------------------------------------

H200, A100, SM89 = chunk.SMEM_LIMIT_SM90, *chunk.SMEM_LIMITS_OTHER


@pytest.mark.parametrize("limit, dk, dv, expected", [
    (H200, 16, 40, (64, 64, 2)), (H200, 40, 16, (64, 32, 2)), (H200, 96, 128, (128, 64, 2)),
    (H200, 128, 7, (128, 32, 2)), (H200, 129, 256, (256, 32, 1)), (H200, 256, 1, (256, 32, 1)),
    (A100, 64, 64, (64, 64, 2)), (A100, 128, 128, (128, 64, 1)), (A100, 100, 20, (128, 32, 1)),
    (A100, 256, 64, None),
    (SM89, 64, 64, (64, 32, 2)), (SM89, 128, 128, (128, 32, 1)), (SM89, 200, 8, None),
])
def test_f32_config_fits_the_device(limit, dk, dv, expected):
    tile = chunk.f32_config(dk, dv, limit)
    assert tile == expected
    if tile is not None:
        assert chunk.smem_bytes(tile[0], tile[1], torch.float32, tile[2]) <= limit


def test_f32_smem_bytes():
    # q, k tiles 64 x (KMAX + 4), v tile 64 x (BV + 4) per stage, state copy KMAX x (BV + 8), floats
    assert chunk.smem_bytes(128, 64, torch.float32, 2) == 4 * (2 * (2 * 64 * 132 + 64 * 68) + 128 * 72)
    assert chunk.smem_bytes(256, 32, torch.float32, 1) == 4 * (2 * 64 * 260 + 64 * 36 + 256 * 40)
    assert chunk.smem_bytes(128, 64, torch.float32, 2) <= 227 * 1024


def test_f32_instances_are_compiled_by_the_compile_test():
    names = kernel_instances()["chunk.cu"]
    for limit in (H200, A100, SM89):
        for dk in (1, 64, 65, 128, 129, 256):
            for dv in (1, 32, 33, 256):
                for exact in (False, True):
                    for vec in (False, True):
                        config = chunk.kernel_config(torch.float32, dk, dv, vec, exact=exact, smem_limit=limit)
                        if config is not None:
                            assert chunk.name_expression(config) in names
    assert "rtk_chunk_fwd_f32<128, 64, 2, true, true, 1>" in names
    assert "rtk_chunk_fwd_f32<256, 32, 1, false, false, 1>" in names


def test_kernel_supports_fp32():
    q, v = torch.zeros(1, 1, 1, 256), torch.zeros(1, 1, 1, 200)
    assert chunk.kernel_supports(q, v)
    assert not chunk.kernel_supports(torch.zeros(1, 1, 1, 257), v)
    assert not chunk.kernel_supports(q.double(), v.double())
    assert chunk.kernel_supports(q.half(), v.half())
