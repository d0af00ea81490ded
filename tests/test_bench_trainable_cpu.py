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


#: a --quick run of two (shape, dtype) cases
TWO_CASES = ("--quick", "--impls", "rtkernels", "--methods", "chunk", "--shapes", "small", "--dtypes", "fp32", "bf16",
             "--no-jit", "--reps", "2")

def test_a_run_stopped_after_its_first_case_leaves_that_case_table(tmp_path, monkeypatch):
    """The bench rewrites its table after each (shape, dtype) case, so a run cut short from outside
    (a time limit during a slow peer's compile) keeps what it measured."""
    real, seen = harness.run_case, []

    def stop_at_second(case, dt, *args):
        if seen:
            raise KeyboardInterrupt  # what a time limit's signal would do mid-run
        seen.append((case.label, dt))
        return real(case, dt, *args)

    monkeypatch.setattr(harness, "run_case", stop_at_second)
    argv = [*TWO_CASES, "--out", str(tmp_path)]
    try:
        harness.main(argv)
    except KeyboardInterrupt:
        pass
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["partial"] == {"cases_done": 1, "cases": 2}
    assert [(r["shape"], r["dtype"]) for r in doc["rows"]] == seen and doc["rows"][0].get("ms")
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith("Partial: 1 of 2") and f"| small | {seen[0][1]} |" in md


def test_a_finished_run_is_not_marked_partial(tmp_path):
    argv = [*TWO_CASES, "--out", str(tmp_path)]
    assert harness.main(argv) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert "partial" not in doc and len(doc["rows"]) == 2
    assert not (tmp_path / "bench.md").read_text().startswith("Partial")
