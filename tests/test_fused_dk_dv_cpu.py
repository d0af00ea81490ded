"""The plan of the backward's fused dk + dv walk (CPU: the plan only; the kernel runs in
tests/test_gpu_fused_dk_dv.py): its instance, its shared memory, its split, and that only CUDA
operands ever take it."""

import torch

from rtkernels.methods.chunk import Overrides, dual_config, dual_launch, fuses_dk_dv, plan, smem_bytes, split

BF16, F16 = torch.bfloat16, torch.float16


def test_dual_config_exists_only_where_one_tile_holds_dv():
    """fp16/bf16, 16-byte rows, Dk and Dv <= 128; BV 64 up to Dv 64, else 128; DUAL the ninth argument
    after two stages."""
    assert dual_config(BF16, 128, 128, True)[1:] == (128, 128, True, 1, True, False, 2, True)
    assert dual_config(F16, 40, 64, True)[1:3] == (64, 64)
    assert dual_config(BF16, 128, 72, True)[1:3] == (128, 128)
    for args in ((torch.float32, 64, 64, True), (BF16, 64, 64, False), (BF16, 200, 64, True), (BF16, 64, 200, True)):
        assert dual_config(*args) is None, args


def test_dual_shared_memory_fits_with_one_output_buffer():
    """The fourth tile in each of two stages and one output-row buffer as wide as the wider output:
    at Dk = Dv = 128, 15360 bytes over the plain two-stage kernel (which keeps two buffers), within
    the 227 KiB of an H100; KMAX over BV sizes the buffer's rows by KMAX."""
    plain, dual = smem_bytes(128, 128, True), smem_bytes(128, 128, True, dual=True)
    assert dual - plain == 2 * (2 * 64 * 128) - 2 * 64 * 136
    assert dual <= plan.SMEM_LIMIT_SM90
    # KMAX 128 over BV 64: two stages of q, k (128 wide), v and x (64 wide), two 128 x 64 state
    # copies, one buffer of 64 rows of 128 + 8 elements, 16-bit; + fp16 scaling, ring, alignment slack
    tiles = 2 * (2 * 64 * 128 + 2 * 64 * 64)
    assert smem_bytes(128, 64, True, dual=True) == 2 * (tiles + 2 * 128 * 64 + 64 * 136) + 32 + 8 + 1024
    assert plan.config_smem(dual_config(BF16, 128, 128, True)) == dual


def test_dual_launch_splits_as_the_forward(monkeypatch):
    """One CTA per (batch, head) and segment: mid in one segment, long in four (one CTA per SM),
    overrides.segments wins; the DUAL instance, compiled as sm_90a code."""
    monkeypatch.setattr(plan, "_sm_count", lambda dev: 132)
    dual_launch.cache_clear()
    mid, long = dual_launch(BF16, 128, 128, 4 * 32, 4096, 0), dual_launch(BF16, 128, 128, 32, 16384, 0)
    assert mid.segments == 1 and long.segments == 4 and long.bv == 128
    assert dual_launch(BF16, 128, 128, 32, 16384, 0, Overrides(segments=3)).segments == split(16384, 3)[1]
    assert mid.name.endswith(", 2, true>") and mid.options == plan.WGMMA_OPTIONS
    dual_launch.cache_clear()


def test_cpu_operands_never_fuse():
    """fuses_dk_dv is False for CPU tensors, even forced (the walk is a CUDA kernel)."""
    q, k, v, g = (torch.zeros(1, 2, 64, 64, dtype=BF16) for _ in range(4))
    assert not fuses_dk_dv(q, k, v, g, torch.zeros_like(k), Overrides(fused_dk_dv=True))
