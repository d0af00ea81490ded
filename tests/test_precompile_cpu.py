"""``rtkernels compile`` and :func:`rtkernels.jit.precompile` without a GPU: the kernels land in the
disk cache under the keys a call on a GPU of that architecture looks up, a second run compiles
nothing, and the sm_90a instances are requested for sm_90 only."""

from __future__ import annotations

import pytest
import torch

from rtkernels.cli import main
from rtkernels.instances import by_source, requests
from rtkernels.jit import jit

SMALL = ("chunk/decay_grad_sum.cu", "chunk/seg_scan.cu")  # one instance each: quick to compile


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_compile_fills_the_cache_under_the_runtime_keys(cache, monkeypatch, capsys):
    assert main(["compile", "--arch", "sm_80", "--sources", *SMALL]) == 0
    assert "2 compiled, 0 already cached, 0 failed of 2 instances for sm_80" in capsys.readouterr().out
    # get_function on a compute-capability 8.0 device finds them (the driver's module load stubbed)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(jit.Kernel, "load", staticmethod(lambda cached, dev, smem: cached))
    monkeypatch.setattr(jit, "_functions", {})
    before = len(jit.compile_log())
    for source in SMALL:
        for name in by_source()[source]:
            entry = jit.get_function(source, name, 0)
            assert entry.kind == "cubin" and len(entry.image) > 1000
    assert [r["from_cache"] for r in jit.compile_log()[before:]] == [True] * len(SMALL)
    assert main(["compile", "--arch", "sm_80", "--sources", *SMALL]) == 0
    assert "0 compiled, 2 already cached" in capsys.readouterr().out


def test_wgmma_instances_only_for_sm90():
    hopper = requests("sm_90", ("chunk/fwd16.cu",))
    ampere = requests("sm_80", ("chunk/fwd16.cu",))
    wgmma = [r for r in hopper if r[2]]
    assert wgmma and all(r[2] == ("-arch=sm_90a",) for r in wgmma)
    assert not any(r[2] for r in ampere)
    assert {r[1] for r in ampere} < {r[1] for r in hopper}
    assert {r[1] for r in hopper} == set(by_source()["chunk/fwd16.cu"])


@pytest.mark.parametrize("argv, says", [
    (["compile", "--arch", "sm_80", "--sources", "nope.cu"], "no such kernel source: nope.cu"),
    (["compile", "--arch", "sm_80", "--jobs", "-1"], "--jobs must be 0"),
    (["compile", "--arch", "sm_90a"], "--arch must be sm_<major><minor>"),
])
def test_bad_arguments_exit_2(cache, capsys, argv, says):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_without_a_gpu_the_architecture_is_asked_for(cache, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["compile"]) == 2
    assert "pass --arch" in capsys.readouterr().err
