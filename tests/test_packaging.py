"""The wheel is pure, carries every CUDA source, and an installed (non-editable) copy finds them."""

import os
import subprocess
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
    shipped = {p.name for p in (ROOT / "cuda_src").iterdir() if p.is_file()}
    assert shipped, "no CUDA sources in the checkout"
    for name in shipped:
        assert f"rtkernels/cuda_src/{name}" in names, f"{name} missing from the wheel"
    assert not any(n.endswith((".so", ".pyd", ".cubin")) for n in names)


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
