"""The autotuner on large heads, on the CPU: the chunk space's key-pieces and one-pass configs for
16-bit Dk > 128 (Dv up to 512), its default against today's plan, and a stored winner of either
kind reaching the planned launches (``launch._launcher`` with the kernel classes replaced by
recorders, on a fake H200), including a store written before ``key_pieces`` was tuned."""

from __future__ import annotations

import warnings

import pytest
import torch

from rtkernels import autotune
from rtkernels.autotune import answers, presets
from rtkernels.autotune.space import Limits, Problem, freeze
from rtkernels.autotune.store import Store
from rtkernels.methods import chunk, kernel_instances
from rtkernels.methods.chunk import launch, plan

FP = {"rtkernels": "0.1.0", "sources": "0123456789abcdef", "gpu": "NVIDIA H200", "capability": "9.0",
      "sms": 132, "nvrtc": "13.0"}
H200 = Limits(sms=132, max_smem=227 * 1024, cc=(9, 0))
A100 = Limits(sms=108, max_smem=163 * 1024, cc=(8, 0))
D256 = Problem(2, 16, 4096, 256, 256, "bf16")
RETNET = Problem(2, 8, 4096, 256, 512, "bf16")
LARGE = [D256, RETNET, Problem(2, 16, 4096, 200, 200, "fp16"), Problem(1, 4, 9000, 129, 64, "bf16")]
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fake_h200(monkeypatch):
    """Device 0 (and the CPU tensors' device None) is an H200 with the registry's check of store
    entries on; a clean selection state and planner caches around each test."""
    from rtkernels.methods import registry

    monkeypatch.setattr(plan, "_sm_count", lambda dev: H200.sms)
    monkeypatch.setattr(plan, "_smem_limit", lambda dev: H200.max_smem)
    monkeypatch.setattr(plan, "_is_sm90", lambda dev: True)
    monkeypatch.setattr(launch, "_sm_count", lambda dev: H200.sms)
    monkeypatch.setattr(launch, "_smem_limit", lambda dev: H200.max_smem)
    # CPU tensors have no device index: their lookups go to device 0's store
    monkeypatch.setattr(launch, "tuned_config", lambda m, dev, *a: answers.tuned_config(m, 0, *a))
    monkeypatch.setattr(answers, "_config_check", registry._entry_problem)
    monkeypatch.setattr(answers, "_warned", set())
    plan.plan_launch.cache_clear()
    autotune.clear()
    yield
    autotune.clear()
    plan.plan_launch.cache_clear()


class _Recorder:
    """Stands in for ``ChunkLaunch``: records the Launch its pass would compile and bind."""

    def __init__(self, q, k, v, log_decay, scale, out, need_state, reverse=False, fp32_precision="exact",
                 tuned=None, sequences=None):
        b, h, n, dk = q.shape
        self.launch = launch.pass_launch(q.dtype, b, h, n, dk, v.shape[-1], q.device.index, True, True, tuned)


def planned(monkeypatch, p: Problem) -> list[tuple[int, plan.Launch]]:
    """(key columns, Launch) of each pass a call of problem ``p`` makes (one without pieces)."""
    monkeypatch.setattr(launch, "ChunkLaunch", _Recorder)
    q = torch.empty(p.b, p.h, p.n, p.dk, dtype=p.torch_dtype)
    v = torch.empty(p.b, p.h, p.n, p.dv, dtype=p.torch_dtype)
    got = launch._launcher(q, q, v, None, 1.0, torch.empty_like(v), False, False, "exact")
    if isinstance(got, launch.KeyPiecesLaunch):
        return [(s.stop - s.start, part.launch) for s, part in zip(got.pieces, got.parts)]
    return [(p.dk, got.launch)]


def heuristic(p: Problem, dk: int) -> plan.Launch:
    return plan.plan_launch(p.torch_dtype, dk, p.dv, True, p.bh, p.n, 0)


def effective(lp: plan.Launch, n: int) -> plan.Launch:
    """``lp`` with the segment count a launch runs (ChunkLaunch: whole chunks per segment)."""
    seg_len = -(-n // (lp.segments * plan.CHUNK_KERNEL)) * plan.CHUNK_KERNEL
    return lp._replace(segments=-(-n // seg_len))


def store_with(tmp_path, entries: dict) -> Store:
    """A store on device 0 holding ``{bucket: chunk config}`` entries (method chunk)."""
    store = Store(FP, tmp_path)
    for key, config in entries.items():
        store.put(key, {"method": "chunk", "configs": {"chunk": config}})
    autotune.use_store(0, store)
    return store


def bucket(p: Problem, dk: int = 0) -> str:
    return autotune.bucket(p.dtype, p.bh, p.n, dk or p.dk, p.dv)


# ------------------------------------------------------------------------------- space --- #

@pytest.mark.parametrize("p", [D256, RETNET], ids=lambda p: p.label())
def test_space_lists_key_pieces_and_one_pass_configs_on_hopper(p):
    configs = chunk.TUNE_SPACE.configs(p, H200)
    ok = [c for c, why in configs if why is None]
    pieces = [c for c in ok if c["key_pieces"]]
    one_pass = [c for c in ok if not c["key_pieces"]]
    assert all(c["wgmma"] and c["bv"] in (64, 128) for c in pieces)
    assert {c["bv"] for c in pieces} == {64, 128} and len({c["segments"] for c in pieces}) > 3
    assert one_pass and all(not c["wgmma"] and c["bv"] == 32 for c in one_pass)  # KMAX 256: BV 32
    assert len({c["segments"] for c in one_pass}) > 3
    why = dict((freeze(c), w) for c, w in configs)
    assert "wgmma kernel" in why[freeze({"key_pieces": True, "wgmma": False, "bv": 32, "segments": 1})]
    assert "Dk <= 128" in why[freeze({"key_pieces": False, "wgmma": True, "bv": 64, "segments": 1})]


@pytest.mark.parametrize("p", LARGE, ids=lambda p: p.label())
def test_every_runnable_large_head_config_is_compiled_by_ci(p):
    """Each unpruned config, per piece (the last piece may be narrower: another KMAX), maps to a
    template instance the compile test covers."""
    names = kernel_instances()[chunk.FWD16_SOURCE]
    for config, why in chunk.TUNE_SPACE.configs(p, H200):
        if why:
            continue
        widths = [s.stop - s.start for s in plan._split_keys(p.dk, plan.KEY_PIECE)] if config["key_pieces"] \
            else [p.dk]
        for dk in widths:
            for vec in (False, True):
                lp = chunk.tuned_launch(freeze(config), Problem(p.b, p.h, p.n, dk, p.dv, p.dtype), H200, vec=vec)
                assert lp.name in names, (config, dk, lp.name)


@pytest.mark.parametrize("p", [D256, RETNET, Problem(4, 32, 4096, 128, 128, "bf16"),
                               Problem(2, 16, 4096, 256, 256, "fp32")], ids=lambda p: p.label())
def test_only_valid_configs_elsewhere(p):
    """Without wgmma (an A100), for fp32, and where Dk fits one pass: no key-pieces config runs."""
    for limits in (A100, H200):
        for config, why in chunk.TUNE_SPACE.configs(p, limits):
            if config["key_pieces"] and (limits is A100 or p.dtype == "fp32" or p.dk <= plan.KEY_PIECE):
                assert why, config
    assert not any(c["key_pieces"] for c, why in chunk.TUNE_SPACE.configs(p, A100) if why is None)


# ----------------------------------------------------------------- default == today's plan --- #

@pytest.mark.parametrize("p", LARGE, ids=lambda p: p.label())
def test_default_config_is_todays_plan(monkeypatch, p):
    """No store: a call plans key pieces, each by plan_launch of its width; the space's default is
    that plan, and valid."""
    today = planned(monkeypatch, p)
    assert len(today) == 2 and all(lp == heuristic(p, dk) for dk, lp in today)
    default = chunk.TUNE_SPACE.default(p, H200)
    assert default["key_pieces"] is True and chunk.TUNE_SPACE.check(p, default, H200) is None
    for dk, lp in today:
        tuned = chunk.tuned_launch(freeze(default), Problem(p.b, p.h, p.n, dk, p.dv, p.dtype), H200)
        assert effective(tuned, p.n) == effective(lp, p.n)
    assert chunk.TUNE_SPACE.default(p, A100)["key_pieces"] is False  # no wgmma: the Dk-256 kernel


# ------------------------------------------------------------- a stored winner is applied --- #

@pytest.mark.parametrize("p", [D256, RETNET], ids=lambda p: p.label())
def test_stored_key_pieces_winner_runs_on_every_piece(monkeypatch, tmp_path, p):
    config = {"key_pieces": True, "wgmma": True, "bv": 64, "segments": 4}
    store_with(tmp_path, {bucket(p): config, bucket(p, 128): {"key_pieces": False, "wgmma": False, "bv": 32,
                                                                "segments": 1}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = planned(monkeypatch, p)
    assert [dk for dk, _ in got] == [128, 128]
    for dk, lp in got:  # the d256 entry, not the pieces' own (dk128) bucket
        assert (lp.bv, lp.segments, lp.options) == (64, 4, plan.WGMMA_OPTIONS)
        assert lp.name == "rtk_chunk_fwd<2, 128, 64, true, 1, true, false, 3>"  # bf16 BV 64: three stages


@pytest.mark.parametrize("p", [D256, RETNET], ids=lambda p: p.label())
def test_stored_one_pass_winner_runs_the_dk256_kernel(monkeypatch, tmp_path, p):
    store_with(tmp_path, {bucket(p): {"key_pieces": False, "wgmma": False, "bv": 32, "segments": 3}})
    ((dk, lp),) = planned(monkeypatch, p)
    assert dk == 256 and (lp.bv, lp.segments, lp.options) == (32, 3, ())
    assert lp.name == "rtk_chunk_fwd<2, 256, 32, true, 2, false>"
    with plan.override(key_pieces=True):  # an override steers the plan: the heuristic's pieces
        assert [lp for _, lp in planned(monkeypatch, p)] == [heuristic(p, 128)] * 2


def test_forced_candidate_reaches_the_plan(monkeypatch):
    """The tuner times a candidate through the ordinary call path (answers.forced)."""
    with autotune.forced("chunk", freeze({"key_pieces": False, "wgmma": False, "bv": 32, "segments": 2})):
        assert [(dk, lp.segments) for dk, lp in planned(monkeypatch, D256)] == [(256, 2)]
    with autotune.forced("chunk", freeze({"key_pieces": True, "wgmma": True, "bv": 128, "segments": 1})):
        assert [(dk, lp.bv, lp.segments) for dk, lp in planned(monkeypatch, D256)] == [(128, 128, 1)] * 2


# ------------------------------------------------------- a store from before key_pieces --- #

def test_old_entry_without_key_pieces_is_read_and_keeps_todays_plan(monkeypatch, tmp_path):
    """Decision: a config stored before ``key_pieces`` was tuned is valid (no warning) and reads as
    "not tuned": the plan splits Dk as it did, each piece following its own bucket; a one-pass
    call applies the config as before."""
    old = {"wgmma": False, "bv": 32, "segments": 3}
    piece = {"wgmma": True, "bv": 64, "segments": 2}
    mid = Problem(4, 32, 4096, 128, 128, "bf16")
    store_with(tmp_path, {bucket(D256): old, bucket(D256, 128): piece, bucket(mid): piece})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.tuned_config("chunk", 0, BF16, D256.bh, D256.n, 256, 256) == freeze(old)
        got = planned(monkeypatch, D256)
        assert [(dk, lp.bv, lp.segments) for dk, lp in got] == [(128, 64, 2)] * 2
        ((_, lp),) = planned(monkeypatch, mid)
    assert (lp.bv, lp.segments) == (64, 2)
    assert chunk.TUNE_SPACE.invalid(old) is None
    assert "expected the keys" in chunk.TUNE_SPACE.invalid({**old, "pieces": True})
    assert "expected the keys" in chunk.TUNE_SPACE.invalid({"key_pieces": True, "bv": 64, "segments": 1})


def test_standard_preset_has_the_large_head_shapes():
    std = presets.PRESETS["standard"]
    assert std["d256"] == ((2, 16, 4096, 256, 256), ("bf16",))
    assert std["retnet"] == ((2, 8, 4096, 256, 512), ("bf16",))


def test_value_tile_takes_a_full_wave_of_64_wide_tiles_before_a_split():
    """The heuristic's BV on a 132-SM GPU: 128 where 128-wide tiles fill 3/4 of the SMs (mid), 64
    where 64-wide ones do (the key pieces of d256 and RetNet's heads: one wave, no split), 128 with
    a split sequence where neither does (long), 64 for short sequences (small) and Dv <= 64."""
    from rtkernels.methods.chunk import plan

    assert plan.value_tile(128, 128, 4096, 132) == 128  # mid
    assert plan.value_tile(256, 32, 4096, 132) == 64  # d256
    assert plan.value_tile(512, 16, 4096, 132) == 64  # retnet
    assert plan.value_tile(128, 32, 16384, 132) == 128  # long
    assert plan.value_tile(128, 64, 1024, 132) == 64  # small
    assert plan.value_tile(64, 8, 65536, 132) == 64
