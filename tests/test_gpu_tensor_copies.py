"""The states pass's Hopper instances (marker ``gpu``; compute capability 9.0, where they exist):
``rtk_chunk_states`` loading its tiles by tensor copies, through tensor maps that the launch
builds once and points at each call's tensors, and updating the state with wgmma. Checked against
the fp64 reference (forward, final state and the gradients, whose backward passes read the
tensors in reverse; dlog gamma with a trainable decay, the DLOG instance), and bit for bit against
the cp.async instances on mma.sync (same data, the same products summed k-step by k-step in the
same order: the H100 gives the same bits), with the maps following new tensors on the cached call,
under a CUDA graph, and without a host sync."""

from __future__ import annotations

import pytest
import torch

from inputs import force_chunk, no_host_sync

import rtkernels
from rtkernels import call_cache
from rtkernels.methods.chunk import backward, launch

from reference import reference
from test_gpu_grad import _case
from tolerances import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="tensor copies need compute capability 9.0")]

#: (B, H, N, Dk, Dv, layout): square, Dk != Dv both ways (two value tiles: the boxes of the second
#: start at column 128), widths that are not powers of two (boxes partly past the last column),
#: Dk 256 (four key boxes; S split by rows), Dk 64 and 40 (one row block of S: split by value
#: columns), the other layout, N not a multiple of the chunk (the last segment's tail: the states
#: pass never reads it).
SHAPES = [(1, 2, 4096, 128, 128, "bhnd"), (1, 3, 1030, 128, 256, "bhnd"), (2, 2, 2000, 128, 64, "bhnd"),
          (1, 2, 1500, 96, 80, "bnhd"), (1, 2, 1100, 256, 64, "bhnd"), (2, 2, 700, 128, 128, "bnhd"),
          (2, 2, 2000, 64, 128, "bhnd"), (1, 2, 1500, 40, 104, "bnhd")]


def _spy(monkeypatch) -> list:
    """Whether each states launch planned from here got tensor maps (not the zeros of cp.async)."""
    got = []
    real = launch._kv_maps

    def spy(k, v, offsets):
        maps = real(k, v, offsets)
        got.append(maps is not launch._NO_MAPS)
        return maps

    monkeypatch.setattr(launch, "_kv_maps", spy)
    return got


def _run(leaves, decay, layout, s0, w, ws):
    out, state = rtkernels.causal_linear_attention(*leaves, decay, scale=0.8, method="chunk", layout=layout,
                                                   initial_state=s0, return_state=True)
    ((out.float() * w.float()).sum() + (state * ws).sum()).backward()
    return out.detach(), state.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tensor_copies_match_reference_and_cp_async(shape, dtype, monkeypatch):
    force_chunk(monkeypatch, segments=3)
    used = _spy(monkeypatch)
    b, h, n, dk, dv, layout = shape
    for gamma in (0.9, 0.99):
        (q, k, v, s0, decay, w, ws), want = _case(shape, dtype, gamma)
        ref_out, ref_state = reference(q.double(), k.double(), v.double(), decay.detach().double(), 0.8, layout,
                                       s0.double())
        results = {}
        for tma in (True, False):
            force_chunk(monkeypatch, segments=3, tensor_copies=tma)
            call_cache.clear()
            backward.clear_plans()
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            results[tma] = _run(leaves, decay.detach().float(), layout, s0, w, ws)
        out, state, grads = results[True]
        what = f"{dtype} {shape} gamma={gamma}"
        assert_close(out, ref_out, dtype, f"out {what}", n=n)
        assert_close(state, ref_state, dtype, f"state {what}", n=n)
        for name, g_, r in zip("qkv", grads, want[:3]):
            assert_close(g_, r, dtype, f"d{name} {what}", n=n)
        for a, b_, name in zip((out, state, *grads), (results[False][0], results[False][1], *results[False][2]),
                               ("out", "state", "dq", "dk", "dv")):
            assert torch.equal(a, b_), f"{name}: tensor copies and cp.async differ ({what})"
        if dtype == torch.bfloat16:  # a trainable decay: the dq pass's DLOG states instance
            force_chunk(monkeypatch, segments=3)
            call_cache.clear()
            backward.clear_plans()
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            trained = decay.detach().float().requires_grad_(True)
            _run(leaves, trained, layout, s0, w, ws)
            assert_close(trained.grad, want[4], dtype, f"d(decay) {dtype} {shape} gamma={gamma}", n=n)
    assert used and any(used), f"no states launch took tensor maps: {used}"


def test_maps_follow_new_tensors_graph_and_no_sync(monkeypatch):
    """The cached call repeated on other tensors (the maps' addresses swapped), a reversed pass
    (the backward), a CUDA graph of the forward, and no host sync on the warm call."""
    force_chunk(monkeypatch, segments=4)
    used = _spy(monkeypatch)
    shape = (1, 4, 4096, 128, 128, "bhnd")
    decay = torch.tensor([0.9, 0.99, 0.999, 0.95], device="cuda")
    q, k, v = _case(shape, torch.bfloat16, 0.99)[0][:3]
    fresh = [(q * 0.5, k.flip(2).contiguous(), v * 2.0), (q, k, v)]
    for qq, kk, vv in fresh:
        want = reference(qq.double(), kk.double(), vv.double(), decay.double(), 1.0, "bhnd")[0]
        got = rtkernels.causal_linear_attention(qq, kk, vv, decay, method="chunk")
        assert_close(got, want, torch.bfloat16, "forward on new tensors", n=4096)
    with no_host_sync():
        out = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk")
    static = [x.clone() for x in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rtkernels.causal_linear_attention(*static, decay, method="chunk")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = rtkernels.causal_linear_attention(*static, decay, method="chunk")
    for x, y in zip(static, (q * -1.0, k, v)):
        x.copy_(y)
    graph.replay()
    eager = rtkernels.causal_linear_attention(q * -1.0, k, v, decay, method="chunk")
    torch.cuda.synchronize()
    assert torch.equal(graphed, eager), "graph replay differs from eager"
    assert torch.equal(out, rtkernels.causal_linear_attention(q, k, v, decay, method="chunk"))
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    rtkernels.causal_linear_attention(*leaves, decay, method="chunk").backward(v)
    refs = [x.double().requires_grad_(True) for x in (q, k, v)]
    want = torch.autograd.grad((reference(*refs, decay.double(), 1.0, "bhnd")[0] * v.double()).sum(), refs)
    for name, g_, r in zip("qkv", leaves, want):
        assert_close(g_.grad, r, torch.bfloat16, f"d{name}", n=4096)
    assert used and all(used), f"a states launch fell back to cp.async: {used}"
