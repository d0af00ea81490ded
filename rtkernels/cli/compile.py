"""``rtkernels compile``: every kernel instance into the disk cache ahead of the first call."""

from __future__ import annotations

import argparse
import re
import sys
import time

from .common import PROG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", help="the GPU architecture to compile for, e.g. sm_90 (H100, H200) or sm_80 "
                                       "(A100); default: the current GPU's. No GPU is needed with --arch")
    parser.add_argument("--jobs", type=int, default=0, help="compiler threads (default: one per core)")
    parser.add_argument("--sources", nargs="+", default=(), metavar="SOURCE",
                        help="only these sources under cuda_src/ (default: all), e.g. decode.cu chunk/fwd16.cu")


def run(args: argparse.Namespace) -> int:
    from ..instances import by_source, requests
    from ..jit import backend_name, precompile
    from ..jit.backend import selection
    from ..env import kernel_cache_dir

    arch = args.arch
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            print(f"{PROG} compile: no CUDA GPU to read the architecture from; pass --arch (e.g. sm_90)",
                  file=sys.stderr)
            return 2
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    if re.fullmatch(r"sm_\d+", arch) is None:  # the runtime keys by the GPU's own sm_XY (sm_90a: by option)
        print(f"{PROG} compile: --arch must be sm_<major><minor> as a GPU reports it, e.g. sm_90 or sm_80; "
              f"got {arch!r}", file=sys.stderr)
        return 2
    unknown = sorted(set(args.sources) - set(by_source()))
    if unknown:
        print(f"{PROG} compile: no such kernel source: {', '.join(unknown)} (see rtkernels info)", file=sys.stderr)
        return 2
    if args.jobs < 0:
        print(f"{PROG} compile: --jobs must be 0 (one per core) or more, got {args.jobs}", file=sys.stderr)
        return 2
    if backend_name() is None:  # no GPU needed, but CuPy's NVRTC (or PyCUDA with nvcc)
        print(f"{PROG} compile: no kernel compiler: {selection().reason}", file=sys.stderr)
        return 2
    todo = requests(arch, tuple(args.sources))
    t0 = time.perf_counter()
    done = precompile(todo, arch, args.jobs)
    secs = time.perf_counter() - t0
    print(f"{len(done['compiled'])} compiled, {len(done['cached'])} already cached, {len(done['failed'])} failed "
          f"of {len(todo)} instances for {arch} in {secs:.1f} s; cache: {kernel_cache_dir()[0]}")
    for name, err in done["failed"]:
        print(f"  failed: {name}: {err}", file=sys.stderr)
    from .. import compiled_call

    t0 = time.perf_counter()
    compiled_call.build(wait=True)  # host code: the compiled entry of cached calls (optional)
    print(f"compiled entry of cached calls: {compiled_call.status()} ({time.perf_counter() - t0:.1f} s)")
    return 1 if done["failed"] else 0
