"""fp32 on the chunk kernel, the parts that need no GPU: how ``fp32_precision`` is resolved and
passed on, and which ``rtk_chunk_fwd_f32`` configuration each device and head size gets."""

import pytest
import torch

import rtkernels
import rtkernels.api as api
from rtkernels import call_cache
from rtkernels.autotune.space import Limits, Problem, freeze
from rtkernels.methods import chunk, kernel_instances

from inputs import force_chunk, make_qkv

Q, K, V = make_qkv(0, 2, 3, 5, 4, 6, torch.float32)


@pytest.fixture
def captured(monkeypatch):
    """The fp32_precision each call hands to run_method (the computation itself is skipped)."""
    seen = []

    def fake_run_method(name, q, k, v, log_decay, scale, out, s0, need_state, fp32_precision="exact"):
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
    # SM89: two stages of KMAX 64, BV 32 need 102400 B with the q S pieces (1 KiB over 99 KiB)
    (SM89, 64, 64, (64, 64, 1)), (SM89, 40, 16, (64, 32, 1)), (SM89, 128, 128, (128, 32, 1)),
    (SM89, 200, 8, None),
])
def test_f32_config_fits_the_device(limit, dk, dv, expected):
    tile = chunk.f32_config(dk, dv, limit)
    assert tile == expected
    if tile is not None:
        assert chunk.f32_smem_bytes(*tile) <= limit


def test_f32_smem_bytes():
    # q, k tiles 64 x (KMAX + 4), v tile 64 x (BV + 4) per stage, state copy KMAX x (BV + 8), the 4 q S
    # pieces of the state warps 16 x BV/2 each, floats
    assert chunk.f32_smem_bytes(128, 64, 2) == 4 * (2 * (2 * 64 * 132 + 64 * 68) + 128 * 72 + 4 * 16 * 32)
    assert chunk.f32_smem_bytes(256, 32, 1) == 4 * (2 * 64 * 260 + 64 * 36 + 256 * 40 + 4 * 16 * 16)
    assert chunk.f32_smem_bytes(128, 64, 2) <= 227 * 1024


def test_f32_instances_are_compiled_by_the_compile_test():
    names = kernel_instances()[chunk.F32_SOURCE]
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


# ---- the merge with the launch planner, autotuning and autograd -----------------------------------

def test_precision_reaches_the_forward_of_the_autograd_path(monkeypatch):
    """With inputs that require grad, the Function's forward gets the call's mode too."""
    import rtkernels.autograd as rk_autograd

    seen = []
    real = rk_autograd.run_method

    def spy(*args, fp32_precision="exact", **kwargs):
        seen.append(fp32_precision)
        return real(*args, fp32_precision=fp32_precision, **kwargs)

    monkeypatch.setattr(rk_autograd, "run_method", spy)
    before = torch.get_float32_matmul_precision()
    try:
        q = Q.clone().requires_grad_(True)
        for setting, precision, expected in (("highest", None, "exact"), ("high", None, "tf32"),
                                             ("high", "exact", "exact"), ("highest", "tf32", "tf32")):
            torch.set_float32_matmul_precision(setting)
            rtkernels.causal_linear_attention(q, K, V, 0.9, method="chunk", fp32_precision=precision).sum().backward()
            assert seen[-1] == expected, (setting, precision)
    finally:
        torch.set_float32_matmul_precision(before)
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.fixture
def fake_gpu(monkeypatch):
    """The launch planner on the CPU: device 0 is an H200 (132 SMs, 227 KiB, compute capability 9.0)."""
    monkeypatch.setattr(chunk.plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(chunk.plan, "_smem_limit", lambda dev: H200)
    monkeypatch.setattr(chunk.plan, "_is_sm90", lambda dev: True)
    chunk.plan_launch.cache_clear()
    yield
    chunk.plan_launch.cache_clear()


@pytest.mark.parametrize("exact", [True, False])
def test_planner_gives_fp32_its_own_kernel(fake_gpu, exact):
    """The exact mode runs rtk_chunk_fwd_f32 (mma.sync); the TF32 mode on aligned rows with Dk <=
    128 runs rtk_chunk_fwd_tf32 (wgmma, sm_90a), else rtk_chunk_fwd_f32 too."""
    names = kernel_instances()
    name, bv, nseg, smem, threads, opts = chunk.plan_launch(torch.float32, 128, 128, True, 128, 4096, 0, exact=exact)[:6]
    if exact:
        assert name == "rtk_chunk_fwd_f32<128, 64, 2, true, true, 1>" and name in names[chunk.F32_SOURCE]
        assert (bv, nseg, smem, threads, opts) == (64, 1, chunk.f32_smem_bytes(128, 64, 2), chunk.f32_threads(exact), ())
    else:
        assert name == "rtk_chunk_fwd_tf32<128, 64>" and name in names[chunk.TF32_WG_SOURCE]
        assert (bv, nseg, smem, threads, opts) == (64, 1, chunk.tf32_wg_smem_bytes(128, 64), 256, chunk.WGMMA_OPTIONS)
    # few CTAs, long sequence: segments. The exact mode: one wave of one CTA per SM (210 KiB of
    # shared memory each); the TF32 mode's wgmma kernel: two waves' worth, segments of >= 32 chunks
    name, bv, nseg, _, _, opts = chunk.plan_launch(torch.float32, 128, 128, True, 32, 16384, 0, exact=exact)[:6]
    if exact:
        assert name.startswith("rtk_chunk_fwd_f32<") and opts == () and nseg == 132 // 64
    else:
        assert name == "rtk_chunk_fwd_tf32<128, 64>" and opts == chunk.WGMMA_OPTIONS and nseg == 2 * 132 // 64
        assert chunk.plan_launch(torch.float32, 64, 64, True, 16, 16384, 0, exact=False)[2] == 16384 // (32 * 64)
    # forced segments keep the wgmma kernel (its states-only mode)
    with chunk.override(segments=3):
        forced = chunk.plan_launch(torch.float32, 128, 128, True, 32, 16384, 0, chunk.current_overrides(), exact=exact)
    assert forced[0].startswith("rtk_chunk_fwd_f32<" if exact else "rtk_chunk_fwd_tf32<") and forced[2] == 3
    # unaligned rows in the TF32 mode: the mma.sync kernel
    name, _, _, _, _, opts = chunk.plan_launch(torch.float32, 128, 128, False, 128, 4096, 0, exact=exact)[:6]
    assert name == f"rtk_chunk_fwd_f32<128, 64, 2, {str(exact).lower()}, false, 1>" and opts == ()
    # KMAX 64, BV 32 (mma.sync): two CTAs fit on an SM in the TF32 mode (256 threads); the exact mode's
    # 384 threads take too many registers for two. Aligned TF32 rows with Dv <= 32 keep it too (the
    # wgmma kernel's 64-wide value tile would be half idle), unless wgmma is forced
    assert chunk.plan_launch(torch.float32, 64, 32, False, 8, 1 << 16, 0, exact=exact)[2] == (1 if exact else 2) * 132 // 8
    assert chunk.plan_launch(torch.float32, 64, 32, True, 8, 1 << 16, 0, exact=exact)[:3] == (
        ("rtk_chunk_fwd_f32<64, 32, 2, true, true, 1>", 32, 132 // 8) if exact else
        ("rtk_chunk_fwd_f32<64, 32, 2, false, true, 1>", 32, 2 * 132 // 8))
    with chunk.override(wgmma=True):
        forced = chunk.plan_launch(torch.float32, 64, 32, True, 8, 1 << 16, 0, chunk.current_overrides(), exact=exact)
    assert forced[0] == ("rtk_chunk_fwd_f32<64, 32, 2, true, true, 1>" if exact else "rtk_chunk_fwd_tf32<64, 64>")
    # enough CTAs for one segment: the wgmma kernel in the TF32 mode
    assert chunk.plan_launch(torch.float32, 64, 64, True, 256, 2048, 0, exact=exact)[0] == (
        "rtk_chunk_fwd_f32<64, 64, 2, true, true, 1>" if exact else "rtk_chunk_fwd_tf32<64, 64>")
    # Dk 256: the mma.sync kernel in both modes
    assert chunk.plan_launch(torch.float32, 256, 64, True, 8, 4096, 0, exact=exact)[0].startswith("rtk_chunk_fwd_f32<")
    # the 16-bit plan is unchanged: the wgmma kernel
    bf = chunk.plan_launch(torch.bfloat16, 128, 128, True, 128, 4096, 0)
    assert bf[0].startswith("rtk_chunk_fwd<") and bf[5] == chunk.WGMMA_OPTIONS


def test_stored_float32_config_leaves_tf32_on_the_wgmma_kernel(fake_gpu, monkeypatch):
    """The tuned store's float32 entries are timed in the exact mode among mma.sync configs: they
    steer exact calls and "tf32" calls the wgmma kernel does not serve, never one it serves (a
    store written by ``rtkernels autotune`` would otherwise put those on the slower kernel)."""
    from rtkernels.methods.chunk import launch

    stored = freeze({"key_pieces": False, "wgmma": False, "bv": 32, "segments": 3})
    monkeypatch.setattr(launch, "tuned_config", lambda *a: stored)
    monkeypatch.setattr(launch, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(launch, "_smem_limit", lambda dev: H200)

    def planned(dv, vec, exact):
        return launch.pass_launch(torch.float32, 4, 32, 4096, 128, dv, 0, vec, exact)

    assert planned(128, True, True)[:3] == ("rtk_chunk_fwd_f32<128, 32, 2, true, true, 1>", 32, 3)
    wg = planned(128, True, False)
    assert wg == chunk.plan_launch(torch.float32, 128, 128, True, 128, 4096, 0, exact=False)
    assert wg[:3] == ("rtk_chunk_fwd_tf32<128, 64>", 64, 1)
    # not served by the wgmma kernel: unaligned rows, Dv <= 32; the stored config applies
    assert planned(128, False, False)[:3] == ("rtk_chunk_fwd_f32<128, 32, 2, false, false, 1>", 32, 3)
    assert planned(32, True, False)[:3] == ("rtk_chunk_fwd_f32<128, 32, 2, false, true, 1>", 32, 3)
    with chunk.override(wgmma=False):  # an override steers the plan: the heuristic, mma.sync
        assert planned(128, True, False) == chunk.plan_launch(
            torch.float32, 128, 128, True, 128, 4096, 0, chunk.current_overrides(), exact=False)


def test_tf32_wgmma_kernel_fits_and_is_compiled():
    """rtk_chunk_fwd_tf32's shared memory (mirrors rtk_tf32_smem): two stages of q, k (64 x KMAX) and
    v^T (64 x 64) fp32 tiles, two fp32 copies of S^T, the OR ring and the alignment slack."""
    assert chunk.tf32_wg_smem_bytes(128, 64) == 4 * (2 * (2 * 64 * 128 + 64 * 64) + 2 * 64 * 128) + 8 + 1024 == 230408
    assert chunk.tf32_wg_smem_bytes(128, 64) <= 227 * 1024
    assert sorted(kernel_instances()[chunk.TF32_WG_SOURCE]) == ["rtk_chunk_fwd_tf32<128, 64>", "rtk_chunk_fwd_tf32<64, 64>"]


def test_tf32_states_pass_fits_and_is_compiled():
    """rtk_chunk_states_tf32 (the first pass of the "tf32" wgmma plan's split sequence): KMAX as
    the fused pass's, BV 64 for Dv <= 64 else 128, three stages of k and v rows padded by 8 floats,
    within an H100's 227 KB; every instance the plan can ask for is in the compile test's list."""
    from rtkernels.methods.chunk import plan

    assert plan.tf32_states_config(128, 128) == (128, 128, 3) and plan.tf32_states_config(40, 64) == (64, 64, 3)
    assert plan.tf32_states_config(96, 200) == (128, 128, 3)
    assert plan.tf32_states_smem_bytes((128, 128, 3)) == 4 * 3 * 64 * (136 + 136) == 208896 <= 227 * 1024
    listed = kernel_instances()[plan.STATES_TF32_SOURCE]
    for dk in (1, 40, 64, 65, 128):
        for dv in (33, 64, 65, 128, 512):
            assert plan.tf32_states_name(plan.tf32_states_config(dk, dv)) in listed
    assert len(listed) == 4


def test_planner_overrides_for_fp32(fake_gpu, monkeypatch):
    # the exact mode (and unaligned rows) have no wgmma variant (wgmma ignored), and BV follows the shared
    # memory (bv ignored)
    force_chunk(monkeypatch, segments=3, wgmma=True, bv=128)
    name, bv, nseg, _, _, opts = chunk.plan_launch(torch.float32, 64, 64, False, 2, 1000, 0, chunk.current_overrides())[:6]
    assert (name, bv, nseg, opts) == ("rtk_chunk_fwd_f32<64, 64, 2, true, false, 1>", 64, 3, ())


FP32_PROBLEMS = [Problem(2, 32, 1024, 128, 128, "fp32"), Problem(1, 32, 16384, 128, 128, "fp32"),
                 Problem(1, 1, 100, 40, 24, "fp32"), Problem(2, 3, 5000, 256, 200, "fp32"),
                 Problem(8, 16, 2048, 64, 64, "fp32")]


@pytest.mark.parametrize("problem", FP32_PROBLEMS, ids=lambda p: p.label())
def test_fp32_tune_default_is_the_planner(fake_gpu, problem):
    cfg = chunk.TUNE_SPACE.default(problem, Limits(sms=132, max_smem=H200, cc=(9, 0)))
    assert cfg["wgmma"] is False
    assert chunk.TUNE_SPACE.check(problem, cfg, Limits(sms=132, max_smem=H200, cc=(9, 0))) is None
    plan = chunk.plan_launch(torch.float32, problem.dk, problem.dv, True, problem.bh, problem.n, 0)
    tuned = chunk.tuned_launch(freeze(cfg), problem, Limits(sms=132, max_smem=H200), vec=True, exact=True)
    assert tuned[:3] == plan[:3] and tuned == plan


@pytest.mark.parametrize("problem", FP32_PROBLEMS, ids=lambda p: p.label())
@pytest.mark.parametrize("limit", [H200, A100, SM89])
def test_fp32_tune_space_never_hands_out_a_16_bit_config(problem, limit):
    """Every fp32 config the check lets through is an fp32 instance the compile test covers, in
    both modes; wgmma and BV 128 are pruned with a reason."""
    names = kernel_instances()[chunk.F32_SOURCE]
    limits = Limits(sms=132, max_smem=limit, cc=(9, 0))
    configs = chunk.TUNE_SPACE.configs(problem, limits)
    for config, why in configs:
        if config["wgmma"]:
            assert why, config
        elif config["bv"] == 128:
            assert why == "the mma.sync kernel takes BV 32 or 64"
        if why:
            continue
        for exact in (False, True):
            for vec in (False, True):
                name = chunk.tuned_launch(freeze(config), problem, Limits(sms=132, max_smem=limit), vec=vec,
                                          exact=exact)[0]
                assert name.startswith("rtk_chunk_fwd_f32<") and name in names, (config, name)
    assert any(why and "no wgmma variant" in why for _, why in configs)


def test_autotuner_candidates_for_fp32_start_with_the_chunk_kernel():
    """The tuner's mirror of auto_method: on a GPU, fp32 runs the chunk kernel without a store entry."""
    from rtkernels.autotune import cuda

    assert cuda.heuristic_method(Problem(2, 32, 1024, 128, 128, "fp32")) == "chunk"
    cands = cuda.candidates(Problem(2, 32, 1024, 128, 128, "fp32"), Limits(sms=132, cc=(9, 0)))
    assert cands[0][0].method == "chunk" and cands[0][0].default and cands[0][1] is None
    assert sum(c.method == "chunk" and why is None for c, why in cands) > 1


def test_cached_call_key_holds_the_resolved_precision():
    """The cached call (call_cache.call_key) never reuses a plan across fp32 modes: the key holds
    fp32_precision, and for float32 inputs with None, torch's float32 matmul setting."""
    key = lambda q, prec=None: call_cache.call_key(q, q, q, 0.9, None, 1.0, "chunk", "bhnd", None, False, prec)
    q32, q16 = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        highest = key(q32)
        highest16 = key(q16)
        torch.set_float32_matmul_precision("high")
        assert key(q32) != highest and key(q32) == key(q32)
        assert key(q16) == highest16  # 16-bit keys do not depend on torch's setting
    finally:
        torch.set_float32_matmul_precision(before)
    assert len({key(q32, "exact"), key(q32, "tf32"), highest}) == 3
    assert key(q32, 3) is None and key(q32, b"tf32") is None  # refused by the checks: never cached
