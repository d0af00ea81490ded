"""The wheel is pure, carries every CUDA source and the bench harness, and an installed
(non-editable) copy finds them and runs ``rtkernels bench`` outside the checkout; the sdist ships
no bench/ (profiling tools, past results)."""

import importlib.util
import os
import subprocess
import tarfile
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
                   check=True)
    (whl,) = out.glob("rtkernels-*.whl")
    return whl


def test_wheel_is_pure_and_carries_sources(wheel):
    assert wheel.name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    src = ROOT / "cuda_src"
    shipped = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()}
    assert shipped, "no CUDA sources in the checkout"
    for name in shipped:
        assert f"rtkernels/cuda_src/{name}" in names, f"{name} missing from the wheel"
    assert not any(n.endswith((".so", ".pyd", ".cubin")) for n in names)


def test_wheel_ships_the_bench_harness_and_no_results(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in ("__init__", "harness", "report", "peers", "timing", "jit"):
        assert f"rtkernels/cli/bench/{mod}.py" in names
    assert not any("results" in n or n.startswith("bench/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "rtkernels = rtkernels.cli:main" in text


@pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs the 'build' package")
def test_sdist_ships_no_bench_folder(tmp_path):
    subprocess.run([sys.executable, "-m", "build", "--sdist", "-o", str(tmp_path), str(ROOT)], check=True,
                   capture_output=True)
    (sdist,) = tmp_path.glob("rtkernels-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert "rtkernels/cli/bench/harness.py" in names and "pyproject.toml" in names
    assert not any(n.startswith("bench/") for n in names), [n for n in names if n.startswith("bench/")][:5]
    tops = {n.split("/", 1)[0] for n in names}
    assert tops <= {"rtkernels", "cuda_src", "tests", "docs", "examples", "README.md", "pyproject.toml", "PKG-INFO",
                    ".gitignore"}, tops


def test_installed_wheel_finds_its_sources(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    code = ("import rtkernels, rtkernels.jit as r; "
            "print(rtkernels.__file__); print(r.source_dir()); print(len(r.load_source('scan.cu')))")
    env = dict(os.environ, PYTHONPATH=str(target))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True)
    module_file, src_dir, length = res.stdout.split()
    assert Path(module_file).is_relative_to(target)
    assert Path(src_dir) == target / "rtkernels" / "cuda_src"
    assert int(length) > 1000


def test_installed_wheel_runs_the_bench_outside_the_checkout(wheel, tmp_path):
    """``rtkernels bench --help`` and the CPU smoke run from a non-editable install, run from a
    directory that is not the checkout."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    run = lambda *args: subprocess.run([sys.executable, "-m", "rtkernels", "bench", *args], cwd=tmp_path, env=env,
                                       capture_output=True, text=True, timeout=600)
    res = run("--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: rtkernels bench"), res.stderr
    res = run("--quick", "--shapes", "small", "--impls", "rtkernels", "torch", "--methods", "chunk", "scan",
              "--no-jit", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "rtkernels/chunk" in table and "rtkernels/scan" in table
