"""Scratch: the TF32 wgmma forward probe (tf32_wgmma_probe.cu) against fp64 and against the library's
float32 "tf32" forward, kernel time by CUDA events over back-to-back launches. (The library ran
rtk_chunk_fwd_f32, mma.sync, when the results were taken; on Hopper it now plans rtk_chunk_fwd_tf32.) Needs an sm_90a GPU and CuPy. Usage: python bench/profiling/tf32_wgmma_probe.py"""
import pathlib
import warnings

import cupy
import numpy as np
import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms

warnings.simplefilter("ignore", DeprecationWarning)
ROOT = pathlib.Path(__file__).resolve().parents[2]
SMEM = 229376 + 1024


def kernel():
    src = (ROOT / "bench/profiling/tf32_wgmma_probe.cu").read_text()
    mod = cupy.RawModule(code=src, options=("-std=c++17", "-arch=sm_90a", f"-I{ROOT / 'cuda_src'}"))
    fn = mod.get_function("rtk_tf32_probe")
    fn.max_dynamic_shared_size_bytes = SMEM
    return fn


def probe(fn, q, k, v, decay, scale):
    bh, n, _ = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
    h, dv = q.shape[1], v.shape[3]
    o = torch.empty_like(v)
    logd = torch.log(decay).float().cuda()
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):  # (deprecated in CuPy 14, still there)
        fn((bh, dv // 64, 1), (256, 1, 1), (np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()),
                                           np.uint64(o.data_ptr()), np.uint64(logd.data_ptr()), np.int32(h),
                                           np.int32(n), np.int32(dv), np.float32(scale)), shared_mem=SMEM)
    return o


def reference(q, k, v, decay, scale):
    qd, kd, vd = (x.double() for x in (q, k, v))
    n = q.shape[2]
    i = torch.arange(n, device=q.device, dtype=torch.float64)
    dist = i[:, None] - i[None, :]
    lg = torch.log(decay.double().to(q.device))[:, None, None]
    m = torch.where(dist >= 0, torch.exp(lg * dist.clamp(min=0)), torch.zeros((), dtype=torch.float64, device=q.device))
    return ((qd @ kd.transpose(-1, -2)) * m * scale) @ vd


def main():
    fn = kernel()
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, h, n, dv in ((1, 2, 256, 64), (2, 4, 512, 128)):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g) / 128 ** 0.25 for d in (128, 128, dv))
        decay = 1 - torch.exp(torch.linspace(-2.5, -6.2, h, dtype=torch.float64))
        ref = reference(q, k, v, decay, 1.0)
        o = probe(fn, q, k, v, decay, 1.0).double()
        lib = rtkernels.causal_linear_attention(q, k, v, decay.float().cuda(), method="chunk", fp32_precision="tf32").double()
        err = lambda x: ((x - ref).norm() / ref.norm()).item()
        print(f"({b}, {h}, {n}, 128, {dv}): probe rel. error {err(o):.3g}, library tf32 {err(lib):.3g}")
    for name, (b, h, n) in {"small": (2, 32, 1024), "mid": (4, 32, 4096), "long": (1, 32, 16384)}.items():
        q, k, v = (torch.randn(b, h, n, 128, device="cuda", generator=g) / 128 ** 0.25 for _ in range(3))
        decay = (1 - torch.exp(torch.linspace(-3.5, -6.2, h, dtype=torch.float64))).float().cuda()
        t_probe = min(back_to_back_ms(lambda: probe(fn, q, k, v, decay, 1.0), reps=20) for _ in range(3))
        t_lib = min(back_to_back_ms(lambda: rtkernels.causal_linear_attention(q, k, v, decay, method="chunk",
                                                                              fp32_precision="tf32"), reps=20)
                    for _ in range(3))
        roof = 4 * q.numel() * 4 / 3.35e12 * 1e3
        print(f"{name} ({b}, {h}, {n}, 128): probe {t_probe:.3f} ms, library tf32 {t_lib:.3f} ms "
              f"({t_lib / t_probe:.2f}x), copy roofline {roof:.3f} ms")


if __name__ == "__main__":
    main()
