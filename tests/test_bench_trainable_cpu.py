"""``rtkernels bench --pass fwdbwd --trainable`` on the CPU (a --quick smoke run): each trainable row
also times the same step with a fixed decay, the two interleaved, and reports the ratio."""

from __future__ import annotations

import json

import torch

from rtkernels.cli.bench import harness, timing


def test_time_calls_interleaves_the_calls():
    order: list[str] = []
    res = timing.time_calls([lambda: order.append("a"), lambda: order.append("b")], torch.device("cpu"), 3)
    assert order == ["a", "b"] * 5  # two warm-up calls each (the first timed: first_call_ms), then 3 reps
    assert len(res) == 2 and all(r["reps"] == 3 and r["ms"] >= 0 for r in res)


def test_trainable_rows_carry_the_fixed_decay_time(tmp_path):
    argv = ["--quick", "--impls", "rtkernels", "--methods", "chunk", "--shapes", "small", "--dtypes", "fp32",
            "--no-jit", "--reps", "2", "--out", str(tmp_path), "--pass", "fwdbwd", "--trainable"]
    assert harness.main(argv) == 0
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert "error" not in row, row.get("error")
    assert row["decay"].endswith("trainable") and row["decay_grad_rel_err"] < 1e-4
    assert row["fixed_ms"] > 0 and abs(row["x_fixed"] - row["ms"] / row["fixed_ms"]) < 1e-12
    assert "| fixed ms | × fixed |" in (tmp_path / "bench.md").read_text()


def test_short_calls_repeat_more_unless_reps_is_given():
    from rtkernels.cli.bench import timing

    calls = []
    res = timing.time_calls([lambda: calls.append(1)], torch.device("cpu"), 3, extend=True)
    assert res[0]["reps"] == timing.MAX_REPS and len(calls) == 2 + timing.MAX_REPS  # a call of microseconds
    calls.clear()
    res = timing.time_calls([lambda: calls.append(1)], torch.device("cpu"), 3)
    assert res[0]["reps"] == 3 and len(calls) == 2 + 3
