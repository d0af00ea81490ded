"""Every method on the GPU against the fp64 reference, the CUDA kernels in detail (marker ``gpu``)."""

import functools

import pytest
import torch

from inputs import force_chunk

import rtkernels
from rtkernels.methods import METHODS

import fp64_models as fm
from reference import nan_reach, reference
from tolerances import assert_close

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [  # (B, H, N, Dk, Dv)
    (1, 2, 1, 16, 16), (2, 3, 63, 5, 7), (1, 2, 65, 40, 96), (2, 2, 257, 64, 32),
    (1, 3, 1000, 96, 160), (1, 2, 4096, 128, 128), (1, 1, 300, 256, 256), (2, 1, 130, 200, 17),
]
GAMMAS = (1e-6, 0.5, 0.999999, 1.0)


def _inputs(b, h, n, dk, dv, dtype, layout, device="cuda", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (lambda d: (b, h, n, d)) if layout == "bhnd" else (lambda d: (b, n, h, d))
    q = (torch.randn(shape(dk), generator=g) / dk ** 0.5).to(device, dtype)
    k = (torch.randn(shape(dk), generator=g) / dk ** 0.5).to(device, dtype)
    v = torch.randn(shape(dv), generator=g).to(device, dtype)
    return q, k, v


def _heads(gamma, h):
    # per-head factors around gamma (all equal to gamma when it sits at an end of the range)
    t = torch.full((h,), gamma, dtype=torch.float64)
    if 1e-6 < gamma < 0.99:
        t = t * torch.linspace(0.8, 1.0, h, dtype=torch.float64)
    return t


KERNEL_METHODS = ("scan", "fleet", "block", "chunk")
#: Shared memory per CTA the fp32 chunk kernel needs at the least (one stage of tiles, 32 value
#: columns; docs/design.md): 99 KiB for Dk <= 128, about 183 KiB for Dk up to 256.
F32_CHUNK_SMEM = {128: 99 * 1024, 256: 183 * 1024}


def _kernel_expected(method, dtype, dk=1, dv=1):
    """Whether ``method`` must run a CUDA kernel (not a torch fallback) for ``dtype`` and head sizes
    ``dk``, ``dv``, by the documented rules (README, docs/design.md), not by asking the library:
    scan, fleet, block and chunk take fp32, fp16 and bf16 with Dk, Dv <= 256 (fp64 runs the torch
    paths); the fp32 chunk kernel only where its tile fits the GPU's shared memory; ``auto`` runs
    the chunk kernel, or the scan kernel where chunk's does not run (and first for N <= 64)."""
    if method == "auto":
        return any(_kernel_expected(m, dtype, dk, dv) for m in ("chunk", "scan"))
    if method not in KERNEL_METHODS or dtype not in DTYPES or max(dk, dv) > 256:
        return False
    if method == "chunk" and dtype == torch.float32:
        optin = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
        return optin >= F32_CHUNK_SMEM[128 if dk <= 128 else 256]
    return True


def _runs_kernel(method, q, v):
    """Whether the call runs a CUDA kernel: the method's own, or for ``auto`` the one it picks."""
    from rtkernels.methods import auto_method

    name = auto_method(q, v) if method == "auto" else method
    return METHODS[name].uses_kernel(q, v)
#: The matrix of the LeetDecoding-parity issue: every method x dtype x layout x these shapes x gamma.
PARITY_SHAPES = [(2, 2, 1, 16, 16), (2, 2, 257, 64, 32), (2, 2, 1000, 96, 160), (2, 2, 4096, 128, 128)]
PARITY_GAMMAS = (1e-6, 0.5, 0.99, 1.0)


@functools.lru_cache(maxsize=64)
def _parity_case(shape, dtype, gamma):
    b, h, n, dk, dv = shape
    q, k, v = _inputs(b, h, n, dk, dv, dtype, "bhnd", seed=11)
    decay = _heads(gamma, h)
    return q, k, v, decay, reference(q, k, v, decay)[0]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", sorted(rtkernels.METHOD_NAMES))  # "auto" included
@pytest.mark.parametrize("shape", PARITY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_method_matches_fp64(shape, method, dtype, layout):
    n = shape[2]
    for gamma in PARITY_GAMMAS:
        q, k, v, decay, ref = _parity_case(shape, dtype, gamma)
        assert _runs_kernel(method, q, v) == _kernel_expected(method, dtype, shape[3], shape[4]), \
            "a kernel runs exactly where the documented rules say"
        if layout == "bnhd":
            q, k, v, ref = (x.transpose(1, 2).contiguous() for x in (q, k, v, ref))
        out = rtkernels.causal_linear_attention(q, k, v, decay.cuda(), method=method, layout=layout)
        assert out.dtype == dtype and out.is_contiguous() and out.shape == v.shape
        assert_close(out, ref, dtype, f"{method} {shape} {dtype} {layout} gamma={gamma}", n=n)


@pytest.mark.parametrize("method", KERNEL_METHODS)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_match_fp64_on_odd_shapes(shape, dtype, layout, method):
    b, h, n, dk, dv = shape
    q, k, v = _inputs(b, h, n, dk, dv, dtype, layout)
    qv, vv = (q, v) if layout == "bhnd" else (q.transpose(1, 2), v.transpose(1, 2))
    assert METHODS[method].uses_kernel(qv, vv) == _kernel_expected(method, dtype, dk, dv)
    for gamma in GAMMAS:
        decay = _heads(gamma, h)
        out = rtkernels.causal_linear_attention(q, k, v, decay.float().cuda(), method=method, layout=layout)
        assert out.dtype == dtype and out.is_contiguous() and out.shape == v.shape
        ref, _ = reference(q, k, v, decay, layout=layout)
        assert_close(out, ref, dtype, f"{method} {shape} {dtype} {layout} gamma={gamma}", n=n)


@pytest.mark.parametrize("method", KERNEL_METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_rate_scale_and_state(dtype, method):
    b, h, n, dk, dv = 2, 3, 777, 48, 80
    q, k, v = _inputs(b, h, n, dk, dv, dtype, "bhnd", seed=1)
    rate = torch.tensor([0.0, 0.01, 2.0])
    s0 = torch.randn(b, h, dk, dv, device="cuda")
    out, state = rtkernels.causal_linear_attention(q, k, v, decay_rate=rate, scale=0.37, method=method,
                                                   initial_state=s0, return_state=True)
    assert state.dtype == torch.float32 and state.shape == (b, h, dk, dv)
    ref, ref_state = reference(q, k, v, torch.exp(-rate.double()), scale=0.37, initial_state=s0)
    assert_close(out, ref, dtype, "output")
    # chunk's state update multiplies 16-bit operands on tensor cores (k_s scaled by gamma^(len-1-s)
    # is rounded to the input type); the other kernels accumulate the state in fp32 FMAs
    state_tol = dtype if method == "chunk" else torch.float32
    assert_close(state, ref_state, state_tol, "state")
    # in two pieces with the state handed over
    o1, s1 = rtkernels.causal_linear_attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], decay_rate=rate,
                                               scale=0.37, method=method, initial_state=s0, return_state=True)
    o2, s2 = rtkernels.causal_linear_attention(q[:, :, 300:], k[:, :, 300:], v[:, :, 300:], decay_rate=rate,
                                               scale=0.37, method=method, initial_state=s1, return_state=True)
    assert_close(torch.cat([o1, o2], 2), ref, dtype, "two pieces")
    assert_close(s2, ref_state, state_tol, "two-piece state")


@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_kernel_is_deterministic_and_agrees_with_torch_path(method):
    q, k, v = _inputs(2, 4, 2000, 128, 128, torch.bfloat16, "bnhd", seed=2)
    runs = [rtkernels.causal_linear_attention(q, k, v, 0.99, method=method, layout="bnhd") for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    torch_path = rtkernels.causal_linear_attention(q.cpu(), k.cpu(), v.cpu(), 0.99, method="chunk", layout="bnhd")
    assert_close(runs[0], torch_path.double(), torch.bfloat16, "kernel vs torch path")


@pytest.mark.parametrize("method", KERNEL_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("row", [0, 70, 149])
def test_kernel_nan_reaches_only_its_rows(where, method, dtype, row):
    b, h, n, d = 2, 2, 150, 64
    q, k, v = _inputs(b, h, n, d, d, dtype, "bhnd", seed=3)
    t = {"q": q, "k": k, "v": v}[where]
    t[1, 0, row, 5] = float("nan")
    out = rtkernels.causal_linear_attention(q, k, v, 1e-6, method=method).cpu()
    nan = torch.isnan(out)
    expected = nan_reach(out.shape, where, 1, 0, row, 5)
    assert torch.equal(nan, expected)
    assert torch.isfinite(out[~expected]).all()


def _long_rows(n):
    """Rows to check in a long sequence: both ends, chunk and power-of-two boundaries, random ones."""
    fixed = {0, 1, 63, 64, 65, 4095, 4096, n // 2 - 1, n // 2, n - 65, n - 64, n - 1}
    rand = torch.randint(0, n, (12,), generator=torch.Generator().manual_seed(n)).tolist()
    return sorted(fixed | set(rand))


def _assert_long_rows(out, q, k, v, gamma, what):
    """Output finite everywhere and, at the sampled rows, within the dtype's tolerance of the exact
    fp64 rows (computed on the GPU by the closed form, tests/fp64_models.py)."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    rows = _long_rows(q.shape[2])
    ref = fm.sampled_rows(q, k, v, torch.full((q.shape[1],), gamma, dtype=torch.float64), rows)
    assert_close(out[:, :, rows], ref, out.dtype, f"{what} sampled rows", n=q.shape[2])


@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_kernel_long_sequence_matches_fp64_rows(method):
    q, k, v = _inputs(1, 2, 65536, 128, 64, torch.bfloat16, "bhnd", seed=4)
    for gamma in (1.0, 0.999, 1e-6):
        out = rtkernels.causal_linear_attention(q, k, v, gamma, method=method)
        _assert_long_rows(out, q, k, v, gamma, f"{method} 65536 tokens gamma={gamma}")


@pytest.mark.parametrize("method", KERNEL_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_strided_inputs_and_nondefault_stream(method, dtype):
    base = (torch.randn(2, 3, 500, 2 * 64, device="cuda") / 8).to(dtype)
    q, k = base[..., :64], base[..., 64:]  # stride(-2) = 128: non-contiguous views, unit last stride
    v = torch.randn(2, 500, 3, 48, device="cuda").to(dtype).transpose(1, 2)  # a bnhd tensor seen as bhnd
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs are made on the default stream
    with torch.cuda.stream(stream):
        out = rtkernels.causal_linear_attention(q, k, v, 0.9, method=method)
    stream.synchronize()
    ref, _ = reference(q, k, v, torch.full((3,), 0.9, dtype=torch.float64))
    assert_close(out, ref, dtype, "strided")


def test_kernel_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    q, k, v = _inputs(1, 2, 100, 32, 16, torch.float32, "bhnd", seed=5)
    out = rtkernels.causal_linear_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), 0.7, method="scan")
    assert isinstance(out, cupy.ndarray) and out.shape == (1, 2, 100, 16)
    ref, _ = reference(q, k, v, torch.full((2,), 0.7, dtype=torch.float64))
    assert_close(torch.as_tensor(cupy.asnumpy(out)), ref, torch.float32, "cupy")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_kernel_on_second_device(method):
    q, k, v = _inputs(1, 2, 300, 160, 64, torch.float16, "bhnd", device="cuda:1", seed=6)
    out = rtkernels.causal_linear_attention(q, k, v, 0.9, method=method)
    assert out.device == torch.device("cuda:1")
    ref, _ = reference(q, k, v, torch.full((2,), 0.9, dtype=torch.float64))
    assert_close(out, ref, torch.float16, "cuda:1")


@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_kernel_never_detaches_silently(method):
    """An input that requires grad keeps the kernel forward (bit for bit the no-grad output) and
    gets its gradient from the backward (tests/test_gpu_grad.py checks the gradients in detail)."""
    q, k, v = _inputs(1, 2, 100, 32, 32, torch.bfloat16, "bhnd", seed=8)
    plain = rtkernels.causal_linear_attention(q, k, v, 0.9, method=method)
    q.requires_grad_(True)
    assert METHODS[method].uses_kernel(q, v)
    out = rtkernels.causal_linear_attention(q, k, v, 0.9, method=method)
    assert out.grad_fn is not None and torch.equal(out, plain)
    out.float().sum().backward()
    ref, _ = reference(q, k, v, torch.full((2,), 0.9, dtype=torch.float64))
    (want,) = torch.autograd.grad(ref.sum(), q)
    assert q.grad.dtype == torch.bfloat16
    assert_close(q.grad, want, torch.bfloat16, "dq")
    with torch.no_grad():
        assert not rtkernels.causal_linear_attention(q, k, v, 0.9, method=method).requires_grad


@pytest.mark.parametrize("segments", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 96), (1, 1, 4096, 128, 128), (2, 1, 65, 16, 40),
                                   (1, 2, 777, 256, 200)], ids=lambda s: "x".join(map(str, s)))
def test_chunk_split_sequence_strategy(shape, dtype, segments, monkeypatch):

    force_chunk(monkeypatch, segments=segments)
    b, h, n, dk, dv = shape
    q, k, v = _inputs(b, h, n, dk, dv, dtype, "bnhd", seed=9)
    decay = torch.tensor([0.999999, 0.9][:h], dtype=torch.float64)
    s0 = torch.randn(b, h, dk, dv, device="cuda") / 4
    out, state = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", layout="bnhd",
                                                   initial_state=s0, return_state=True)
    ref, ref_state = reference(q, k, v, decay, layout="bnhd", initial_state=s0)
    assert_close(out, ref, dtype, f"split {segments} {shape}", n=n)
    assert_close(state, ref_state, dtype, f"split {segments} state")
    for gamma in (1.0, 1e-6):
        out = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk", layout="bnhd")
        ref, _ = reference(q, k, v, torch.full((h,), gamma, dtype=torch.float64), layout="bnhd")
        assert_close(out, ref, dtype, f"split {segments} gamma={gamma}", n=n)


def test_chunk_heuristic_splits_few_heads():
    from rtkernels.methods import chunk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert chunk.segments_for(32 * 2, 16384, sms) > 1
    assert chunk.segments_for(4 * 32 * 2, 4096, sms) == 1
    assert chunk.segments_for(2 * 32 * 2, 1024, sms) == 1
    assert chunk.segments_for(8, 64, sms) == 1  # too short to split


def test_chunk_million_tokens_match_fp64_rows():
    q, k, v = _inputs(1, 2, 1 << 20, 64, 64, torch.bfloat16, "bhnd", seed=10)
    for gamma in (1.0, 0.9999, 1e-6):
        out = rtkernels.causal_linear_attention(q, k, v, gamma, method="chunk")
        _assert_long_rows(out, q, k, v, gamma, f"chunk 2^20 tokens gamma={gamma}")
