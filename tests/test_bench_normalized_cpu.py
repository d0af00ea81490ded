"""``rtkernels bench --impls linear_attention`` on the CPU (a --quick smoke run): the normalized
rows ("identity", "1+qk") run next to the core call, on positive-feature inputs, against their own
fp64 reference (a small error), forward and forward + backward; they are not in the default run."""

from __future__ import annotations

import argparse
import json

import pytest

from rtkernels.cli.bench import harness


def test_linear_attention_is_not_in_the_default_impls():
    args = harness.add_arguments(argparse.ArgumentParser()).parse_args([])
    assert "linear_attention" not in args.impls and "rtkernels" in args.impls
    args = harness.add_arguments(argparse.ArgumentParser()).parse_args(["--impls", "rtkernels", "linear_attention"])
    assert args.impls == ["rtkernels", "linear_attention"]


@pytest.mark.parametrize("pass_", ["fwd", "fwdbwd"])
def test_quick_rows(tmp_path, pass_):
    argv = ["--quick", "--impls", "rtkernels", "linear_attention", "--methods", "chunk", "--shapes", "small",
            "--dtypes", "fp32", "--no-jit", "--reps", "1", "--out", str(tmp_path), "--pass", pass_]
    assert harness.main(argv) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    by = {(r["impl"], r["method"]): r for r in rows}
    assert set(by) == {("rtkernels", "chunk"), ("linear_attention", "identity"), ("linear_attention", "1+qk")}
    for key in (("linear_attention", "identity"), ("linear_attention", "1+qk")):
        r = by[key]
        assert "error" not in r, r.get("error")
        assert r["rel_err"] < 1e-5 and "normalized" in r["ref"] and r["path"] == "torch normalization"
        if pass_ == "fwdbwd":
            assert r["grad_rel_err"] < 1e-4
