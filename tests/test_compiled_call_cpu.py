"""The compiled entry of cached calls on the CPU (rtkernels/compiled_call.py): it builds with the
system compiler against this torch, misses every call it cannot serve (here: every CPU call) and
refuses to register one; the module state its signature reads exists under the names it reads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rtkernels
from rtkernels import call_cache, compiled_call, decay
from rtkernels.autotune import answers
from rtkernels.jit.sources import source_dir
from rtkernels.methods.chunk import launch, plan


def test_builds_and_misses_cpu_calls():
    assert compiled_call.build(wait=True), compiled_call.status()
    assert compiled_call.status() == "ready"
    m = compiled_call.module
    q = torch.randn(1, 2, 8, 4)
    args = (q, q, q, 0.9, None, 1.0, "chunk", "bhnd", None, False, None)
    assert m.call(*args) is compiled_call.MISS
    assert m.call(q, q) is compiled_call.MISS  # a wrong argument count misses too (never a crash)
    assert m.register(args, (0, (1, 2, 8, 4), q, False, (), False, [], [], -1, None, None)) is False
    assert compiled_call.size() == 0
    out = rtkernels.causal_linear_attention(*args[:3], 0.9)  # the API around a miss: Python's path
    assert out.shape == (1, 2, 8, 4) and torch.isfinite(out).all()
    call_cache.clear()
    assert compiled_call.size() == 0


def test_bad_register_arguments_raise():
    assert compiled_call.build(wait=True), compiled_call.status()
    with pytest.raises(RuntimeError, match="register"):
        compiled_call.module.register((1, 2), ())


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv(compiled_call.ENV, "0")
    monkeypatch.setattr(compiled_call, "_state", "idle")
    monkeypatch.setattr(compiled_call, "module", None)
    assert not compiled_call.enabled()
    assert compiled_call.build(wait=True) is False and compiled_call.status() == "off"


def test_the_state_the_signature_reads_exists():
    """compiled_call.cpp reads these attributes by name on every call (a rename must fail here)."""
    assert type(answers._generation) is int
    assert answers._forced is None
    assert plan.overrides is plan.current_overrides()
    assert type(decay._strict) is bool


def test_program_sources_match_the_cpp_enum():
    text = (source_dir() / compiled_call.SOURCE).read_text()
    enum = re.search(r"enum Source : int \{([^}]*)\}", text).group(1)
    names = [x.strip() for x in enum.split(",") if x.strip()]
    assert [n.removeprefix("SRC_") for n in names] == [
        {"q": "Q", "k": "K", "v": "V", "out": "OUT", "decay": "DECAY", "initial_state": "S0",
         "final_state": "FINAL", "constant": "CONST", "temporary": "TEMP0"}[s] for s in launch.PROGRAM_SOURCES]


def test_the_call_cache_cap_clears_the_compiled_entry_too(monkeypatch):
    """Python's call cache starts over at its cap, and the compiled entry with it: the C++ side
    never holds a call that Python no longer caches (its own cap is only a backstop)."""
    hooks = []
    monkeypatch.setattr(call_cache, "_on_clear", [lambda: hooks.append(1)])
    monkeypatch.setattr(call_cache, "_MAX", 2)
    call_cache.clear()
    hooks.clear()
    v = torch.zeros(1, 1, 2, 2)
    for i in range(3):
        call_cache.remember(("key", i), None, v, v, False)
    assert hooks == [1] and call_cache.size() == 1
    call_cache.clear()


def test_a_build_killed_midway_does_not_block_the_next():
    """torch.utils.cpp_extension marks a build directory with a lock file, and a process killed
    mid-build (a short script that exits while the background build runs) leaves it behind: before
    the fix, every later build(wait=True) in that cache waited on it forever. Here a stale lock
    file sits in the built directory and a fresh process must still load the entry."""
    assert compiled_call.build(wait=True), compiled_call.status()
    lock = Path(compiled_call._build_dir()) / "lock"
    lock.touch()
    try:
        code = "from rtkernels import compiled_call as c; print(c.build(wait=True), c.status())"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                             env=dict(os.environ))
    finally:
        lock.unlink(missing_ok=True)
    assert run.stdout.split() == ["True", "ready"], run.stderr[-2000:]
