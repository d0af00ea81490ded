"""rtkernels.distributed.context_parallel_attention over gloo process groups on the CPU.

Every rank draws the whole sequence from one seed, keeps its piece and runs the call; the result
(outputs, the final state, gradients of q, k, v, of the decay tensor summed over the ranks and of
the initial state) is compared with a plain float64 loop over the whole sequence in one process,
written here and sharing nothing with the library. Pieces are unequal and may be empty. Each group
is one ``torch.multiprocessing`` spawn (a torch import per process), so the cases run inside a few
spawns. The GPU tests at the end run the same checks on CUDA tensors (kernel paths)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rtkernels.distributed
from rtkernels.distributed import BLOCK_BYTES, context_parallel_attention
from tolerances import assert_close

B, H, DK, DV = 2, 3, 4, 5
FACTORS = (0.9, 0.6, 1.0)        # per head, gamma = 1 included
RATES = (0.05, 0.4, 0.0)
SCALE = 0.7

#: (layout, decay form, initial state, return_state, lengths passed, dtype, grad)
CASES = (
    ("bhnd", "tensor", True, True, False, torch.float64, True),
    ("bnhd", "tensor", True, True, True, torch.float64, True),
    ("bhnd", "float", False, False, False, torch.float64, True),
    ("bnhd", "rate_float", True, True, False, torch.float64, True),
    ("bhnd", "rate_tensor", False, True, True, torch.float64, True),
    ("bnhd", "none", True, False, False, torch.float64, True),
    ("bhnd", "tensor", True, True, False, torch.float32, True),
    ("bnhd", "rate_tensor", True, True, False, torch.bfloat16, True),
    ("bnhd", "tensor", True, True, False, torch.float64, False),   # no grad: the plain forward
)


# ------------------------------------------------------------------------------ the reference

def loop_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, scale: float,
                   s0: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = gamma S_{t-1} + k_t^T v_t, o_t = scale q_t S_t token by token in float64, ``[B, H, N, D]``
    tensors; differentiable through autograd."""
    b, h, n, dk = q.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64) if s0 is None else s0
    g = gamma.view(1, h, 1, 1)
    rows = []
    for t in range(n):
        state = g * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        rows.append(scale * (q[:, :, t, None, :] @ state)[:, :, 0])
    return torch.stack(rows, dim=2), state


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if ref.numel() == 0:
        assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
        return
    assert_close(out, ref, dtype, what)


# --------------------------------------------------------------------------------- the workers

def _init(rank: int, world: int, init_file: str, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def _inputs(lengths: tuple[int, ...], seed: int, dtype: torch.dtype, positive: bool) -> dict[str, torch.Tensor]:
    """The whole sequence's tensors, drawn in float64 and rounded to ``dtype`` (the reference sees
    the rounded values); positive inputs for 16-bit and fp32 cases keep dlog(gamma) free of
    cancellation, so that a relative tolerance means something."""
    gen = torch.Generator().manual_seed(seed)
    n, world = sum(lengths), len(lengths)

    def draw(*shape: int) -> torch.Tensor:
        x = torch.rand(*shape, generator=gen, dtype=torch.float64) if positive else \
            torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to(dtype).to(torch.float64)

    return {"q": draw(B, H, n, DK), "k": draw(B, H, n, DK), "v": draw(B, H, n, DV), "s0": draw(B, H, DK, DV),
            "go": torch.randn(B, H, n, DV, generator=gen, dtype=torch.float64),
            "gs": torch.randn(world, B, H, DK, DV, generator=gen, dtype=torch.float64)}


def _piece(x: torch.Tensor, sl: slice, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's piece of a ``[B, H, N, D]`` tensor, in ``layout``'s memory order."""
    p = x[:, :, sl].to(dtype)
    return (p.transpose(1, 2) if layout == "bnhd" else p).clone(memory_format=torch.contiguous_format)


def _run_case(rank: int, lengths: tuple[int, ...], case: tuple, seed: int) -> None:
    layout, form, with_init, return_state, pass_lengths, dtype, grad = case
    world = len(lengths)
    what = f"rank {rank}/{world} lengths={lengths} case={case[:5]} {dtype}"
    x = _inputs(lengths, seed, dtype, positive=dtype != torch.float64)
    starts = [sum(lengths[:r]) for r in range(world + 1)]
    sl = slice(starts[rank], starts[rank + 1])
    q, k, v = (_piece(x[name], sl, layout, dtype).requires_grad_(grad) for name in "qkv")
    values = RATES if form.startswith("rate") else FACTORS
    decay_tensor = torch.tensor(values, dtype=torch.float64, requires_grad=grad)
    arg: Any = {"none": None, "float": FACTORS[0], "rate_float": RATES[1]}.get(form, decay_tensor)
    kwargs = {"decay_rate": arg} if form.startswith("rate") else {"decay": arg}
    s0 = x["s0"].to(torch.float64 if dtype == torch.float64 else torch.float32, copy=True).requires_grad_(grad) \
        if with_init else None
    with torch.set_grad_enabled(grad):
        res = context_parallel_attention(q, k, v, scale=SCALE, layout=layout, initial_state=s0,
                                         return_state=return_state, lengths=lengths if pass_lengths else None,
                                         **kwargs)
    out, state = res if return_state else (res, None)
    assert out.dtype == dtype and out.shape == q.shape[:-1] + (DV,), what

    # the reference: the whole sequence in one float64 loop
    rq, rk, rv = (x[name].clone().requires_grad_() for name in "qkv")
    rd = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    if form == "none":
        gamma = torch.ones(H, dtype=torch.float64)
    elif form in ("float", "rate_float"):
        gamma = torch.full((H,), FACTORS[0] if form == "float" else math.exp(-RATES[1]), dtype=torch.float64)
    else:
        gamma = torch.exp(-rd) if form == "rate_tensor" else rd
    rs0 = x["s0"].clone().requires_grad_() if with_init else None
    ro, rstate = loop_reference(rq, rk, rv, gamma, SCALE, rs0)
    tol = dtype

    def mine(t: torch.Tensor) -> torch.Tensor:  # back to [B, H, n, D]
        return t.transpose(1, 2) if layout == "bnhd" else t

    _close(mine(out), ro[:, :, sl], tol, f"{what}: output")
    if return_state:
        _close(state, rstate, tol, f"{what}: final state")
    if not grad:
        return
    go = _piece(x["go"], sl, layout, dtype)
    loss = (out * go).sum()
    ref_loss = (ro * x["go"]).sum()
    if return_state:
        loss = loss + (state * x["gs"][rank].to(state.dtype)).sum()
        ref_loss = ref_loss + (rstate * x["gs"].sum(0)).sum()
    loss.backward()
    ref_loss.backward()
    for name, t, r in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
        _close(mine(t.grad), r.grad[:, :, sl], tol, f"{what}: d{name}")
    if arg is decay_tensor:  # each rank holds its share: their sum is the whole gradient
        share = decay_tensor.grad.clone()
        dist.all_reduce(share)
        assert_close(share, rd.grad, tol, f"{what}: d(decay) summed over the ranks")
    if with_init:
        if rank == 0:
            assert_close(s0.grad, rs0.grad, tol, f"{what}: d(initial_state)")
        else:
            assert s0.grad is None, f"{what}: rank {rank}'s initial_state is not used and gets no gradient"


def _check_nan(rank: int, lengths: tuple[int, ...]) -> None:
    """A NaN in k of rank 0's piece (batch 0, head 1, token 2, column 0) reaches exactly the
    outputs the causal sum reaches: that head's rows >= 2 on rank 0, all its rows on later ranks,
    and row 0 of its final state."""
    x = _inputs(lengths, 99, torch.float64, positive=False)
    x["k"][0, 1, 2, 0] = math.nan
    starts = [sum(lengths[:r]) for r in range(len(lengths) + 1)]
    sl = slice(starts[rank], starts[rank + 1])
    out, state = context_parallel_attention(x["q"][:, :, sl], x["k"][:, :, sl], x["v"][:, :, sl],
                                            torch.tensor(FACTORS), return_state=True)
    want = torch.zeros_like(out, dtype=torch.bool)
    want[0, 1, max(0, 2 - starts[rank]):] = True
    assert torch.equal(torch.isnan(out), want), f"rank {rank}: NaN outputs"
    want_s = torch.zeros_like(state, dtype=torch.bool)
    want_s[0, 1, 0] = True
    assert torch.equal(torch.isnan(state), want_s), f"rank {rank}: NaN in the final state"


def _expect(exc: type, words: tuple[str, ...], fn, *args, **kwargs) -> None:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    for w in words:
        assert w in str(info.value), f"{exc.__name__} message lacks {w!r}: {info.value}"


def _check_errors(rank: int) -> None:
    """Two ranks whose arguments disagree, or one rank with a bad argument: every rank raises (none
    waits in a collective), and the group stays usable for the next call."""
    q, k, v = (torch.randn(B, H, 6, d, dtype=torch.float64) for d in (DK, DK, DV))
    cp = context_parallel_attention
    h_other = torch.randn(B, H + 1, 6, DK, dtype=torch.float64)
    if rank == 0:
        _expect(ValueError, ("number of heads", "rank 0: 3", "rank 1: 4"), cp, q, k, v)
    else:
        _expect(ValueError, ("number of heads",), cp, h_other, h_other, torch.randn(B, H + 1, 6, DV).double())
    if rank == 0:
        _expect(ValueError, ("rank(s) [1]", "rejected"), cp, q, k, v, scale=0.5)
    else:
        _expect(TypeError, ("scale",), cp, q, k, v, scale="half")
    _expect(TypeError, ("dtype",), cp, *(t.to(torch.float32) if rank else t for t in (q, k, v)))
    _expect(ValueError, ("scale",), cp, q, k, v, scale=1.0 + rank)
    _expect(ValueError, ("return_state",), cp, q, k, v, return_state=bool(rank))
    _expect(ValueError, ("records gradients",), cp, q.clone().requires_grad_(rank == 1), k, v)
    _expect(ValueError, ("decay",), cp, q, k, v, 0.5 + 0.25 * rank)
    # lengths given: each rank checks them alone, no exchange
    _expect(ValueError, ("lengths", "one entry per rank"), cp, q, k, v, lengths=(6,))
    _expect(ValueError, (f"lengths[{rank}]",), cp, q, k, v, lengths=(5, 5))
    # the group still works, with and without lengths
    out = cp(q, k, v, 0.8, lengths=(6, 6))
    assert torch.equal(out, cp(q, k, v, 0.8))


def _worker(rank: int, world: int, init_file: str, jobs: tuple) -> None:
    _init(rank, world, init_file)
    try:
        for job, arg in jobs:
            if job == "cases":
                for i, lengths in enumerate(arg):
                    for j, case in enumerate(CASES):
                        _run_case(rank, lengths, case, seed=100 * i + j)
            elif job == "blocks":  # token blocks of the states-only passes (None: the default)
                rtkernels.distributed.BLOCK_BYTES = arg or BLOCK_BYTES
            elif job == "nan":
                _check_nan(rank, arg)
            elif job == "errors":
                _check_errors(rank)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path, jobs: tuple, worker=_worker) -> None:
    mp.spawn(worker, args=(world, str(tmp_path / "pg"), jobs), nprocs=world, join=True)


# ---------------------------------------------------------------------------------- the tests

def test_two_ranks(tmp_path):
    """Two processes: pieces (29, 40) and (0, 41) (an empty first piece), every case; the NaN
    reach; the errors."""
    _spawn(2, tmp_path, (("cases", ((29, 40), (0, 41))), ("nan", (29, 40)), ("errors", None)))


def test_three_ranks(tmp_path):
    """Three processes: pieces (5, 64, 33) and (17, 0, 9) (an empty middle piece), every case; the
    second with the states-only passes in blocks of a few tokens."""
    _spawn(3, tmp_path, (("cases", ((5, 64, 33),)), ("blocks", 1000), ("cases", ((17, 0, 9),)), ("blocks", None),
                         ("nan", (5, 64, 33))))


def test_needs_an_initialized_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, q, q)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg1'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_is_the_library_call(one_rank):
    """A group of one: the output is the library's call bit for bit (the same fused pass), the
    state and the gradients agree with the library's to fp64 rounding."""
    x = _inputs((37,), 5, torch.float64, positive=False)
    q, k, v, s0 = (x[name].clone().requires_grad_() for name in ("q", "k", "v", "s0"))
    d = torch.tensor(FACTORS, dtype=torch.float64, requires_grad=True)
    out, state = context_parallel_attention(q, k, v, d, scale=SCALE, initial_state=s0, return_state=True)
    lib = [t.detach().clone().requires_grad_() for t in (q, k, v, s0, d)]
    ref_out, ref_state = rtkernels.causal_linear_attention(*lib[:3], lib[4], scale=SCALE, initial_state=lib[3],
                                                           return_state=True)
    assert torch.equal(out, ref_out)
    assert_close(state, ref_state, torch.float64, "state")
    ((out * x["go"]).sum() + (state * x["gs"][0]).sum()).backward()
    ((ref_out * x["go"]).sum() + (ref_state * x["gs"][0]).sum()).backward()
    for name, a, b in zip(("q", "k", "v", "initial_state", "decay"), (q, k, v, s0, d), lib):
        assert_close(a.grad, b.grad, torch.float64, f"d{name}")


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"group": "world"}, TypeError, ("group",)),
    ({"scale": math.nan}, ValueError, ("scale",)),
    ({"layout": "nhd"}, ValueError, ("layout",)),
    ({"return_state": "yes"}, TypeError, ("return_state",)),
    ({"decay": 1.5}, ValueError, ("decay",)),
    ({"decay": 0.5, "decay_rate": 0.1}, ValueError, ("decay_rate",)),
    ({"initial_state": torch.zeros(1, 2, 4, 3)}, ValueError, ("initial_state",)),
    ({"lengths": 5}, TypeError, ("lengths",)),
    ({"lengths": (5.0,)}, TypeError, ("lengths[0]",)),
    ({"lengths": (4,)}, ValueError, ("lengths[0]", "(5)")),
    ({"lengths": (5, 0)}, ValueError, ("lengths",)),
])
def test_bad_arguments_name_the_argument(one_rank, kwargs, exc, words):
    q = torch.randn(1, 2, 5, 4)
    _expect(exc, words, context_parallel_attention, q, q, q, **kwargs)


def test_bad_tensors_name_the_tensor(one_rank):
    q = torch.randn(1, 2, 5, 4)
    _expect(ValueError, ("q", "4-D"), context_parallel_attention, q[0], q, q)
    _expect(ValueError, ("k",), context_parallel_attention, q, q[:, :, :3], q)
    _expect(TypeError, ("dtype",), context_parallel_attention, q.int(), q.int(), q.int())


# ------------------------------------------------------------------------------------ on a GPU

def _gpu_worker(rank: int, world: int, init_file: str, jobs: tuple) -> None:
    """Both ranks on CUDA tensors: the kernel paths (16-bit and fp32 inputs, a CUDA decay tensor
    that requires grad), against the fp64 masked product of tests/reference.py."""
    from reference import reference

    backend, dtype, lengths = jobs
    dev = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(dev)
    _init(rank, world, init_file, backend)
    try:
        gen = torch.Generator().manual_seed(7)
        n, b, h, d = sum(lengths), 1, 4, 128
        starts = [sum(lengths[:r]) for r in range(world + 1)]
        sl = slice(starts[rank], starts[rank + 1])
        full = {name: torch.rand(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for name in "qkv"}
        s0_full = torch.rand(b, h, d, d, generator=gen, dtype=torch.float64)
        go = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
        gs = torch.randn(world, b, h, d, d, generator=gen, dtype=torch.float64)
        gamma = torch.tensor([0.99, 0.999, 0.9999, 1.0], dtype=torch.float64)
        q, k, v = (full[name][:, :, sl].to(dev).requires_grad_() for name in "qkv")
        decay = gamma.to(dev, torch.float32).requires_grad_()
        s0 = s0_full.to(dev, torch.float32).requires_grad_()
        scale = d ** -0.5
        out, state = context_parallel_attention(q, k, v, decay, scale=scale, initial_state=s0, return_state=True)
        ((out.double() * go[:, :, sl].to(dev)).sum() + (state.double() * gs[rank].to(dev)).sum()).backward()
        rq, rk, rv = (full[name].to(dev, torch.float64).requires_grad_() for name in "qkv")
        rg = gamma.to(dev).requires_grad_()
        rs0 = s0_full.to(dev).requires_grad_()
        ro, rstate = reference(rq, rk, rv, rg, scale, initial_state=rs0)
        ((ro * go.to(dev)).sum() + (rstate * gs.sum(0).to(dev)).sum()).backward()
        what = f"{backend} rank {rank} {dtype}"
        assert_close(out, ro[:, :, sl], dtype, f"{what}: output", n=n)
        assert_close(state, rstate, dtype, f"{what}: state", n=n)
        for name, t, r in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
            assert_close(t.grad, r.grad[:, :, sl], dtype, f"{what}: d{name}", n=n)
        share = decay.grad.double()
        share = share.cpu() if backend == "gloo" else share  # gloo reduces host tensors, NCCL device ones
        dist.all_reduce(share)
        assert_close(share, rg.grad, dtype, f"{what}: d(decay)", n=n)
        if rank == 0:
            assert_close(s0.grad, rs0.grad, dtype, f"{what}: d(initial_state)", n=n)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_two_ranks_gloo_one_gpu(tmp_path, dtype):
    """Two processes on one GPU through gloo (the states go through host memory)."""
    _spawn(2, tmp_path, ("gloo", dtype, (1000, 3096)), worker=_gpu_worker)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_two_ranks_nccl(tmp_path, dtype):
    """Two processes, one GPU each, NCCL."""
    _spawn(2, tmp_path, ("nccl", dtype, (2500, 1596)), worker=_gpu_worker)
