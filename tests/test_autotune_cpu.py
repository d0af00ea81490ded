"""The autotuner on the CPU: the tuning loop with a fake timer, the store and its fault cases,
the hot-path lookup, and the method modules' config spaces."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import warnings

import pytest
import torch

from rtkernels import autotune
from rtkernels.autotune import answers, cuda, keys
from rtkernels.autotune.space import Limits, Problem
from rtkernels.autotune.store import FORMAT, Store, cache_dir
from rtkernels.autotune.tuner import Candidate, tune
from rtkernels.jit import KernelCompileError

FP = {"rtkernels": "0.1.0", "sources": "0123456789abcdef", "gpu": "NVIDIA H200", "capability": "9.0",
      "sms": 132, "nvrtc": "13.0"}
PROBLEM = Problem(4, 32, 4096, 128, 128, "bf16")


@pytest.fixture(autouse=True)
def _fresh_selection_state(monkeypatch):
    """A clean selection state; the store mechanics are tested with abstract configs ({"bv": 64}),
    so the registry's check of entries is off unless a test turns it on (``_entry_check``)."""
    import rtkernels.methods  # noqa: F401  (installs the registry's check, then set aside here)

    monkeypatch.setattr(answers, "_config_check", None)
    autotune.clear()
    autotune.set_autotune_on_miss(None)
    yield
    autotune.clear()
    autotune.set_autotune_on_miss(None)


@pytest.fixture
def _entry_check(monkeypatch):
    from rtkernels.methods import registry

    monkeypatch.setattr(answers, "_config_check", registry._entry_problem)
    monkeypatch.setattr(answers, "_warned", set())


def fake_tune(problem=PROBLEM, times=None, wrong=(), compile_fail=(), launch_fail=(), pruned=()):
    """Run the tuner over candidates chunk bv=... with a fake timer (ms per label)."""
    times = times or {"chunk bv=32": 3.0, "chunk bv=64": 2.0, "scan": 5.0, "vanilla": 1.0}
    cands = [(Candidate.of(*(lbl.split(" bv=")[0], {"bv": int(lbl.split("=")[1])} if "=" in lbl else {}),
                           default=i == 0), "too big" if lbl in pruned else None)
             for i, lbl in enumerate(times)]
    ran = []

    def prepare(c):
        if c.label() in compile_fail:
            raise KernelCompileError("chunk.cu", [c.label()], "error: bad tile")

        def fn():
            ran.append(c.label())
            if c.label() in launch_fail:
                raise RuntimeError("CUDA error: too many resources requested for launch")
            return c.label()
        return fn

    def validate(c, out):
        assert out == c.label()
        return "relative error 0.5 > 0.012" if c.label() in wrong else None

    res = tune(problem, cands, prepare, lambda fn: (fn(), times[fn()])[1], validate,
               heuristic_method="chunk", timer_note="fake")
    return res, ran


# ------------------------------------------------------------------------------ tuner --- #

def test_fake_timer_picks_fastest_valid_candidate():
    res, _ = fake_tune(times={"chunk bv=32": 3.0, "chunk bv=64": 2.0, "scan": 5.0})
    assert res.best.candidate.label() == "chunk bv=64" and res.best.ms == 2.0
    e = res.entry()
    assert e["method"] == "chunk" and e["configs"] == {"chunk": {"bv": 64}, "scan": {}}
    assert e["heuristic"] == {"method": "chunk", "ms": 3.0}
    assert [t["status"] for t in e["trials"]] == ["ok", "ok", "ok"]


def test_failing_candidates_never_win_and_are_recorded():
    res, ran = fake_tune(wrong={"vanilla"}, compile_fail={"chunk bv=64"}, launch_fail={"chunk bv=32"},
                         pruned={"scan"})
    status = {t.candidate.label(): t.status for t in res.trials}
    assert status == {"chunk bv=32": "launch-error", "chunk bv=64": "compile-error", "scan": "pruned",
                      "vanilla": "wrong"}
    assert res.best is None and res.entry() is None
    assert "scan" not in ran  # pruned: never run
    errors = {t.candidate.label(): t.error for t in res.trials}
    assert "bad tile" in errors["chunk bv=64"] and "too big" in errors["scan"] and "0.5" in errors["vanilla"]


def test_wrong_fastest_candidate_loses_to_slower_valid_one():
    res, _ = fake_tune(wrong={"vanilla"})
    assert res.best.candidate.label() == "chunk bv=64"
    assert {t["method"]: t["status"] for t in res.entry()["trials"]}["vanilla"] == "wrong"


# ------------------------------------------------------------------------------ keys --- #

def test_bucket_rounds_up_to_powers_of_two():
    assert keys.bucket(torch.bfloat16, 128, 4096, 128, 128) == "bf16-bh128-n4096-dk128-dv128"
    assert keys.bucket("fp32", 96, 1000, 40, 24) == "fp32-bh128-n1024-dk64-dv32"
    assert keys.bucket(torch.float16, 1, 1, 8, 8) == "fp16-bh1-n1-dk16-dv16"


def test_file_name_depends_on_every_fingerprint_field():
    stems = {keys.file_stem(FP)}
    for field in keys.FIELDS:
        stems.add(keys.file_stem({**FP, field: "other"}))
    assert len(stems) == 1 + len(keys.FIELDS)
    assert keys.file_stem(FP).startswith("nvidia-h200-cc9.0-132sm-")


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path and autotune.store_dir() == tmp_path / "autotune"
    monkeypatch.delenv("RTKERNELS_CACHE_DIR")
    assert cache_dir().name == "rtkernels"


# ------------------------------------------------------------------------------ store --- #

def test_store_round_trip_is_readable_json(tmp_path):
    res, _ = fake_tune()
    store = Store(FP, tmp_path)
    entry = autotune.record(store, res)
    data = json.loads(store.path.read_text())
    assert data["format"] == FORMAT and data["fingerprint"] == FP
    assert data["entries"]["bf16-bh128-n4096-dk128-dv128"] == entry
    assert store.path.read_text().count("\n") > 10  # indented, human-readable
    again = Store(FP, tmp_path)
    assert again.get("bf16-bh128-n4096-dk128-dv128")["method"] == "vanilla"


def test_corrupt_file_warns_is_ignored_and_rebuilt(tmp_path):
    path = Store(FP, tmp_path).path
    path.parent.mkdir(parents=True, exist_ok=True)
    for junk in ('{"format": "rtkernels-autotune/1", "entries": {tru', "[1, 2]", ""):
        path.write_text(junk)
        with pytest.warns(RuntimeWarning, match="corrupt"):
            store = Store(FP, tmp_path)
        assert store.buckets() == {}
    res, _ = fake_tune()
    autotune.record(store, res)
    data = json.loads(path.read_text())  # rebuilt, valid
    assert list(data["entries"]) == ["bf16-bh128-n4096-dk128-dv128"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Store(FP, tmp_path).get("bf16-bh128-n4096-dk128-dv128") is not None


def test_file_that_is_not_utf8_warns_is_ignored_and_rebuilt(tmp_path):
    path = Store(FP, tmp_path).path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"format": "rtkernels-autotune/1", "entries": {"\xff\xfe": 1}}')
    with pytest.warns(RuntimeWarning, match="corrupt.*UnicodeDecodeError"):
        store = Store(FP, tmp_path)
    assert store.buckets() == {}
    res, _ = fake_tune()
    autotune.record(store, res)
    assert list(json.loads(path.read_text())["entries"]) == ["bf16-bh128-n4096-dk128-dv128"]


@pytest.mark.parametrize("entry, why", [
    ({"method": "chunk", "configs": {"chunk": {"segments": 2}}}, "expected the keys"),
    ({"method": "chunk", "configs": {"chunk": {"wgmma": True, "bv": 48, "segments": 1}}}, "bv=48"),
    ({"method": "chunk", "configs": {"chunk": {"wgmma": 1, "bv": 64, "segments": 1}}}, "expected a bool"),
    ({"method": "chunk", "configs": {"chunk": {"wgmma": True, "bv": 64, "segments": 0}}}, "positive"),
    ({"method": "warp", "configs": {}}, "unknown method 'warp'"),
    ({"method": "chunk", "configs": {"vanilla": {}}}, "no tuned configs"),
    ({"method": "chunk", "configs": [1]}, "configs"),
])
def test_entries_the_library_cannot_run_are_ignored_with_a_warning(_entry_check, tmp_path, entry, why):
    """A hand-edited or foreign entry never reaches a kernel launch (a missing key was a KeyError
    in the user's call): the selection is None, so the heuristics run, and one warning names it."""
    store = Store(FP, tmp_path)
    store.put("bf16-bh128-n4096-dk128-dv128", entry)
    autotune.use_store(0, store)
    with pytest.warns(RuntimeWarning, match=f"ignoring the autotune entry bf16-bh128-n4096-dk128-dv128.*{why}"):
        assert autotune.selection(0, torch.bfloat16, 128, 4096, 128, 128) is None
    assert autotune.tuned_config("chunk", 0, torch.bfloat16, 128, 4096, 128, 128) is None


def test_entries_of_real_configs_pass_the_check(_entry_check, tmp_path):
    store = Store(FP, tmp_path)
    config = {"wgmma": True, "bv": 64, "segments": 5}  # a segment count the heuristic may pick
    store.put("bf16-bh128-n4096-dk128-dv128", {"method": "chunk", "configs": {"chunk": config,
                                                                             "scan": {"t": 8, "nt": 128}}})
    autotune.use_store(0, store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.tuned_config("chunk", 0, torch.bfloat16, 128, 4096, 128, 128) == tuple(sorted(config.items()))


def test_file_of_another_gpu_or_source_hash_is_not_used(tmp_path):
    res, _ = fake_tune()
    autotune.record(Store(FP, tmp_path), res)
    for field, value in (("gpu", "NVIDIA H100 80GB HBM3"), ("sources", "fedcba9876543210"), ("sms", 114),
                         ("capability", "8.0"), ("nvrtc", "12.9"), ("rtkernels", "0.2.0")):
        other = {**FP, field: value}
        assert Store(other, tmp_path).buckets() == {}  # its own file: none yet
        # a file of FP copied to the path of the other fingerprint is detected and not used
        target = Store(other, tmp_path).path
        target.write_text(Store(FP, tmp_path).path.read_text())
        with pytest.warns(RuntimeWarning, match="another device or source"):
            assert Store(other, tmp_path).buckets() == {}
        target.unlink()


def test_read_only_directory_warns_once_and_keeps_results_in_memory(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    else:  # root writes anywhere: make every write fail the way a read-only directory does
        def deny(*a, **k):
            raise PermissionError(13, "Permission denied", str(ro))
        monkeypatch.setattr("rtkernels.jit.files.tempfile.mkstemp", deny)
    try:
        store = Store(FP, ro)
        res1, _ = fake_tune()
        res2, _ = fake_tune(problem=Problem(1, 32, 16384, 128, 128, "bf16"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autotune.record(store, res1)
            autotune.record(store, res2)
        msgs = [str(w.message) for w in caught if "cannot write" in str(w.message)]
        assert len(msgs) == 1 and "kept in memory" in msgs[0]
        assert not store.writable
        assert set(store.buckets()) == {"bf16-bh128-n4096-dk128-dv128", "bf16-bh32-n16384-dk128-dv128"}
        assert not store.path.exists()
        autotune.use_store(0, store)  # lookups see the in-memory results
        assert autotune.selection(0, torch.bfloat16, 128, 4096, 128, 128).method == "vanilla"
    finally:
        ro.chmod(0o755)


def _concurrent_worker(args):
    directory, i = args
    from rtkernels import autotune as at
    from rtkernels.autotune.space import Problem as P
    from rtkernels.autotune.tuner import Candidate as C, tune as run

    store = at.Store(FP, directory)
    for rep in range(3):
        problem = P(1, 1 << i, 1024 << rep, 64, 64, "bf16")
        cands = [(C.of("chunk", {"bv": bv}), None) for bv in (32, 64)]
        res = run(problem, cands, lambda c: (lambda: c), lambda fn: 1.0 + fn().params["bv"] + i, lambda c, o: None)
        at.record(store, res)
    return i


def test_eight_concurrent_processes_leave_a_valid_complete_file(tmp_path):
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ctx.Pool(8) as pool:
        assert sorted(pool.map(_concurrent_worker, [(str(tmp_path), i) for i in range(8)])) == list(range(8))
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert data["fingerprint"] == FP and len(data["entries"]) == 24
    assert all(e["configs"]["chunk"] == {"bv": 32} for e in data["entries"].values())
    assert not [p for p in path.parent.iterdir() if p.suffix == ".tmp"]


# ------------------------------------------------------------------------- lookup path --- #

def test_selection_reads_the_store_and_costs_well_under_a_microsecond(tmp_path):
    store = Store(FP, tmp_path)
    res, _ = fake_tune(times={"chunk bv=32": 3.0, "chunk bv=64": 2.0})
    autotune.record(store, res)
    autotune.use_store(0, store)
    sel = autotune.selection(0, torch.bfloat16, 128, 4000, 128, 128)  # same bucket as 4096
    assert sel.method == "chunk" and sel.bucket == "bf16-bh128-n4096-dk128-dv128"
    assert autotune.tuned_config("chunk", 0, torch.bfloat16, 128, 4000, 128, 128) == (("bv", 64),)
    assert autotune.tuned_config("scan", 0, torch.bfloat16, 128, 4000, 128, 128) is None
    assert autotune.selection(0, torch.bfloat16, 128, 8192, 128, 128) is None  # another bucket
    assert autotune.selection(0, torch.float64, 128, 4096, 128, 128) is None   # never tuned
    calls, batches = 20_000, []
    for _ in range(7):  # the best batch: robust to a busy CI machine
        t0 = time.perf_counter()
        for _ in range(calls):
            autotune.tuned_config("chunk", 0, torch.bfloat16, 128, 4000, 128, 128)
        batches.append((time.perf_counter() - t0) / calls)
    per_call = min(batches)
    assert per_call < 1e-6, f"{per_call * 1e9:.0f} ns per lookup"
    with autotune.forced("chunk", (("bv", 32),)):
        assert autotune.tuned_config("chunk", 0, torch.bfloat16, 128, 4000, 128, 128) == (("bv", 32),)
        assert autotune.tuned_config("scan", 0, torch.bfloat16, 128, 4000, 128, 128) is None


def test_no_tuning_on_a_call_unless_asked(tmp_path, monkeypatch):
    store = Store(FP, tmp_path)
    autotune.use_store(0, store)
    calls = []

    def fake_tune_problem(problem, device_index, **kw):
        calls.append(problem)
        return fake_tune(problem=problem)[0]

    monkeypatch.setattr(cuda, "tune_problem", fake_tune_problem)
    monkeypatch.delenv("RTKERNELS_AUTOTUNE", raising=False)
    assert autotune.selection(0, torch.bfloat16, 64, 1024, 128, 128) is None and calls == []
    monkeypatch.setenv("RTKERNELS_AUTOTUNE", "1")
    autotune.clear(stores=False)
    with pytest.warns(RuntimeWarning, match="RTKERNELS_AUTOTUNE"):
        sel = autotune.selection(0, torch.bfloat16, 64, 1024, 128, 128)
    assert sel.method == "vanilla" and calls == [Problem(1, 64, 1024, 128, 128, "bf16")]
    assert "bf16-bh64-n1024-dk128-dv128" in json.loads(store.path.read_text())["entries"]
    autotune.selection(0, torch.bfloat16, 64, 1024, 128, 128)
    assert len(calls) == 1  # memoised
    autotune.set_autotune_on_miss(False)
    assert autotune.selection(0, torch.bfloat16, 64, 2048, 128, 128) is None and len(calls) == 1


def test_a_broken_store_never_breaks_a_call(monkeypatch):
    def boom(device_index):
        raise RuntimeError("driver went away")

    monkeypatch.setattr(autotune.answers, "store_for_device", boom)
    with pytest.warns(RuntimeWarning, match="using the heuristics"):
        assert autotune.selection(0, torch.bfloat16, 64, 1024, 128, 128) is None


def test_cpu_tensors_never_look_anything_up():
    q = torch.zeros(1, 2, 8, 16)
    assert autotune.lookup(q, q) is None


# ---------------------------------------------------------------------- config spaces --- #

PROBLEMS = [Problem(4, 32, 4096, 128, 128, "bf16"), Problem(1, 32, 16384, 128, 128, "fp16"),
            Problem(8, 16, 2048, 64, 64, "bf16"), Problem(1, 8, 1 << 20, 128, 128, "bf16"),
            Problem(2, 3, 333, 256, 32, "bf16"), Problem(2, 32, 1024, 128, 128, "fp32"),
            Problem(1, 1, 100, 40, 24, "fp32")]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.label())
def test_every_runnable_candidate_is_compiled_by_ci(problem):
    """Each unpruned config maps to a template instance that the compile test covers."""
    from rtkernels.methods import block, chunk, fleet, kernel_instances, scan

    inst = kernel_instances()
    limits = Limits(sms=132)
    cands = cuda.candidates(problem, limits)
    assert cands[0][0].method == cuda.heuristic_method(problem) and cands[0][0].default
    dt = problem.torch_dtype
    for cand, why in cands:
        if why or not cand.config:
            continue
        if cand.method == "chunk":
            for vec in (False, True):
                launch = chunk.tuned_launch(cand.config, problem, Limits(sms=1), vec=vec)
                assert launch.name in inst[launch.source], launch.name
        elif cand.method == "scan":
            scan._launch_config.cache_clear()
            assert scan.tuned_launch(cand.config, problem, limits)[0] in inst["scan.cu"]
        elif cand.method == "fleet":
            rank_tile = fleet.tuned_launch(cand.config, problem, limits)
            assert scan._launch_config(dt, problem.dk, rank_tile)[0] in inst["scan.cu"]
        elif cand.method == "block":
            assert block.tuned_launch(cand.config, problem, limits)[0] in inst["block.cu"]


@pytest.mark.parametrize("problem", PROBLEMS[:5], ids=lambda p: p.label())
def test_chunk_default_config_is_todays_heuristic(problem):
    from rtkernels.methods import chunk

    sms = 132
    cfg = chunk.TUNE_SPACE.default(problem, Limits(sms=sms))
    dt = problem.torch_dtype
    bv = chunk.kernel_config(dt, problem.dk, problem.dv, True)[2]
    tiles = -(-problem.dv // bv)
    nseg = chunk.segments_for(problem.bh * tiles, problem.n, sms)
    seg_len = -(-problem.n // (nseg * chunk.CHUNK_KERNEL)) * chunk.CHUNK_KERNEL
    nseg = -(-problem.n // seg_len)
    heur = chunk.name_expression(chunk.kernel_config(dt, problem.dk, problem.dv, True, problem.bh * nseg * tiles, sms))
    name, tbv, tseg = chunk.tuned_launch(autotune.freeze(cfg), problem, Limits(sms=sms, max_smem=0))[:3]
    assert (name, tbv, tseg) == (heur, bv, nseg)
    assert chunk.TUNE_SPACE.check(problem, cfg, Limits(sms=sms)) is None


def test_pruning_by_shared_memory_threads_and_memory():
    from rtkernels.methods import chunk, scan

    p = Problem(1, 8, 1 << 20, 256, 256, "bf16")
    small_smem = Limits(sms=108, max_smem=100 * 1024)
    reasons = [why for _, why in chunk.TUNE_SPACE.configs(p, small_smem)]
    assert all(r for r in reasons) and any("shared memory" in r for r in reasons)
    assert "static shared memory" in scan.TUNE_SPACE.check(p, {"t": 16, "nt": 256}, Limits())
    assert "threads" in scan.TUNE_SPACE.check(p, {"t": 8, "nt": 256}, Limits(max_threads=128))
    vanilla = dict((c.method, why) for c, why in cuda.candidates(p, Limits()) if c.method == "vanilla")
    assert "GiB" in vanilla["vanilla"]


def test_configs_of_a_hopelessly_slow_method_are_pruned_after_its_first():
    times = {"chunk bv=32": 1.0, "scan bv=8": 50.0, "scan bv=16": 40.0, "block bv=32": 5.0, "block bv=64": 0.5}
    cands = [(Candidate.of(lbl.split(" bv=")[0], {"bv": int(lbl.split("=")[1])}), None) for lbl in times]
    res = tune(PROBLEM, cands, lambda c: (lambda: c.label()), lambda fn: times[fn()], lambda c, o: None)
    status = {t.candidate.label(): t.status for t in res.trials}
    assert status == {"chunk bv=32": "ok", "scan bv=8": "ok", "scan bv=16": "pruned", "block bv=32": "ok",
                      "block bv=64": "ok"}
    assert "over 10x the best" in res.trials[2].error and res.best.candidate.label() == "block bv=64"


def test_fold_parts_fill_one_wave_in_whole_chunks():
    """The states pass's slots per segment: whole chunks, at least 4 per slot, no more CTAs than
    SMs (1 where a single slot per segment already fills them)."""
    import itertools

    from rtkernels.methods.chunk import CHUNK_KERNEL, fold_parts

    assert fold_parts(4096, 4, 32, 132) == 1  # (1, 32, 16384, 128) forward on an H100: 96 CTAs already
    assert fold_parts(8192, 2, 64, 132) == 2  # its dq pass with dlog(gamma): 64 -> 128 CTAs
    assert fold_parts(4096, 1, 32, 132) == 1  # one segment: no states pass
    assert fold_parts(384, 3, 2, 132) == 1  # 6 chunks: no part of 4
    assert fold_parts(1408, 3, 1, 132) == 2  # 22 chunks: 2 parts of 11
    for seg_len, segs, tiles, sms in itertools.product((256, 704, 2048, 8192), (2, 3, 5), (1, 12, 64, 300),
                                                       (108, 132)):
        r = fold_parts(seg_len, segs, tiles, sms)
        chunks = seg_len // CHUNK_KERNEL
        assert chunks % r == 0 and (r == 1 or (chunks // r >= 4 and tiles * (segs - 1) * r <= sms))


def test_dlog_launch_splits_as_the_forward(monkeypatch):
    """The dq pass with dlog(gamma): one segment while its CTAs fill half the SMs, else the forward's
    split (segments_for, one CTA per SM), whole chunks each; Overrides.segments wins."""
    from rtkernels.methods.chunk import Overrides, dlog_launch, plan, segments_for, split

    monkeypatch.setattr(plan, "_sm_count", lambda dev: 132)
    bf16 = torch.bfloat16
    plan.dlog_launch.cache_clear()
    assert dlog_launch(bf16, 128, 128, 4 * 32, 4096, 0).segments == 1  # mid: 256 CTAs
    assert dlog_launch(bf16, 128, 128, 32, 16384, 0).segments == 2  # long: 64 CTAs -> 2 segments
    assert dlog_launch(bf16, 128, 128, 2, 16384, 0).segments == split(16384, segments_for(4, 16384, 132, 1))[1]
    assert dlog_launch(bf16, 64, 40, 4, 1000, 0).segments == 1  # short: never split
    assert dlog_launch(bf16, 128, 128, 4 * 32, 4096, 0, Overrides(segments=3)).segments == 3
    assert dlog_launch(bf16, 128, 128, 2, 65, 0, Overrides(segments=3)).segments == 2  # 65 tokens: 2 chunks
    assert "true, true>" in dlog_launch(bf16, 128, 128, 32, 16384, 0).name  # the DLOG instance
    plan.dlog_launch.cache_clear()
