"""The PyCUDA backend on a GPU (marker ``gpu``): with ``RTKERNELS_BACKEND=pycuda`` the kernels compile
with nvcc into a fresh kernel cache and give the fp64 reference's answers (the 16-bit chunk kernel,
its wgmma instance on compute capability 9.0, the fp32 chunk kernel, scan, the decode step), a
PyCUDA GPUArray call returns a GPUArray, a second process loads every kernel from that cache, and
NVRTC's kernels (CuPy, where installed) land beside nvcc's without reusing them.

Each run is a subprocess: the backend is chosen once per process. Skipped without PyCUDA or nvcc
(the ``pycuda`` extra is optional)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtkernels.jit.compiler_nvcc import find_nvcc

pytestmark = pytest.mark.gpu
pytest.importorskip("pycuda.driver", reason="PyCUDA is not installed (pip install 'rtkernels[pycuda]')")
if find_nvcc() is None:
    pytest.skip("nvcc is not installed: the PyCUDA backend compiles with it", allow_module_level=True)

TESTS = Path(__file__).resolve().parent

#: Run in a subprocess with RTKERNELS_BACKEND set: argv[1] the backend the process must be using.
#: Prints one JSON line: the compile log and what ran.
SCRIPT = r'''
import json, sys
import numpy as np
import torch

import rtkernels
from rtkernels import api
from rtkernels.jit import backend_name, compile_log
from fp64_models import decode_step
from reference import reference
from tolerances import assert_close

assert backend_name() == sys.argv[1], f"backend {backend_name()!r}, expected {sys.argv[1]!r}"
dev = torch.device("cuda", 0)


def qkv(b, h, n, dk, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = ((torch.randn(b, h, n, dk, generator=g, dtype=torch.float64) / dk ** 0.5).to(dev, dtype) for _ in "qk")
    return q, k, torch.randn(b, h, n, dv, generator=g, dtype=torch.float64).to(dev, dtype)


def forward(method, dtype, shape, seed):
    q, k, v = qkv(*shape, dtype, seed)
    out, state = rtkernels.causal_linear_attention(q, k, v, 0.97, method=method, return_state=True)
    ref, ref_state = reference(q, k, v, torch.full((shape[1],), 0.97, dtype=torch.float64))
    assert_close(out, ref, dtype, f"{method} {dtype} output", n=shape[2])
    # chunk's state update rounds its operands to the input type (tensor cores); scan sums in fp32
    assert_close(state, ref_state, dtype if method == "chunk" else torch.float32, f"{method} {dtype} state",
                 n=shape[2])


forward("chunk", torch.bfloat16, (2, 3, 300, 64, 64), 1)  # wgmma on compute capability 9.0
forward("chunk", torch.float16, (1, 2, 1000, 128, 96), 2)
forward("chunk", torch.float32, (2, 2, 257, 64, 32), 3)
forward("scan", torch.float16, (1, 2, 100, 32, 16), 4)

q, k, v = qkv(4, 2, 3, 64, 48, torch.float16, 5)
pool = torch.randn(6, 2, 64, 48, generator=torch.Generator().manual_seed(6)).to(dev) / 8
idx = torch.tensor([5, 0, 3, 1], dtype=torch.int32, device=dev)
gamma = torch.tensor([0.9, 0.99], dtype=torch.float64)
before = pool.clone()
out = rtkernels.decode(q, k, v, pool, gamma.to(dev), scale=0.7, state_indices=idx)
ref_out, ref_pool = decode_step(q, k, v, before, gamma, 0.7, idx)
assert_close(out, ref_out, torch.float16, "decode output")
assert_close(pool, ref_pool, torch.float32, "decode pool")

import pycuda.autoprimaryctx  # noqa: F401,E402  PyCUDA in torch's context (the device's primary one)
from pycuda import gpuarray  # noqa: E402

q, k, v = qkv(1, 2, 100, 32, 16, torch.float32, 7)
qg, kg, vg = (gpuarray.to_gpu(np.ascontiguousarray(x.cpu().numpy())) for x in (q, k, v))
assert api._to_torch(qg, "q")[0].data_ptr() == int(qg.gpudata)  # the input is a view, not a copy
og = rtkernels.causal_linear_attention(qg, kg, vg, 0.7, method="scan")
torch.cuda.synchronize()
assert type(og).__name__ == "GPUArray" and og.shape == (1, 2, 100, 16), type(og)
ref, _ = reference(q, k, v, torch.full((2,), 0.7, dtype=torch.float64))
assert_close(torch.from_numpy(og.get()), ref, torch.float32, "GPUArray in, GPUArray out")

props = torch.cuda.get_device_properties(0)
print(json.dumps({"log": compile_log(), "capability": [props.major, props.minor],
                  "smem_optin": props.shared_memory_per_block_optin}))
'''


def _run(backend: str, cache: Path) -> dict:
    env = {**os.environ, "RTKERNELS_BACKEND": backend, "RTKERNELS_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("RTKERNELS_AUTOTUNE", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT, backend], env=env, cwd=TESTS, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, f"RTKERNELS_BACKEND={backend} run failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The PyCUDA run on an empty kernel cache: (its report, the cache directory)."""
    cache = tmp_path_factory.mktemp("pycuda-cache")
    return _run("pycuda", cache), cache


def test_forward_calls_compile_with_nvcc_and_match_fp64(cold):
    report, cache = cold
    log = report["log"]
    sources = {r["source"] for r in log}
    assert {"chunk/fwd16.cu", "scan.cu", "decode.cu"} <= sources, sources
    if report["smem_optin"] >= 99 * 1024:  # the fp32 chunk kernel's tile fits
        assert "chunk/fwd_f32.cu" in sources
    if tuple(report["capability"]) == (9, 0) and os.environ.get("RTKERNELS_NO_WGMMA") != "1":
        assert any("-arch=sm_90a" in r["options"] for r in log), "the wgmma instance did not run"
    assert all(r["compiler"] == "nvcc" and not r["from_cache"] for r in log), log
    entries = [json.loads(p.read_text()) for p in (cache / "kernels").glob("*.json") if p.name != "nvrtc.json"]
    assert len(entries) == len(log) and all(e["compiler"] == "nvcc" and e["kind"] == "cubin" for e in entries)


def test_a_second_process_loads_every_kernel_from_the_cache(cold):
    first, cache = cold
    again = _run("pycuda", cache)["log"]
    assert [r["name"] for r in again] == [r["name"] for r in first["log"]]
    assert all(r["from_cache"] and r["compiler"] == "nvcc" for r in again), again


def test_nvrtc_kernels_land_beside_nvccs_and_never_reuse_them(cold, tmp_path):
    pytest.importorskip("cupy", reason="CuPy is not installed: no NVRTC backend to compare with")
    import shutil

    first, cache = cold
    shutil.copytree(cache, tmp_path / "both")
    log = _run("cupy", tmp_path / "both")["log"]
    assert all(r["compiler"] == "nvrtc" and not r["from_cache"] for r in log), log
    compilers = [json.loads(p.read_text())["compiler"] for p in (tmp_path / "both" / "kernels").glob("*.json")
                 if p.name != "nvrtc.json"]
    assert compilers.count("nvcc") == len(first["log"]) and compilers.count("nvrtc") == len(log)
