"""Scratch: the split-sequence strategy's passes at the long shape (1, 32, 16384, 128) bf16, with
the dedicated states kernel (rtk_chunk_states) and with the fused kernel's states-only mode:
each pass back-to-back, the whole call event-timed with L2 flushed (as bench.run), and the
segment counts / value tiles around the heuristic's.

    python -m bench.diag_split
"""
import math

import torch

import rtkernels
from bench.timing import back_to_back_ms, time_call
from rtkernels.api import _log_decay
from rtkernels.methods import chunk

dev = torch.device("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)


def ev(fn):  # one call, event-timed, L2 flushed (us)
    return time_call(fn, dev, 40, flush)["ms"] * 1e3


def loop(fn):  # back-to-back calls, mean (us)
    return back_to_back_ms(fn) * 1e3


B, H, N, D = 1, 32, 16384, 128
g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))
q, k = (torch.randn(B, H, N, D, device=dev).bfloat16() / D ** 0.5 for _ in range(2))
v = torch.randn(B, H, N, D, device=dev).bfloat16()
ld = _log_decay(g, None, H, q.device)
ref = rtkernels.causal_linear_attention(q.float(), k.float(), v.float(), g, method="chunk")
api = lambda: rtkernels.causal_linear_attention(q, k, v, g, method="chunk")
for dedicated in (True, False):
    chunk.dedicated_states = dedicated
    out = torch.empty_like(v)
    cl = chunk.ChunkLaunch(q, k, v, ld, 1.0, out, False)
    local = torch.empty((cl.nseg, B, H, D, D), dtype=torch.float32, device="cuda")
    s_in = torch.empty_like(local)
    qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p1 = lambda: cl.states(qp, kp, vp, op, cl.lg_ptr, 0, local.data_ptr())
    p3 = lambda: cl.fused(qp, kp, vp, op, cl.lg_ptr, (local if cl.scan is None else s_in).data_ptr(), 0)
    scan = "folded" if cl.scan is None else f"{loop(lambda: cl.scan(local.data_ptr(), s_in.data_ptr(), 0, 0, cl.lg_ptr)):.1f} us"
    err = ((api().float() - ref).norm() / ref.norm()).item()
    print(f"dedicated={dedicated} nseg={cl.nseg}: states {loop(p1):.1f} us, scan {scan}, "
          f"fused {loop(p3):.1f} us | api flushed {ev(api):.1f} us, back-to-back {loop(api):.1f} us, err {err:.1e}",
          flush=True)
chunk.dedicated_states = True
default_config = chunk.states_config
for sbv, stages in ((128, 4), (128, 3), (64, 3), (64, 4), (64, 2)):
    chunk.states_config = lambda dt, dk, dv, vec, lim: (*default_config(dt, dk, dv, vec, lim)[:2], sbv, vec, stages)
    rtkernels.api._fast.clear()  # planned calls hold the previous states kernel
    out = torch.empty_like(v)
    cl = chunk.ChunkLaunch(q, k, v, ld, 1.0, out, False)
    local = torch.empty((cl.nseg, B, H, D, D), dtype=torch.float32, device="cuda")
    p1 = lambda: cl.states(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cl.lg_ptr, 0, local.data_ptr())
    err = ((api().float() - ref).norm() / ref.norm()).item()
    print(f"  states kernel bv{sbv} stages{stages}: {loop(p1):.1f} us, api flushed {ev(api):.1f} us, err {err:.1e}", flush=True)
chunk.states_config = default_config
for bvf, sf in ((128, 2), (128, 3), (128, 4), (128, 6), (64, 4), (64, 8)):
    chunk.force_bv, chunk.force_segments = bvf, sf
    print(f"  bv{bvf} seg{sf}: flushed {ev(api):.1f} us, back-to-back {loop(api):.1f} us", flush=True)
chunk.force_bv = chunk.force_segments = None
