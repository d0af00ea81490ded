"""rtkernels' compiled-kernel disk cache (rtkernels.jit.kernel_cache), without a GPU."""

import json
import os
import warnings

import pytest

from rtkernels.jit import kernel_cache as kc


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kc, "_warned", False)
    return tmp_path / "kernels"


def test_round_trip_and_recorded_nvrtc(cache):
    key = kc.cache_key("source text", "k<1>", ("-std=c++17",), "sm_90a")
    assert kc.load(key) is None and kc.recorded_nvrtc() is None
    kc.save(key, kc.CachedKernel(b"\x7fELF image", "_Z1kILi1EEvv", "cubin"), (13, 0), "sm_90a")
    got = kc.load(key)
    assert (got.image, got.lowered, got.kind) == (b"\x7fELF image", "_Z1kILi1EEvv", "cubin")
    assert kc.recorded_nvrtc() == (13, 0)
    assert not list(cache.glob("*.tmp"))  # atomic writes leave no temporaries


@pytest.mark.parametrize("change", [("other text", "k<1>", ("-std=c++17",), "sm_90a"),
                                    ("source text", "k<2>", ("-std=c++17",), "sm_90a"),
                                    ("source text", "k<1>", ("-std=c++17", "-DX=1"), "sm_90a"),
                                    ("source text", "k<1>", ("-std=c++17",), "sm_90")])
def test_every_input_of_the_compile_is_in_the_key(change):
    assert kc.cache_key(*change) != kc.cache_key("source text", "k<1>", ("-std=c++17",), "sm_90a")


def test_corrupt_or_partial_entries_are_compiled_again(cache):
    key = kc.cache_key("t", "k", (), "sm_80")
    kc.save(key, kc.CachedKernel(b"img", "_Z1k", "cubin"), (12, 9), "sm_80")
    (cache / f"{key}.json").write_text("{not json")
    assert kc.load(key) is None
    kc.save(key, kc.CachedKernel(b"img", "_Z1k", "cubin"), (12, 9), "sm_80")
    os.remove(cache / f"{key}.bin")
    assert kc.load(key) is None
    kc.save(key, kc.CachedKernel(b"image bytes", "_Z1k", "cubin"), (12, 9), "sm_80")
    (cache / f"{key}.bin").write_bytes(b"image by")  # truncated
    assert kc.load(key) is None
    (cache / f"{key}.bin").write_bytes(b"garbage!!!!")  # same length, other bytes
    assert kc.load(key) is None
    kc.save(key, kc.CachedKernel(b"image bytes", "_Z1k", "cubin"), (12, 9), "sm_80")
    assert kc.load(key).image == b"image bytes"  # saved again: found again
    meta = {"format": "something else", "lowered": "_Z1k"}
    (cache / f"{key}.json").write_text(json.dumps(meta))
    (cache / f"{key}.bin").write_bytes(b"img")
    assert kc.load(key) is None


def test_unwritable_directory_warns_once_and_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache root is a file: nothing can be created under it (root included)
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(blocker))
    monkeypatch.setattr(kc, "_warned", False)
    key = kc.cache_key("t", "k", (), "sm_80")
    with pytest.warns(RuntimeWarning, match="kernel cache"):
        kc.save(key, kc.CachedKernel(b"img", "_Z1k", "cubin"), (12, 9), "sm_80")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.save(key, kc.CachedKernel(b"img", "_Z1k", "cubin"), (12, 9), "sm_80")  # no second warning
    assert kc.load(key) is None and kc.recorded_nvrtc() is None


def test_a_ptx_image_round_trips_as_ptx(cache):
    key = kc.cache_key("t", "k", (), "sm_120")
    kc.save(key, kc.CachedKernel(b".version 8.8\n\0", "_Z1k", "ptx"), (12, 9), "sm_120")
    assert kc.load(key).kind == "ptx"


@pytest.mark.parametrize("arch, want", [("sm_90a", ("cubin", "sm_90a")), ("sm_80", ("cubin", "sm_80")),
                                        ("sm_130", ("ptx", "compute_121")), ("sm_30", ("ptx", "compute_50"))])
def test_target_a_cubin_for_known_archs_else_ptx_of_the_nearest_older_one(arch, want, monkeypatch):
    from types import SimpleNamespace

    from rtkernels.jit import compiler, jit

    seen = []
    monkeypatch.setattr(compiler, "nvrtc_archs", lambda: (50, 75, 80, 86, 89, 90, 100, 120, 121))
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(compiler, "compile_offline", lambda src, names, target, opts: seen.append(target) or
                        SimpleNamespace(cubin=b"img", lowered_names={names[0]: "_Z1k"}))
    kernel, nvrtc = jit._compile("scan.cu", "k<1>", arch, ())
    assert (kernel.kind, seen[0]) == want and nvrtc == (13, 0)


def _save_from_a_process(root: str, key: str, image: bytes) -> None:
    os.environ["RTKERNELS_CACHE_DIR"] = root
    kc.save(key, kc.CachedKernel(image, "_Z1k", "cubin"), (13, 0), "sm_90a")


def test_eight_processes_saving_one_kernel_leave_one_valid_entry(tmp_path, monkeypatch):
    """Eight processes that compiled the same kernel save it into one empty cache at once: every
    save succeeds and what is left loads, whole (each file lands by rename; the JSON's sha256 ties
    it to the image beside it)."""
    import multiprocessing

    key = kc.cache_key("t", "k", (), "sm_90a")
    image = os.urandom(1 << 20)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_save_from_a_process, args=(str(tmp_path), key, image)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 8
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    got = kc.load(key)
    assert got is not None and got.image == image
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted([f"{key}.bin", f"{key}.json", "nvrtc.json"])
