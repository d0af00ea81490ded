"""Scratch: the fp32 chunk kernel's tiles at (4, 32, 4096, 128): time (kernel only) and error of
several (BV, STAGES, MINB) instances and compile-time knobs, both modes.
python -m bench.diag_f32 [B H N D]"""
import math
import os
import sys

import torch

import rtkernels
from bench.timing import back_to_back_ms
from rtkernels.decay import LogDecay
from rtkernels.methods import chunk
from rtkernels.methods._launch import fwd_args
from rtkernels.jit import get_function, launch

TILES = [(64, 2, 1), (32, 2, 1), (64, 1, 1)]
KNOBS = [(), ("-DRTK_F32_KUNROLL=2",)]
# DIAG_VARIANTS="src:threads,..." (other copies of chunk.cu in cuda_src/, e.g. an older warp layout): the
# default tile of each, with and without the knobs; DIAG_MODES="exact" or "exact,tf32"


def main():
    b, h, n, d = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (4, 32, 4096, 128)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda") / d ** 0.25 for _ in range(3))
    ref = rtkernels.causal_linear_attention(q[:1].double(), k[:1].double(), v[:1].double(), 0.99, method="chunk")
    ld = LogDecay(q.device, host=tuple(math.log(0.99) for _ in range(h)))
    kmax = chunk._kmax(d)
    variants = [(v.split(":")[0], int(v.split(":")[1])) for v in os.environ.get("DIAG_VARIANTS", "").split(",") if v]
    modes = [m == "exact" for m in os.environ.get("DIAG_MODES", "exact,tf32").split(",")]
    if variants:
        runs = [(src, thr, TILES[0], o) for src, thr in variants for o in KNOBS]
    else:
        runs = [(chunk.SOURCE, 0, t, ()) for t in TILES] + [(chunk.SOURCE, 0, TILES[0], o) for o in KNOBS[1:]]
    for exact in modes:
        for src, threads, (bv, stages, minb), opts in runs:
            name = f"rtk_chunk_fwd_f32<{kmax}, {bv}, {stages}, {str(exact).lower()}, true, {minb}>"
            smem = chunk.f32_smem_bytes(kmax, bv, stages)
            try:
                fn = get_function(src, name, 0, extra_options=opts, dynamic_smem=smem)
                out = torch.full_like(v, float("nan"))
                args = (*fwd_args(q, k, v, out, ld, None, None, 1.0), n, 0)
                f = lambda: launch(fn, (b * h, -(-d // bv), 1), (threads or chunk.f32_threads(exact), 1, 1), args, 0, shared_mem=smem)
                f()
                torch.cuda.synchronize()
                err = ((out[:1].double() - ref).norm() / ref.norm()).item()
                ms = back_to_back_ms(f, reps=10)
                a = fn.attributes
                print(f"{src:12s} {name:46s} {' '.join(opts):24s} smem={smem:6d} {ms:.3f} ms err={err:.2e} "
                      f"regs={a.get('num_regs')} local={a.get('local_size_bytes')}", flush=True)
            except Exception as exc:  # noqa: BLE001 (scratch)
                print(name, "FAILED", str(exc)[:200], flush=True)


if __name__ == "__main__":
    main()
