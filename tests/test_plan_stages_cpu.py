"""Which forward instances take three chunk stages of tiles (CPU: the plan only; the kernels run
in test_gpu_chunk_kernels.py and test_gpu_variants_gamma.py)."""

import pytest
import torch

from rtkernels.methods.chunk import plan


@pytest.fixture
def hopper(monkeypatch):
    """An H100-like device 0 for the plan: 132 SMs, 227 KiB of shared memory per CTA, sm_90a."""
    monkeypatch.setattr(plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(plan, "_smem_limit", lambda dev: plan.SMEM_LIMIT_SM90)
    monkeypatch.setattr(plan, "_is_sm90", lambda dev: True)
    plan.plan_launch.cache_clear()
    yield
    plan.plan_launch.cache_clear()


def _stages(name: str) -> int:
    args = name[name.index("<") + 1:-1].split(", ")
    return int(args[7]) if len(args) > 7 else 2


@pytest.mark.parametrize("dtype, bh, dk, vec, want", [
    (torch.bfloat16, 64, 128, True, 3),    # small: BV 64
    (torch.bfloat16, 128, 64, True, 3),    # d64
    (torch.bfloat16, 128, 128, True, 2),   # mid: BV 128
    (torch.float16, 64, 128, True, 2),     # fp16 keeps two
    (torch.bfloat16, 64, 128, False, 2),   # unaligned rows: no three-stage instance
])
def test_default_stages(hopper, dtype, bh, dk, vec, want):
    lp = plan.plan_launch(dtype, dk, dk, vec, bh, 2048, 0)
    assert _stages(lp.name) == want
    assert lp.smem == plan.config_smem(plan.kernel_config(dtype, dk, dk, vec, 1, 132, True, lp.bv, stages=want))


def test_forced_stages_and_shared_memory(hopper):
    for stages in (2, 3):
        lp = plan.plan_launch(torch.bfloat16, 128, 128, True, 128, 4096, 0, plan.Overrides(stages=stages))
        assert _stages(lp.name) == stages and lp.bv == 128
        assert lp.smem <= plan.SMEM_LIMIT_SM90
    # BV 128 with three stages fits by keeping one output buffer, not two
    two = plan.smem_bytes(128, 128, True, stages=2)
    three = plan.smem_bytes(128, 128, True, stages=3)
    assert three - two == 2 * (2 * 64 * 128 + 64 * 128) - 2 * 64 * 136
    assert three <= plan.SMEM_LIMIT_SM90 < three + 2 * 64 * 136


def test_dlog_and_mma_instances_keep_two_stages():
    assert len(plan.dlog_config(torch.bfloat16, 128, True)) == 7
    assert plan.kernel_config(torch.bfloat16, 128, 128, True, 1, 132, False, 64, stages=3)[-1] is False
    names = [plan.name_expression(c) for c in plan.all_configs()
             if len(c) == 8 and c[0] != plan.dtype_code(torch.float32)]  # (float32's eighth: WG)
    assert names and all(", true, 1, true, false, 3>" in n for n in names)
    # the fused dk + dv instances (ninth argument) keep two stages too, with and without the Z split's sums
    dual = [plan.name_expression(c) for c in plan.all_configs() if len(c) == 9]
    assert len(dual) == 16 and all(n.endswith((", true, 1, true, false, 2, true>", ", true, 1, true, 2, 2, true>"))
                                   for n in dual)


def test_tma_instances_are_the_plain_aligned_wgmma_ones_at_their_default_stages():
    """Each plain wgmma instance on aligned rows at the stages the plan gives it, and each dq pass that
    sums dlog(gamma), has a TMA twin (tenth argument), with the same shared memory plus an mbarrier
    per stage; the fused dk/dv pass (a reversed walk) and other stage counts have none."""
    tma = [c for c in plan.all_configs() if len(c) == 10]
    plain = [c for c in tma if c[6] is False]
    assert len(plain) == 8 and all(c[9] and c[3] and c[5] and c[8] is False for c in tma)
    # and the dq passes that sum dlog(gamma): W, the Z split at 64 and (bf16) 128 columns
    assert sorted(str(c[6]) for c in tma if c[6] is not False) == ["2"] * 4 + ["3"] * 2 + ["True"] * 4
    assert plan.tma_variant("rtk_chunk_fwd<2, 128, 128, true, 1, true>") == (
        "rtk_chunk_fwd<2, 128, 128, true, 1, true, false, 2, false, true>",
        plan.config_smem((2, 128, 128, True, 1, True)) + 16)
    assert plan.tma_variant("rtk_chunk_fwd<2, 128, 64, true, 1, true, false, 3>")[0].endswith("false, 3, false, true>")
    assert plan.tma_variant("rtk_chunk_fwd<2, 128, 128, true, 1, true, 3>")[0].endswith(", 3, 2, false, true>")
    for name in ("rtk_chunk_fwd<2, 128, 128, true, 1, true, false, 3>",  # not the plan's stages for bf16 BV 128
                 "rtk_chunk_fwd<2, 128, 128, false, 1, true>",  # unaligned rows
                 "rtk_chunk_fwd<2, 128, 128, true, 1, true, false, 2, true>"):  # the fused dk/dv pass
        assert plan.tma_variant(name) is None, name
    assert all(plan.config_smem(c) <= plan.SMEM_LIMIT_SM90 for c in tma)


def test_states_pass_stages():
    """The split strategy's states pass: three stages where they fit (four measured slower), two
    where they do not; the DLOG instance keeps four by cp.async, three by tensor copies."""
    assert plan.states_config(torch.bfloat16, 128, 128, True, plan.SMEM_LIMIT_SM90)[4] == 3
    assert plan.states_config(torch.float16, 256, 256, True, plan.SMEM_LIMIT_SM90)[4] == 3
    assert plan.states_config(torch.bfloat16, 256, 256, True, 99 * 1024)[4] == 2
    assert plan.states_config(torch.bfloat16, 128, 128, True, plan.SMEM_LIMIT_SM90, dlog=True)[4:] == (4, True)
    assert plan.states_config(torch.bfloat16, 128, 128, True, plan.SMEM_LIMIT_SM90, dlog=True, tma=True)[4:] == (
        3, True, True)


def test_forward_slots_serve_a_dq_pass_that_splits_alike():
    """launch.transposed_slots: the forward's slots, transposed, only for a launch whose split
    (segments, fold length, slot count) matches and whose state is the transpose of the forward's."""
    from types import SimpleNamespace

    from rtkernels.methods.chunk import launch

    slots = torch.arange(3 * 2 * 4 * 6, dtype=torch.float32).reshape(3, 1, 2, 4, 6)
    fold = (3, 256, 3, (1, 2, 4, 6))
    got = launch.transposed_slots(SimpleNamespace(fold=(3, 256, 3, (1, 2, 6, 4))), slots, fold)
    assert got is not None and got.is_contiguous() and torch.equal(got, slots.transpose(-1, -2))
    for other in [(3, 128, 5, (1, 2, 6, 4)), (2, 256, 3, (1, 2, 6, 4)), (3, 256, 3, (1, 2, 4, 6)), None]:
        assert launch.transposed_slots(SimpleNamespace(fold=other), slots, fold) is None
    assert launch.transposed_slots(object(), slots, fold) is None  # a launch without slots (key pieces)


def test_states_pass_hopper_instance_choice_and_options(monkeypatch):
    """plan.states_tma: the Hopper instance (tensor copies, wgmma) on compute capability 9.0 with
    aligned rows, also at Dk 64, but not for the DLOG instance at Dk <= 64 (one block of S), not
    where wgmma is turned off or tensor copies are; its instances carry the sm_90a option, which
    `rtkernels compile` takes from plan.instance_options (wgmma needs it)."""
    monkeypatch.setattr(plan, "_capability", lambda dev: (9, 0))
    monkeypatch.delenv("RTKERNELS_NO_WGMMA", raising=False)
    over = plan.Overrides()
    assert all(plan.states_tma(0, dk, True, over) for dk in (40, 64, 128, 256))
    assert plan.states_tma(0, 128, True, over, dlog=True) and not plan.states_tma(0, 64, True, over, dlog=True)
    assert not plan.states_tma(0, 128, False, over)
    assert not plan.states_tma(0, 128, True, plan.Overrides(tensor_copies=False))
    assert not plan.states_tma(0, 128, True, plan.Overrides(wgmma=False))
    monkeypatch.setenv("RTKERNELS_NO_WGMMA", "1")
    assert not plan.states_tma(0, 128, True, over)
    monkeypatch.setattr(plan, "_capability", lambda dev: (8, 0))
    monkeypatch.delenv("RTKERNELS_NO_WGMMA")
    assert not plan.states_tma(0, 128, True, plan.Overrides(wgmma=None))
    options = plan.instance_options()
    for config in plan._states_configs():
        tma = len(config) > 6 and config[6]
        assert plan.states_options(config) == (plan.WGMMA_OPTIONS if tma else ())
        assert options.get(plan.states_name(config), ()) == plan.states_options(config)
    assert any(len(c) > 6 and c[6] and c[1] == 64 for c in plan._states_configs()), "no Dk-64 Hopper instance"
