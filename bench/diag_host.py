"""Scratch: where the bench's per-call time goes at the small shape (event-timed, L2 flushed, as
bench.run measures), and the three launches of the split strategy at the long shape.

    python -m bench.diag_host
"""
import math
import statistics

import torch

import rtkernels
from rtkernels.methods import chunk
from rtkernels.methods._launch import fwd_args
from rtkernels.jit import get_function, launch

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def ev(fn, reps=60, do_flush=True):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        if do_flush:
            flush.zero_()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


def loop(fn, reps=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps * 1e3


def setup(B, H, N, D):
    g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))
    q, k = (torch.randn(B, H, N, D, device="cuda").bfloat16() / D ** 0.5 for _ in range(2))
    v = torch.randn(B, H, N, D, device="cuda").bfloat16()
    return q, k, v, g


q, k, v, g = setup(2, 32, 1024, 128)
api = lambda: rtkernels.causal_linear_attention(q, k, v, g, method="chunk")
name, bv, nseg, smem, threads, opts = chunk._plan(q.dtype, 128, 128, True, 64, 1024, 0, chunk._overrides())
fn = get_function(chunk.SOURCE, name, 0, extra_options=opts, dynamic_smem=smem)
out = torch.empty_like(v)
from rtkernels.api import _log_decay
ld = _log_decay(g, None, 32, q.device)
args = (*fwd_args(q, k, v, out, ld, None, None, 1.0), 1024, 0)
raw = lambda: launch(fn, (64, 128 // bv, 1), (threads, 1, 1), args, 0, shared_mem=smem)
empty = lambda: torch.empty(2, 32, 1024, 128, dtype=torch.bfloat16, device="cuda")
print(f"small {name} bv={bv} nseg={nseg}")
print(f"  event, flushed: api {ev(api):.1f} us  raw launch {ev(raw):.1f} us  nothing {ev(lambda: None):.1f} us")
print(f"  event, warm L2: api {ev(api, do_flush=False):.1f} us  raw launch {ev(raw, do_flush=False):.1f} us")
print(f"  back-to-back:   api {loop(api):.1f} us  raw launch {loop(raw):.1f} us")

for shape in ((1, 32, 16384, 128), (4, 32, 4096, 128)):
    q, k, v, g = setup(*shape)
    B, H, N, D = shape
    api = lambda: rtkernels.causal_linear_attention(q, k, v, g, method="chunk")
    name, bv, nseg, smem, threads, opts = chunk._plan(q.dtype, D, D, True, B * H, N, 0, chunk._overrides())
    print(f"{shape} {name} bv={bv} nseg={nseg}: api event {ev(api):.1f} us, back-to-back {loop(api):.1f} us")
    if nseg == 1:
        continue
    fn = get_function(chunk.SOURCE, name, 0, extra_options=opts, dynamic_smem=smem)
    ld = _log_decay(g, None, H, q.device)
    out = torch.empty_like(v)
    seg_len = -(-N // (nseg * 64)) * 64
    local = torch.empty(nseg, B * H, D, D, dtype=torch.float32, device="cuda")
    s_in = torch.empty_like(local)
    a = fwd_args(q, k, v, out, ld, None, None, 1.0)
    grid = (B * H, -(-D // bv), nseg)
    p1 = lambda: launch(fn, grid, (threads, 1, 1), (*a[:5], 0, local.data_ptr(), *a[7:], seg_len, 1), 0, shared_mem=smem)
    scan_fn = get_function(chunk.SOURCE, "rtk_chunk_seg_scan", 0)
    lg = ld.tensor(torch.float32)
    total = B * H * D * D
    p2 = lambda: launch(scan_fn, (min(-(-total // 256), 4096), 1, 1), (256, 1, 1),
                        (local.data_ptr(), s_in.data_ptr(), 0, 0, lg.data_ptr(), nseg, B * H, H, D * D, seg_len,
                         N - (nseg - 1) * seg_len), 0)
    p3 = lambda: launch(fn, grid, (threads, 1, 1), (*a[:5], s_in.data_ptr(), 0, *a[7:], seg_len, 0), 0, shared_mem=smem)
    print(f"  states pass {loop(p1):.1f} us, seg scan {loop(p2):.1f} us, fused pass {loop(p3):.1f} us")
    for bvf, sf in ((128, 2), (128, 3), (128, 4), (64, 2), (64, 4)):
        chunk.force_bv, chunk.force_segments = bvf, sf
        print(f"  bv{bvf} seg{sf}: back-to-back {loop(api):.1f} us")
    chunk.force_bv = chunk.force_segments = None
