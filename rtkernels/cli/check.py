"""``rtkernels check``: GPU self-test, every method against the fp64 reference on odd shapes."""

from __future__ import annotations

import argparse

from .common import require_gpu


#: (B, H, N, Dk, Dv): odd sizes, one token, the largest head, a sequence of several chunks.
CHECK_SHAPES = ((1, 3, 77, 40, 24), (2, 2, 130, 64, 96), (3, 2, 1, 128, 128), (1, 2, 333, 256, 32),
                (1, 2, 1000, 128, 128))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", "--dtypes", dest="dtype", nargs="+", choices=("bf16", "fp16", "fp32"),
                        default=["bf16", "fp16", "fp32"], help="dtypes to check (default: all three)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")


def run(args: argparse.Namespace) -> int:
    status = require_gpu("check", "the GPU self-test")
    if status is not None:
        return status
    import math

    import torch

    from .. import METHODS, causal_linear_attention as cla
    from ..methods import auto_method
    from .demo import TOLERANCES

    dev = torch.device("cuda", args.device)
    names = [*METHODS, "auto"]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    lines = [("shape", "dtype", *names)]
    failures = 0
    for b, h, n, dk, dv in CHECK_SHAPES:
        gen = torch.Generator(device=dev).manual_seed(n)
        gamma = -torch.expm1(torch.linspace(math.log(1 / 32), math.log(1 / 512), h, dtype=torch.float64))
        for dt in args.dtype:
            dtype = dtypes[dt]
            q, k = (torch.randn(b, h, n, dk, generator=gen, device=dev).div_(math.sqrt(dk)).to(dtype) for _ in range(2))
            v = torch.randn(b, h, n, dv, generator=gen, device=dev).to(dtype)
            ref = cla(q.double(), k.double(), v.double(), gamma, method="vanilla")
            tol = TOLERANCES[str(dtype).replace("torch.", "")] * (max(1.0, (n / 1024) ** 0.5) if dt == "fp32" else 1.0)
            row = [f"{b}x{h}x{n}x{dk}x{dv}", dt]
            for m in names:
                try:
                    out = cla(q, k, v, gamma, method=m)
                    torch.cuda.synchronize(dev)
                    err = float((out.double() - ref).norm() / ref.norm())
                    ran = auto_method(q, v) if m == "auto" else m
                    path = "k" if METHODS[ran].uses_kernel(q, v) else "t"
                    ok = math.isfinite(err) and err <= tol
                    row.append(f"{'ok' if ok else 'FAIL'} {err:.0e} {path}")
                except Exception as exc:
                    ok = False
                    row.append(f"ERROR {type(exc).__name__}")
                failures += not ok
            lines.append(tuple(row))
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    print(f"rtkernels check on {torch.cuda.get_device_name(dev)}: relative error against the fp64 reference "
          "(k: CUDA kernel, t: torch path)")
    for i, r in enumerate(lines):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    total = (len(lines) - 1) * len(names)
    print(f"check: {total - failures}/{total} passed" + ("" if failures == 0 else f", {failures} FAILED"))
    return 1 if failures else 0
