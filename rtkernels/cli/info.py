"""``rtkernels info``: what rtkernels sees (GPUs, torch/CUDA, CuPy, NVRTC, sources, caches, tuning)."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from ..env import cupy_version, driver_version, kernel_cache_dir, nvrtc_version_text, torch_version_text
from .common import dir_summary, writable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options yet


def run(args: argparse.Namespace) -> int:
    del args
    import torch

    import rtkernels
    from ..jit import backend_name, compiler_available, list_sources, source_dir, sources_hash
    from ..jit.backend import ENV_BACKEND, selection

    def line(key: str, value: str) -> None:
        print(f"{key:<19}{value}")

    line("rtkernels", f"{rtkernels.__version__} ({Path(rtkernels.__file__).parent})")
    line("python", f"{platform.python_version()} ({platform.system()} {platform.machine()})")
    line("torch", torch_version_text())
    line("CUDA driver", driver_version())

    gpus: list[str] = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(f"cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, "
                            f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    except Exception as exc:  # a broken driver must not break `info`
        gpus.append(f"error while listing GPUs: {type(exc).__name__}: {exc}")
    for i, text in enumerate(gpus or ["no CUDA GPU"]):
        line("GPU" if i == 0 else "", text)

    cv = cupy_version()
    line("CuPy", cv or "not installed (pip install 'rtkernels[cuda12]' or 'rtkernels[cuda13]')")
    line("NVRTC", nvrtc_version_text())
    if compiler_available():
        line("CUDA kernels", f"available, compiled by the {backend_name()} backend ({selection().reason})")
    else:
        why = selection().reason if backend_name() is None else "torch sees no CUDA GPU"
        line("CUDA kernels", f"not available: {why} (torch paths only; {ENV_BACKEND} picks cupy or pycuda)")

    try:
        src = source_dir()
        line("CUDA sources", f"{src} ({', '.join(list_sources())})")
        line("sources hash", sources_hash())
    except FileNotFoundError as exc:
        line("CUDA sources", f"missing: {exc}")
    cache, origin = kernel_cache_dir()
    state = dir_summary(cache) if cache.is_dir() else "not created yet"
    line("compiled kernels", f"{cache} ({origin}; {state})")

    from ..autotune import ENV_AUTOTUNE, ENV_CACHE_DIR, Store, autotune_on_miss, store_dir
    from ..autotune.keys import device_fingerprint

    sdir = store_dir()
    origin = f"from {ENV_CACHE_DIR}" if os.environ.get(ENV_CACHE_DIR) else f"platformdirs; set {ENV_CACHE_DIR} to move it"
    files = sorted(sdir.glob("*.json")) if sdir.is_dir() else []
    line("autotune store", f"{sdir} ({origin}; {writable(sdir)}; {len(files)} results file(s))")
    line("tune on first use", f"{'on' if autotune_on_miss() else 'off'} ({ENV_AUTOTUNE}=1 turns it on)")
    if not gpus or not compiler_available():
        line("tuned", "no CUDA GPU with CuPy here: nothing to look up" + (
            f" (files for other devices: {', '.join(f.name for f in files)})" if files else ""))
        return 0
    for i in range(len(gpus)):
        try:
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                store = Store(device_fingerprint(i), sdir)
            entries = store.buckets()
            note = f" ({caught[0].message})" if caught else ""
            text = f"cuda:{i}: {len(entries)} shape bucket(s) in {store.path.name}{note}"
            line("tuned", text)
            for key, e in entries.items():
                cfg = e.get("configs", {}).get(e["method"], {})
                line("", f"  {key}: {e['method']} {' '.join(f'{k}={v}' for k, v in cfg.items())} "
                         f"{e.get('ms', float('nan')):.3f} ms")
        except Exception as exc:
            line("tuned", f"cuda:{i}: cannot read ({type(exc).__name__}: {exc})")
    return 0
