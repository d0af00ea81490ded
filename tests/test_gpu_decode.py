"""``rtkernels.decode`` on a GPU (marker ``gpu``): the ``decode.cu`` kernel against a plain fp64 token
loop for fp16/bf16/fp32, gamma from 1e-6 to 1, T in {1, 3, 16, 40}, pools with permuted and padded
indices, odd and large head sizes, aligned and unaligned pools; no host sync; a CUDA graph of a
step replayed equal to eager; a decay tensor on the GPU; the torch path on the GPU."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import rtkernels
from fp64_models import decode_step as fp64_step
from graphs import capture
from reference import reference
from tolerances import assert_close
from inputs import run_without_host_sync

pytestmark = pytest.mark.gpu

decode_module = importlib.import_module("rtkernels.decode")  # rtkernels.decode is the function

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GAMMAS = (1e-6, 0.9, 0.99, 1.0)


def inputs(b, h, t, dk, dv, dtype, slots, seed=0, layout="bhnd"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (b, h, t) if layout == "bhnd" else (b, t, h)
    q = (torch.randn(*shape, dk, generator=g, device="cuda") / dk ** 0.5).to(dtype)
    k = (torch.randn(*shape, dk, generator=g, device="cuda") / dk ** 0.5).to(dtype)
    v = torch.randn(*shape, dv, generator=g, device="cuda").to(dtype)
    pool = torch.randn(slots, h, dk, dv, generator=g, device="cuda") / dk ** 0.5
    return q, k, v, pool


def heads(gamma, h):
    """[H] factors: ``gamma`` on every head but the last, which keeps 0.5 (a second value per call)."""
    return torch.tensor([gamma] * (h - 1) + [0.5], dtype=torch.float64)


def padded_indices(b, slots, seed=0):
    """A permutation of distinct rows of the pool with every third sequence padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(slots, generator=g)[:b].to(torch.int32)
    idx[1::3] = -1
    return idx.cuda()


def check_step(q, k, v, pool, gamma, idx, dtype, layout="bhnd", scale=0.7, what="", **kw):
    before = pool.clone()
    assert decode_module.kernel_takes(q if layout == "bhnd" else q.transpose(1, 2), pool)
    out = rtkernels.decode(q, k, v, pool, scale=scale, state_indices=idx, layout=layout, **kw)
    ref_out, ref_pool = fp64_step(q, k, v, before, gamma, scale, idx, layout)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == ref_out.shape
    assert_close(out, ref_out, dtype, f"{what} output")
    assert_close(pool, ref_pool, torch.float32, f"{what} pool")
    named = set() if idx is None else {i for i in idx.tolist() if 0 <= i < pool.shape[0]}
    rows = range(q.shape[0]) if idx is None else sorted(named)
    untouched = [r for r in range(pool.shape[0]) if r not in set(rows)]
    assert torch.equal(pool[untouched], before[untouched]), f"{what}: a row no sequence names changed"
    if idx is not None:
        pad = (idx < 0) | (idx >= pool.shape[0])
        assert (out[pad] == 0).all(), f"{what}: a padded sequence's output is not zeros"
    return out


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("t", (1, 3, 16))
def test_kernel_matches_fp64(t, dtype, gamma):
    b, h, dk, dv, slots = 7, 3, 64, 48, 11
    q, k, v, pool = inputs(b, h, t, dk, dv, dtype, slots, seed=t)
    g = heads(gamma, h)
    check_step(q, k, v, pool, g, padded_indices(b, slots), dtype, decay=g.float().cuda(), what=f"T={t} gamma={gamma}")


SHAPES = [(2, 32, 128, 128), (3, 2, 1, 1), (3, 2, 40, 24), (3, 2, 33, 23), (2, 2, 200, 72), (2, 2, 256, 256),
          (2, 2, 96, 300), (1, 1, 16, 5)]  # (B, H, Dk, Dv)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ("bhnd", "bnhd"))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_head_sizes_and_layouts(shape, layout, dtype):
    """Every KMAX (Dk 1 .. 256), Dv % 4 != 0 (scalar state access), Dv over several column tiles."""
    b, h, dk, dv = shape
    slots = b + 3
    q, k, v, pool = inputs(b, h, 3, dk, dv, dtype, slots, seed=dk, layout=layout)
    idx = torch.randperm(slots)[:b].to(torch.int32).cuda()
    g = heads(0.95, h)
    check_step(q, k, v, pool, g, idx, dtype, layout=layout, decay=g.cuda(), what=f"{shape} {layout}")


@pytest.mark.parametrize("t", (1, 8, 9, 40))
def test_token_groups(t):
    """T past the kernel's group of 8 staged tokens (8, 9: one full group and one more token)."""
    q, k, v, pool = inputs(4, 2, t, 64, 64, torch.float32, 4, seed=t)
    g = heads(0.99, 2)
    check_step(q, k, v, pool, g, None, torch.float32, decay=g.cuda(), what=f"T={t}")


def test_unaligned_pool_and_int64_indices():
    """A pool whose rows are not 16-byte aligned (a view one float into a buffer): scalar state
    access; int64 indices; an index >= S is padding on the GPU (it cannot be checked there)."""
    b, h, dk, dv, slots = 5, 2, 64, 64, 6
    q, k, v, _ = inputs(b, h, 2, dk, dv, torch.bfloat16, slots)
    buf = torch.randn(slots * h * dk * dv + 2, device="cuda")
    pool = buf[1:-1].view(slots, h, dk, dv)
    edges = buf[[0, -1]].clone()
    assert decode_module._vector_width(v, pool) == 1
    idx = torch.tensor([5, 0, -3, 100, 2], dtype=torch.int64, device="cuda")
    g = heads(0.9, h)
    check_step(q, k, v, pool, g, idx, torch.bfloat16, decay=g.cuda(), what="unaligned")
    assert torch.equal(buf[[0, -1]], edges), "the step wrote next to the pool"


def test_repeated_steps_equal_one_prefill():
    """bf16: prefill with return_state=True, then steps of 1, 4 and 16 tokens through a pool."""
    b, h, n, d, prompt = 3, 4, 64, 128, 19
    q, k, v, _ = inputs(b, h, n, d, d, torch.bfloat16, 1)
    gamma = torch.tensor([0.9, 0.99, 0.999, 1.0], device="cuda")
    ref, s_ref = reference(q, k, v, gamma)
    whole = rtkernels.causal_linear_attention(q, k, v, gamma)
    first, s = rtkernels.causal_linear_attention(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], gamma,
                                                 return_state=True)
    pool = torch.zeros(8, h, d, d, device="cuda")
    slots = torch.tensor([6, 2, 4], dtype=torch.int32, device="cuda")
    pool[slots.long()] = s
    outs, pos = [first], prompt
    for step in (1, 4, 16, 1, 1, 16, 4, 2):
        outs.append(rtkernels.decode(q[:, :, pos:pos + step], k[:, :, pos:pos + step], v[:, :, pos:pos + step],
                                     pool, gamma, state_indices=slots))
        pos += step
    assert pos == n
    out = torch.cat(outs, dim=2)
    assert_close(out, ref, torch.bfloat16, "prefill + steps vs fp64", n=n)
    assert_close(out, whole.double(), torch.bfloat16, "prefill + steps vs one call", n=n)
    # the chunk kernel's prefill state carries bf16 rounding (its decayed k, v operands are bf16)
    assert_close(pool[slots.long()], s_ref, torch.bfloat16, "state vs fp64", n=n)


@pytest.mark.parametrize("decay_dtype", (torch.float64, torch.float32, torch.bfloat16), ids=str)
def test_device_decay_factors_rates_and_invalid_values(decay_dtype):
    """A CUDA decay tensor is read where it is (any float dtype, element stride 2), as factors or
    rates; a value outside the domain makes that head's outputs and state NaN, the others exact."""
    b, h, dk, dv, slots = 4, 3, 32, 32, 4
    q, k, v, pool = inputs(b, h, 2, dk, dv, torch.float32, slots)
    values = [0.9, 0.99, 0.5]
    buf = torch.zeros(2 * h, dtype=decay_dtype, device="cuda")
    for rate in (False, True):
        buf[::2] = torch.tensor([-math.log(x) for x in values] if rate else values, dtype=torch.float64).to(decay_dtype)
        exact = buf[::2].double()
        gamma = torch.exp(-exact) if rate else exact
        kw = {"decay_rate": buf[::2]} if rate else {"decay": buf[::2]}
        check_step(q, k, v, pool, gamma.cpu(), None, torch.float32, what=f"{decay_dtype} rate={rate}", **kw)
    bad = torch.tensor([0.9, 1.5, 0.5], device="cuda")
    before = pool.clone()
    out = rtkernels.decode(q, k, v, pool, bad)
    assert torch.isnan(out[:, 1]).all() and torch.isfinite(out[:, [0, 2]]).all()
    assert torch.isnan(pool[:b, 1]).all() and torch.isfinite(pool[:b, [0, 2]]).all()
    _, ref_pool = fp64_step(q, k, v, before, torch.tensor([0.9, 0.5, 0.5]), 1.0, None)
    assert_close(pool[:, [0, 2]], ref_pool[:, [0, 2]], torch.float32, "valid heads next to an invalid one")


def test_no_host_sync():
    """The kernel path (float and CUDA tensor decays, int32 indices) and the torch path on the GPU
    (float64) run under torch.cuda.set_sync_debug_mode("error")."""
    q, k, v, pool = inputs(6, 4, 2, 64, 64, torch.bfloat16, 9)
    idx = padded_indices(6, 9)
    gamma = torch.tensor([0.9, 0.99, 0.5, 1.0], device="cuda")
    q64, k64, v64, pool64 = (x.double() for x in (q, k, v, pool))

    def steps():
        rtkernels.decode(q, k, v, pool, 0.9, state_indices=idx)
        rtkernels.decode(q, k, v, pool, gamma, state_indices=idx)
        rtkernels.decode(q, k, v, pool, decay_rate=gamma)
        rtkernels.decode(q64, k64, v64, pool64, gamma, state_indices=idx)  # the torch path

    run_without_host_sync(steps)  # once outside the check (compiles, plans), once under it
    torch.cuda.synchronize()


def test_torch_path_on_the_gpu_matches_the_kernel():
    q, k, v, pool = inputs(6, 3, 5, 48, 40, torch.float32, 8)
    idx = padded_indices(6, 8)
    pool2 = pool.clone()
    gamma = torch.tensor([0.9, 0.99, 1e-6], device="cuda")
    out = rtkernels.decode(q, k, v, pool, gamma, state_indices=idx, scale=0.5)
    out2 = torch.empty_like(out)
    from rtkernels.api import _log_decay

    decode_module.torch_step(q, k, v, out2, pool2, idx, _log_decay(gamma, None, 3, q.device), 0.5)
    assert_close(out, out2.double(), torch.float32, "kernel vs torch path")
    assert_close(pool, pool2.double(), torch.float32, "kernel vs torch path, pool")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_cuda_graph_replays_a_step(dtype):
    """A captured step, replayed after new tokens, indices and gamma are written into its inputs
    and the pool is reset: equal to the eager step, bit for bit, and to fp64."""
    b, h, t, d, slots = 8, 4, 2, 128, 12
    q, k, v, pool = inputs(b, h, t, d, d, dtype, slots)
    idx = padded_indices(b, slots)
    gamma = torch.tensor([0.5, 0.9, 0.99, 0.999], device="cuda")
    start = pool.clone()
    rtkernels.decode(q, k, v, pool, gamma, state_indices=idx)  # compile first
    graph, out = capture(lambda: rtkernels.decode(q, k, v, pool, gamma, state_indices=idx))
    for seed in (1, 2):
        nq, nk, nv, _ = inputs(b, h, t, d, d, dtype, slots, seed=seed)
        for x, new in ((q, nq), (k, nk), (v, nv)):
            x.copy_(new)
        idx.copy_(padded_indices(b, slots, seed=seed))
        gamma.copy_(torch.tensor([0.8, 0.95, 0.999, 1.0]))
        pool.copy_(start)
        graph.replay()
        eager_pool = start.clone()
        eager = rtkernels.decode(q, k, v, eager_pool, gamma, state_indices=idx)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "replay differs from the eager step"
        assert torch.equal(pool, eager_pool), "replayed pool differs from the eager step's"
        ref_out, ref_pool = fp64_step(q, k, v, start, gamma.cpu(), 1.0, idx)
        assert_close(out, ref_out, dtype, f"replay {seed}")
        assert_close(pool, ref_pool, torch.float32, f"replay {seed} pool")


def test_repeated_call_is_cached_and_follows_new_values():
    """The second step of a signature takes the cached launch; it reads the new tokens, the pool,
    the indices and a CUDA decay tensor's current values, and a float decay is part of the key."""
    from rtkernels import call_cache

    b, h, d, slots = 4, 2, 64, 6
    q, k, v, pool = inputs(b, h, 1, d, d, torch.bfloat16, slots)
    idx = padded_indices(b, slots)
    gamma = torch.tensor([0.9, 0.99], device="cuda")
    call_cache.clear()
    rtkernels.decode(q, k, v, pool, gamma, state_indices=idx)
    rtkernels.decode(q, k, v, pool, 0.5, state_indices=idx)
    assert call_cache.size() == 2
    for seed, decay in ((1, gamma), (2, 0.5), (3, gamma)):
        nq, nk, nv, npool = inputs(b, h, 1, d, d, torch.bfloat16, slots, seed=seed)
        gamma.copy_(torch.tensor([0.8, 0.999]))
        nidx = padded_indices(b, slots, seed=seed)
        g = gamma.cpu() if isinstance(decay, torch.Tensor) else torch.full((h,), decay)
        check_step(nq, nk, nv, npool, g, nidx, torch.bfloat16, scale=1.0, decay=decay, what=f"cached {seed}")
    assert call_cache.size() == 2, "a repeated signature was planned again"


def test_nan_is_data():
    q, k, v, pool = inputs(3, 2, 4, 64, 64, torch.float16, 3)
    q[0, 1, 2, 3] = math.nan
    v[2, 0, 1, 5] = math.nan
    out = rtkernels.decode(q, k, v, pool, 0.9)
    expected = torch.zeros(out.shape, dtype=torch.bool, device="cuda")
    expected[0, 1, 2] = True
    expected[2, 0, 1:, 5] = True  # v_t[c] reaches column c of o_t, o_t+1, ...
    assert torch.equal(torch.isnan(out), expected)
    state_nan = torch.zeros(pool.shape, dtype=torch.bool, device="cuda")
    state_nan[2, 0, :, 5] = True
    assert torch.equal(torch.isnan(pool), state_nan)


def test_launches_one_kernel_on_the_current_stream():
    """One launch per step, on torch's current stream (a side stream here): the profiler counts
    exactly one rtk_decode_step and nothing else on the device."""
    q, k, v, pool = inputs(4, 2, 3, 64, 64, torch.bfloat16, 6)
    idx = padded_indices(4, 6)
    gamma = torch.tensor([0.9, 0.99], device="cuda")
    rtkernels.decode(q, k, v, pool, gamma, state_indices=idx)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(side):
            rtkernels.decode(q, k, v, pool, gamma, state_indices=idx)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in kernels]
    assert len(kernels) == 1 and "rtk_decode_step" in names[0], names


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_compiled_step_equals_eager(dtype):
    """torch.compile(fullgraph=True) takes the step whole (torch.ops.rtkernels.decode, mutating the
    pool): the output and the updated pool equal the eager step's bit for bit (the same kernel)."""
    g = torch.Generator(device="cpu").manual_seed(11)
    b, h, t, dk, dv = 3, 4, 2, 64, 96
    q, k = ((torch.randn(b, t, h, dk, generator=g) / 8).to("cuda", dtype) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g).to("cuda", dtype)
    pool = (torch.randn(5, h, dk, dv, generator=g) / 4).cuda()
    idx = torch.tensor([4, -1, 0], dtype=torch.int32, device="cuda")
    gamma = torch.linspace(0.9, 0.999, h, device="cuda")

    def step(q, k, v, pool):
        return rtkernels.decode(q, k, v, pool, gamma, scale=0.3, state_indices=idx, layout="bnhd")

    eager_pool = pool.clone()
    want = step(q, k, v, eager_pool)
    got = torch.compile(step, fullgraph=True)(q, k, v, pool)
    assert torch.equal(got, want) and torch.equal(pool, eager_pool)
