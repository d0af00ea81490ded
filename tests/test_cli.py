"""The command line on the CPU: --help of every subcommand, info, and the GPU subcommands'
one-sentence exit without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtkernels import cli
from rtkernels.env import no_gpu_reason
from rtkernels.autotune.space import Problem
from rtkernels.autotune.tuner import Candidate, Trial, TuneResult

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = no_gpu_reason() is not None
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the behaviour without a GPU")


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_every_subcommand_has_help(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rtkernels") and (command is None or command in out)


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("info", "demo", "check", "autotune", "bench"):
        assert name in out


@needs_no_gpu
@pytest.mark.parametrize("argv", [["autotune"], ["autotune", "--preset", "standard", "--dtype", "bf16"],
                                  ["check"], ["bench"], ["bench", "--shapes", "mid"]])
def test_gpu_subcommands_exit_with_one_sentence_without_gpu(argv, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.endswith(".") and "needs a CUDA GPU" in err and "Traceback" not in err
    assert captured.out == ""


@needs_no_gpu
def test_no_gpu_exit_from_a_fresh_process_has_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "rtkernels", "autotune"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "needs a CUDA GPU" in res.stderr


def test_info_exits_zero_and_shows_caches(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RTKERNELS_CACHE_DIR", str(tmp_path))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "autotune store" in out and str(tmp_path / "autotune") in out and "RTKERNELS_CACHE_DIR" in out
    assert "compiled kernels" in out and "tune on first use" in out
    if NO_GPU:
        assert "no CUDA GPU" in out


def test_autotune_problems_from_preset_and_explicit_shapes():
    parser = cli.build_parser()
    args = parser.parse_args(["autotune"])
    probs = cli.autotune.parse_problems(args)
    assert len(probs) == 11 and Problem(4, 32, 4096, 128, 128, "fp16") in probs
    args = parser.parse_args(["autotune", "--shapes", "mid", "2x4x100x64x32", "--dtype", "fp32"])
    assert cli.autotune.parse_problems(args) == [Problem(4, 32, 4096, 128, 128, "fp32"), Problem(2, 4, 100, 64, 32, "fp32")]
    with pytest.raises(ValueError):
        cli.autotune.parse_problems(parser.parse_args(["autotune", "--shapes", "2x4x100"]))


def test_autotune_summary_table():
    p = Problem(4, 32, 4096, 128, 128, "bf16")
    trials = [Trial(Candidate.of("chunk", {"bv": 64}, default=True), "ok", ms=0.5),
              Trial(Candidate.of("chunk", {"bv": 32}), "ok", ms=0.4),
              Trial(Candidate.of("vanilla"), "pruned", error="memory"),
              Trial(Candidate.of("scan"), "compile-error", error="x")]
    res = TuneResult(p, trials, heuristic_method="chunk")
    table = cli.autotune.table([(p, "bf16-bh128-n4096-dk128-dv128", res),
                                 (p, "b", TuneResult(p, trials[2:], heuristic_method="chunk"))])
    lines = table.splitlines()
    assert "chunk" in lines[2] and "bv=32" in lines[2] and "0.4000" in lines[2] and "1.25x" in lines[2]
    assert "2/1/1" in lines[2] and "NONE PASSED" in lines[3]
