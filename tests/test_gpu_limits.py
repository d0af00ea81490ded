"""Limits and faults on the GPU (marker ``gpu``; the heaviest also ``slow``).

* More than 2^31 elements per tensor, where 32-bit index arithmetic would overflow: the forward of
  every kernel method, and the chunk forward + kernel backward (dlog(gamma) kernel included),
  against exact fp64 rows sampled along the whole sequence (tests/fp64_models.py computes them on
  the GPU by the closed form). About 40 GB of GPU memory at the peak: run the ``slow`` tests
  alone, not beside other GPU test workers (``pytest -m slow -p no:xdist``).
* Out of memory is torch's ``OutOfMemoryError`` (forward and backward), and the library works
  afterwards.
* Four threads on four streams, racing on first calls (planning, the call cache) and then on
  cached calls, give the bits the same calls give one after another.
* Repeated forward and backward runs are bitwise identical, for every kernel variant.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

import rtkernels
from rtkernels import call_cache
from rtkernels.methods import METHODS, chunk

import fp64_models as fm
from tolerances import assert_close

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
#: (1, 16, 2^20 + 100, 128): 2,147,688,448 elements per tensor (> 2^31), a partial last chunk.
HUGE = (1, 16, (1 << 20) + 100, 128)


def _huge_inputs(layout: str, seed: int, grad_out: bool = False):
    """bf16 q, k, v (and dL/do) of shape HUGE in ``layout``, drawn on the GPU in bf16 (no fp32
    temporaries of 8 GB), q and k scaled by Dk^-1/2."""
    b, h, n, d = HUGE
    shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = [torch.randn(shape, generator=g, device="cuda", dtype=BF16) for _ in range(4 if grad_out else 3)]
    out[0].mul_(d ** -0.5)
    out[1].mul_(d ** -0.5)
    return out


def _bhnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bhnd" else x.transpose(1, 2)


def _sample_rows(n: int, seed: int = 0) -> list[int]:
    """Rows at both ends, around chunk (64) and 2^16 / 2^20 boundaries, and random ones."""
    fixed = {0, 1, 63, 64, 65, 1000, (1 << 16) - 1, 1 << 16, n // 2, (1 << 20) - 1, 1 << 20, n - 65, n - 2, n - 1}
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, n, (12,), generator=g).tolist()
    return sorted(x for x in fixed | set(rand) if 0 <= x < n)


#: Per-head factors from 0.9 to 1 (the last head keeps everything over 2^20 tokens).
def _huge_decay() -> torch.Tensor:
    return torch.linspace(0.9, 1.0, HUGE[1], device="cuda", dtype=torch.float64).float()


@pytest.mark.slow
@pytest.mark.parametrize("method, layout", [("chunk", "bhnd"), ("chunk", "bnhd"), ("scan", "bhnd"),
                                            ("fleet", "bhnd"), ("block", "bhnd")])
def test_forward_beyond_2_31_elements(method, layout):
    """Output rows sampled over the whole sequence and the final state against exact fp64."""
    q, k, v = _huge_inputs(layout, seed=1)
    assert q.numel() > 2 ** 31
    qb, kb, vb = (_bhnd(x, layout) for x in (q, k, v))
    assert METHODS[method].uses_kernel(qb, vb)
    decay = _huge_decay()
    out, state = rtkernels.causal_linear_attention(q, k, v, decay, scale=0.7, method=method, layout=layout,
                                                   return_state=True)
    rows = _sample_rows(HUGE[2])
    ref = fm.sampled_rows(qb, kb, vb, decay.double(), rows, scale=0.7)
    got = _bhnd(out, layout)[:, :, rows]
    assert_close(got, ref, BF16, f"{method} {layout} sampled rows")
    # the chunk kernel's state takes bf16 products, the others accumulate fp32 FMAs
    state_tol = BF16 if method == "chunk" else torch.float32
    assert_close(state, fm.final_state(kb, vb, decay.double()), state_tol, f"{method} {layout} final state",
                 n=HUGE[2])


@pytest.mark.slow
def test_forward_backward_beyond_2_31_elements():
    """The chunk kernel forward and the kernel backward (three passes, two reversed, and the
    dlog(gamma) kernel for the decay tensor that requires grad): sampled rows of dq, dk, dv and
    every head's d(decay) against exact fp64."""
    q, k, v, g = _huge_inputs("bhnd", seed=2, grad_out=True)
    decay = _huge_decay().requires_grad_(True)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = rtkernels.causal_linear_attention(q, k, v, decay, scale=0.7, method="chunk")
    torch.autograd.backward(out, g)  # dL/do = g, no fp32 copy of the output
    del out
    gam = decay.detach().double()
    rows = _sample_rows(HUGE[2], seed=1)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    want = {"dq": fm.sampled_rows(g, vd, kd, gam, rows, 0.7),
            "dk": fm.sampled_rows(vd, g, qd, gam, rows, 0.7, reverse=True),
            "dv": fm.sampled_rows(kd, qd, g, gam, rows, 0.7, reverse=True)}
    for (name, ref), x in zip(want.items(), (q, k, v)):
        assert x.grad.dtype == BF16
        assert_close(x.grad[:, :, rows], ref, BF16, f"{name} sampled rows")
    dlog = fm.log_decay_grad_long(qd, kd, vd, g, gam, 0.7)
    assert_close(decay.grad, dlog / gam, BF16, "d(decay)")


# ------------------------------------------------------------------------------ out of memory --- #

def _small_case(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 300, 64, generator=g, device="cuda").div_(8).to(BF16) for _ in range(3))
    return q, k, v, torch.tensor([0.5, 0.9, 0.99], device="cuda")


def _library_still_works():
    """A forward and a backward after the fault, against fp64."""
    q, k, v, d = _small_case(5)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = rtkernels.causal_linear_attention(*leaves, d, method="chunk")
    assert_close(out, fm.masked(q, k, v, d.double()), BF16, "forward after OOM")
    w = torch.randn_like(out)
    out.backward(w)
    want = fm.masked_grads(q, k, v, w, d.double())
    for name, x, r in zip(("dq", "dk", "dv"), leaves, want):
        assert_close(x.grad, r, BF16, f"{name} after OOM")


@pytest.mark.parametrize("method", ["chunk", "scan", "auto"])
def test_out_of_memory_forward_is_torch_oom(method):
    """An output that cannot fit (512 GiB; the inputs are broadcast views of a few bytes) raises
    torch.OutOfMemoryError, not a crash or another error; the library works afterwards."""
    base = torch.randn(1, 1, 1, 128, device="cuda", dtype=BF16)
    q = k = v = base.expand(1, 2048, 1 << 20, 128)
    with pytest.raises(torch.OutOfMemoryError):
        rtkernels.causal_linear_attention(q, k, v, 0.9, method=method)
    torch.cuda.empty_cache()
    _library_still_works()


def test_out_of_memory_in_backward_is_torch_oom():
    """torch's allocator capped just above what the forward holds: the backward's gradients do not
    fit and it raises torch.OutOfMemoryError; with the cap lifted, forward and backward work."""
    b, h, n, d = 4, 32, 4096, 128  # 128 MiB per tensor
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, w = (torch.randn(b, h, n, d, generator=g, device="cuda").div_(d ** 0.5).to(BF16) for _ in range(4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    rtkernels.causal_linear_attention(*leaves, 0.99, method="chunk").backward(w)  # kernels compiled and loaded
    # on a stream of its own: torch's allocator gives a stream only blocks allocated for it, so free
    # blocks that earlier tests in this process left in partly used segments (reserved memory
    # empty_cache cannot release, which the cap below counts as used) cannot serve the backward
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = rtkernels.causal_linear_attention(*leaves, 0.99, method="chunk")
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        # room for one 128 MiB gradient, not three
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(dev) + (200 << 20)) / total, dev)
        with pytest.raises(torch.OutOfMemoryError), torch.cuda.stream(side):
            out.backward(w)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.current_stream().wait_stream(side)
    del out, leaves
    torch.cuda.empty_cache()
    _library_still_works()


# -------------------------------------------------------------------- threads and streams --- #

def _thread_items():
    """(name, thunk) pairs: each thunk runs one call (and its backward) and returns its tensors.
    Shapes, dtypes and methods differ, so the threads plan, cache and launch different kernels."""
    g = torch.Generator(device="cuda").manual_seed(11)

    def draw(*shape, dtype=BF16):
        return (torch.randn(*shape, generator=g, device="cuda") / math.sqrt(shape[-1])).to(dtype)

    a = [draw(2, 4, 1000, 64) for _ in range(3)] + [draw(2, 4, 1000, 64)]
    b = [draw(1, 2, 4100, 128, dtype=torch.float32) for _ in range(3)]
    c = [draw(1, 3, 700, 96, dtype=torch.float16), draw(1, 3, 700, 96, dtype=torch.float16),
         draw(1, 3, 700, 40, dtype=torch.float16)]
    d = [draw(1, 2, 500, 128, dtype=BF16) for _ in range(3)]
    e = [draw(2, 2, 300, 64, dtype=torch.float32) for _ in range(3)]
    decay4 = torch.tensor([0.5, 0.9, 0.99, 1.0], device="cuda")

    def chunk_train():
        leaves = [x.clone().requires_grad_(True) for x in a[:3]]
        dec = decay4.clone().requires_grad_(True)
        out = rtkernels.causal_linear_attention(*leaves, dec, method="chunk")
        out.backward(a[3])
        return [out.detach(), *(x.grad for x in leaves), dec.grad]

    def chunk_tf32():  # few CTAs over 4100 tokens: the split-sequence strategy
        return list(rtkernels.causal_linear_attention(*b, 0.99, method="chunk", fp32_precision="tf32",
                                                      return_state=True))

    def scan_state():
        return list(rtkernels.causal_linear_attention(*c, 0.9, method="scan", return_state=True))

    def fleet_bnhd():
        return [rtkernels.causal_linear_attention(*(x.transpose(1, 2) for x in d), 0.999, method="fleet",
                                                  layout="bnhd")]

    def block_auto():
        return [rtkernels.causal_linear_attention(*e, 0.8, method="block"),
                rtkernels.causal_linear_attention(*e, 0.8, method="auto")]

    return [("chunk_train", chunk_train), ("chunk_tf32", chunk_tf32), ("scan_state", scan_state),
            ("fleet_bnhd", fleet_bnhd), ("block_auto", block_auto)]


def _run_threads(items, rounds: int = 3):
    """Four threads, each on its own stream, each running every item ``rounds`` times in its own
    order, started together (a barrier): {(thread, round, item): tensors}."""
    streams = [torch.cuda.Stream() for _ in range(4)]
    barrier = threading.Barrier(4)
    results, errors = {}, []

    def worker(t):
        try:
            with torch.cuda.stream(streams[t]):
                barrier.wait()
                for r in range(rounds):
                    for i in range(len(items)):
                        name, fn = items[(i + t) % len(items)]
                        results[(t, r, name)] = [x.clone() for x in fn()]
            streams[t].synchronize()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def test_four_threads_on_four_streams_match_serial_calls():
    """Cold (call cache and plans cleared: the threads race on planning and caching) and warm
    (cached calls), every result is bit for bit what the same call gives alone on the default
    stream."""
    items = _thread_items()
    torch.cuda.synchronize()
    call_cache.clear()
    cold = _run_threads(items)
    serial = {name: [x.clone() for x in fn()] for name, fn in items}
    torch.cuda.synchronize()
    warm = _run_threads(items)
    for label, res in (("cold", cold), ("warm", warm)):
        assert len(res) == 4 * 3 * len(items)
        for (t, r, name), tensors in res.items():
            want = serial[name]
            assert len(tensors) == len(want)
            for i, (x, y) in enumerate(zip(tensors, want)):
                assert torch.equal(x, y), f"{label}: thread {t}, round {r}, {name}: tensor {i} differs from serial"


# ------------------------------------------------------------------------------- determinism --- #

#: (method, dtype, chunk overrides, fp32_precision): every forward kernel variant and its backward.
DETERMINISM = [
    ("chunk", BF16, {"segments": 1}, None), ("chunk", torch.float16, {"segments": 3}, None),
    ("chunk", BF16, {"segments": 3, "dedicated_states": False}, None),
    ("chunk", BF16, {"wgmma": False, "segments": 1}, None),
    ("chunk", torch.float32, {"segments": 1}, "exact"), ("chunk", torch.float32, {"segments": 3}, "tf32"),
    ("scan", BF16, {}, None), ("fleet", torch.float16, {}, None), ("block", torch.float32, {}, None),
]


@pytest.mark.parametrize("method, dtype, overrides, precision", DETERMINISM,
                         ids=[f"{m}-{str(d).replace('torch.', '')}-{i}" for i, (m, d, _, _) in enumerate(DETERMINISM)])
def test_repeated_forward_and_backward_are_bitwise_identical(method, dtype, overrides, precision):
    """Three runs of forward (output, final state) and backward (dq, dk, dv, dS_0, d(decay)) give
    the same bits: no atomics, fixed-order reductions, the same plan every time."""
    g = torch.Generator(device="cuda").manual_seed(21)
    b, h, n, dk, dv = 1, 3, 2500, 128, 96
    q, k, v = (torch.randn(b, h, n, d, generator=g, device="cuda").div_(d ** 0.5).to(dtype) for d in (dk, dk, dv))
    s0 = torch.randn(b, h, dk, dv, generator=g, device="cuda")
    w = torch.randn(b, h, n, dv, generator=g, device="cuda").to(dtype)
    ws = torch.randn(b, h, dk, dv, generator=g, device="cuda")
    runs = []
    with chunk.override(**overrides):
        for _ in range(3):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, s0)]
            decay = torch.tensor([0.9, 0.99, 1.0], device="cuda", requires_grad=True)
            out, state = rtkernels.causal_linear_attention(*leaves[:3], decay, method=method, initial_state=leaves[3],
                                                           return_state=True, fp32_precision=precision)
            torch.autograd.backward([out, state], [w, ws])
            runs.append([out.detach(), state.detach(), *(x.grad for x in leaves), decay.grad])
    names = ("out", "state", "dq", "dk", "dv", "dS0", "ddecay")
    for r in runs[1:]:
        for name, x, y in zip(names, r, runs[0]):
            assert torch.equal(x, y), f"{method} {dtype} {overrides}: {name} differs between runs"
