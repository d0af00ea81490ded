"""JIT figures for the bench JSON: cold compile time of each kernel, first call with a warm cache.

* ``nvrtc_offline_s``: NVRTC alone (``compile_offline``, sm_90, no GPU needed) per kernel: the
  bf16 instance with KMAX 128 where the kernel has one (else its first). Measured in this process.
* On a GPU, two fresh processes share a new, empty ``RTKERNELS_CACHE_DIR`` (kernel cache):
  - ``cold``: each kernel method's first call at (1, 2, 256, 128) in bf16 (scan/fleet/block also
    fp32), with the compile times of ``rtkernels.jit.compile_log()`` (NVRTC + load), per kernel;
  - ``warm``: the same calls in a new process: the first call's wall time (target <= 100 ms) and
    the module load times from the disk cache.

``python -m rtkernels.cli.bench.jit`` prints the figures as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The directory that holds the ``rtkernels`` package (put on the children's path).
ROOT = Path(__file__).resolve().parents[3]
TARGET_COLD_S, TARGET_WARM_MS = 3.0, 100.0

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import rtkernels
from rtkernels.jit import compile_log
t_import = time.perf_counter() - t0
out = {"import_s": t_import, "first_call_ms": {}}
dev = torch.device("cuda", 0)
for method in %(methods)r:
    for dt in ((torch.bfloat16, torch.float32) if method != "chunk" else (torch.bfloat16,)):
        q, k, v = (torch.randn(1, 2, 256, 128, device=dev, dtype=dt) for _ in range(3))
        torch.cuda.synchronize()
        t = time.perf_counter()
        rtkernels.causal_linear_attention(q, k, v, 0.99, method=method)
        torch.cuda.synchronize()
        out["first_call_ms"][f"{method} {str(dt).replace('torch.', '')}"] = (time.perf_counter() - t) * 1e3
out["kernels"] = compile_log()
print("JSON" + json.dumps(out))
"""


def _child(cache: str) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, RTKERNELS_CACHE_DIR=cache, CUPY_CACHE_DIR=cache, PYTHONPATH=path)
    from ...methods import METHODS

    methods = tuple(name for name, m in METHODS.items() if m.kernel is not None)
    res = subprocess.run([sys.executable, "-c", _CHILD % {"methods": methods}], capture_output=True, text=True,
                         env=env, timeout=600)
    for line in res.stdout.splitlines():
        if line.startswith("JSON"):
            return json.loads(line[4:])
    return {"error": (res.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def offline_compile_times(arch: str = "sm_90") -> dict[str, float]:
    """Seconds of NVRTC alone per kernel source (its bf16 KMAX 128 instance where it has one, else
    its first), no GPU needed."""
    from ...jit import compile_offline
    from ...methods import kernel_instances

    out = {}
    for source, names in kernel_instances().items():
        name = next((n for n in names if "<2, 128," in n), names[0])
        t0 = time.perf_counter()
        compile_offline(source, [name], arch)
        out[f"{source} {name}"] = time.perf_counter() - t0
    return out


def measure(gpu: bool) -> dict[str, Any]:
    """The JIT figures (see the module docstring); the GPU parts only when ``gpu``."""
    res: dict[str, Any] = {"targets": {"cold_compile_s": TARGET_COLD_S, "warm_first_call_ms": TARGET_WARM_MS}}
    try:
        res["nvrtc_offline_s"] = offline_compile_times()
    except Exception as exc:
        res["nvrtc_offline_s"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if not gpu:
        res["cold"] = res["warm"] = {"skipped": "no CUDA GPU"}
        return res
    with tempfile.TemporaryDirectory(prefix="rtk-jit-") as cache:
        res["cold"] = _child(cache)
        res["warm"] = _child(cache)
    return res


if __name__ == "__main__":
    import torch

    print(json.dumps(measure(torch.cuda.is_available()), indent=1))
