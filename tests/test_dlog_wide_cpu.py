"""Where the Z split's dq pass takes its 128-wide instance (DLOG 3, plan.dlog_launch): bf16, the
pass's value width (the forward's Dk) in (64, 128], and a grid the 64-wide pass would spread over
more than one wave; its shared memory as the kernel's layout lays it out."""

import torch

from rtkernels.methods.chunk import Overrides, plan

BF16, F16 = torch.bfloat16, torch.float16


def _wide(launch: plan.Launch) -> bool:
    return launch.bv == 128 and launch.name.endswith(", 3>")


def test_wide_where_the_narrow_pass_needs_two_waves(monkeypatch):
    monkeypatch.setattr(plan, "_sm_count", lambda dev: 132)
    plan.dlog_launch.cache_clear()
    try:
        # mid (4 x 32 heads): 256 CTAs of 64 columns against 128 of 128
        assert _wide(plan.dlog_launch(BF16, 128, 128, 128, 4096, 0, Overrides(), True))
        assert _wide(plan.dlog_launch(BF16, 96, 72, 67, 1000, 0, Overrides(), True))
        # small (2 x 32): the 64-wide pass fills 128 of the 132 SMs in one wave
        small = plan.dlog_launch(BF16, 128, 128, 64, 1024, 0, Overrides(), True)
        assert small.bv == 64 and small.name.endswith(", 2>")
        # a value width of at most 64 fits one 64-wide tile; fp16 has no unscaled Z copy
        assert not _wide(plan.dlog_launch(BF16, 128, 64, 512, 4096, 0, Overrides(), True))
        assert not _wide(plan.dlog_launch(F16, 128, 128, 512, 4096, 0, Overrides(), True))
        # the W form never; the override: True wherever the instance exists, False never
        assert not _wide(plan.dlog_launch(BF16, 128, 128, 512, 4096, 0, Overrides(), False))
        assert _wide(plan.dlog_launch(BF16, 128, 128, 8, 100, 0, Overrides(dlog_wide=True), True))
        assert not _wide(plan.dlog_launch(BF16, 128, 128, 512, 4096, 0, Overrides(dlog_wide=False), True))
        assert not _wide(plan.dlog_launch(F16, 128, 128, 8, 100, 0, Overrides(dlog_wide=True), True))
    finally:
        plan.dlog_launch.cache_clear()


def test_wide_shared_memory():
    """Two stages of q, k, v tiles (64 rows of 128 columns, 16-bit), two S copies and one Z copy
    (128 x 128), one x tile outside the stages (64 x 128), one buffer of output rows (64 rows of
    128 + 8); + fp16 maxima (64 bytes), the OR ring and alignment slack: 952 bytes under the limit."""
    want = 2 * (2 * 3 * 64 * 128 + 3 * 128 * 128 + 64 * 128 + 64 * 136) + 64 + 8 + 1024
    config = plan.dlog_config(BF16, 128, True, True, True)
    assert config == (plan.dtype_code(BF16), 128, 128, True, 1, True, 3)
    assert plan.config_smem(config) == want <= plan.SMEM_LIMIT_SM90


def test_split_only_where_the_w_pass_has_no_tensor_copy_twin(monkeypatch):
    """mid (4 x 32 x 4096 x 128, bf16, a 132-SM GPU): the Z split's 128-wide pass would be planned,
    but W's pass has a TMA twin, which with the plain fused dk/dv pass takes less time; without
    tensor copies (``tma_io=False``) the split; forced, the split either way."""
    from rtkernels.methods.chunk import decay_grad

    monkeypatch.setattr(plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(decay_grad, "fuses_dk_dv", lambda *args: True)
    q = torch.empty(4, 32, 4096, 128, dtype=BF16)
    plan.dlog_launch.cache_clear()
    plan.dual_launch.cache_clear()
    try:
        w = plan.dlog_launch(BF16, 128, 128, 128, 4096, 0, Overrides())
        assert plan.tma_variant(w.name) is not None
        with plan.override():
            assert decay_grad.z_split_applies(q, q, q, q) is None
        with plan.override(tma_io=False):
            assert decay_grad.z_split_applies(q, q, q, q) == 4
        with plan.override(dlog_split=True):
            assert decay_grad.z_split_applies(q, q, q, q) == 4
    finally:
        plan.dlog_launch.cache_clear()
        plan.dual_launch.cache_clear()
