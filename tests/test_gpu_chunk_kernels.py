"""Both kernels of ``chunk`` on the GPU (marker ``gpu``): the mma.sync kernel every GPU runs and, on
compute capability 9.0, the wgmma kernel with each value-tile width and two or three tile stages,
forced past the heuristic, with its tiles and output rows by tensor copies (the TMA instance, where
the plan has one: aligned rows at the plan's stages) and by cp.async and row copies.
The shared tests of test_gpu_methods.py run once per kernel variant here."""

import pytest
import torch

from inputs import force_chunk

import rtkernels
import test_gpu_methods as base

pytestmark = pytest.mark.gpu

#: name -> (wgmma, BV, tile stages, TMA instance where there is one)
VARIANTS = {"mma": (False, None, None, True), "wgmma-bv64": (True, 64, 2, True), "wgmma-bv128": (True, 128, 2, True),
            "wgmma-bv64-stages3": (True, 64, 3, True), "wgmma-bv128-stages3": (True, 128, 3, True),
            "wgmma-bv128-cp-async": (True, 128, 2, False), "wgmma-bv64-stages3-cp-async": (True, 64, 3, False)}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request, monkeypatch):
    wg, bv, stages, tma = VARIANTS[request.param]
    if wg and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    force_chunk(monkeypatch, wgmma=wg, bv=bv, stages=stages, tma_io=tma)
    return request.param


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 300, 96, 80), (1, 2, 1000, 128, 128), (1, 1, 65, 64, 64),
                                   (2, 2, 4096, 128, 200), (1, 3, 777, 40, 128)], ids=lambda s: "x".join(map(str, s)))
def test_tma_instance_equals_cp_async(shape, dtype, segments, monkeypatch):
    """The forward's TMA instance (tiles by tensor copies on mbarriers, rows by tensor stores) takes
    the plan's aligned wgmma shapes and gives the cp.async instance's bits: a partial last chunk,
    Dk < KMAX, a partial value tile (Dv 80, 200), split segments folding their slots, an initial and
    a final state, no host sync; and agrees with fp64 at gamma 0.9 and 0.99 (fp16)."""
    from inputs import no_host_sync
    from reference import reference

    from rtkernels.methods.chunk import launch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tensor copies and wgmma: compute capability 9.0 only")
    b, h, n, dk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(n + dk)
    q, k = (torch.randn(b, h, n, dk, device="cuda", generator=g).to(dtype) / dk ** 0.5 for _ in range(2))
    v = torch.randn(b, h, n, dv, device="cuda", generator=g).to(dtype)
    s0 = torch.randn(b, h, dk, dv, device="cuda", generator=g)
    gammas = torch.tensor([0.9, 0.99, 0.999][:h], device="cuda")
    chosen = []
    real = launch.tma_variant
    monkeypatch.setattr(launch, "tma_variant", lambda name: chosen.append(real(name)) or real(name))
    got = {}
    for tma in (True, False):
        force_chunk(monkeypatch, segments=segments, tma_io=tma)
        rtkernels.causal_linear_attention(q, k, v, gammas, method="chunk", initial_state=s0, return_state=True)
        with no_host_sync():
            got[tma] = rtkernels.causal_linear_attention(q, k, v, gammas, method="chunk", initial_state=s0,
                                                         return_state=True)
    assert chosen and all(c is not None and c[0].endswith("true>") for c in chosen), chosen
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    ref_o, ref_s = reference(q, k, v, gammas.double(), initial_state=s0.double())
    err = (got[True][0].double() - ref_o).norm() / ref_o.norm()
    assert err < (3e-3 if dtype == torch.float16 else 2e-2), err
    assert (got[True][1].double() - ref_s).norm() / ref_s.norm() < 1e-2


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", base.SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes(variant, shape, dtype, layout):
    base.test_kernels_match_fp64_on_odd_shapes(shape, dtype, layout, "chunk")


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2, 1000, 64, 96), (1, 1, 4096, 128, 128), (2, 1, 65, 16, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_split_sequence(variant, shape, dtype, segments, monkeypatch):
    base.test_chunk_split_sequence_strategy(shape, dtype, segments, monkeypatch)


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_states_pass_slots_shorter_than_segments(variant, dtype, segments, monkeypatch):
    """The states pass over slots that split each segment (plan.fold_parts: 8 slots of 256 tokens
    per segment of 2048 with two segments, 2 of 704 with three, on 64 SMs or more), folded by the
    fused pass: outputs and final state at gamma 0.999 and 0.9999, where a carry over the wrong
    number of tokens shows (0.999^256 = 0.77, 0.999^2048 = 0.13), with an initial state."""
    from rtkernels.methods.chunk import plan

    force_chunk(monkeypatch, segments=segments)
    b, h, n, d = 1, 2, 4096, 64
    seg_len, nseg = plan.split(n, segments)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.fold_parts(seg_len, nseg, b * h, sms) == (8 if segments == 2 else 2)
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype) / 8 for _ in range(3))
    s0 = torch.randn(b, h, d, d, device="cuda", generator=g) / 4
    decay = torch.tensor([0.999, 0.9999], dtype=torch.float64, device="cuda")
    out, state = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", initial_state=s0,
                                                   return_state=True)
    ref, ref_state = base.reference(q, k, v, decay.cpu(), initial_state=s0)
    base.assert_close(out, ref, dtype, f"slots of {segments} segments", n=n)
    base.assert_close(state, ref_state, dtype, f"slots of {segments} segments, state")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rate_scale_state_and_two_pieces(variant, dtype):
    base.test_kernel_rate_scale_and_state(dtype, "chunk")


@pytest.mark.parametrize("row", [0, 70, 149])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_only_its_rows(variant, where, row):
    base.test_kernel_nan_reaches_only_its_rows(where, "chunk", torch.bfloat16, row)


def test_deterministic_and_strided(variant):
    base.test_kernel_is_deterministic_and_agrees_with_torch_path("chunk")
    base.test_kernel_strided_inputs_and_nondefault_stream("chunk", torch.float16)


@pytest.mark.parametrize("dedicated", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 700, 256, 200), (1, 2, 1000, 40, 72), (2, 1, 4096, 128, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_states_pass_dedicated_or_fused(shape, dedicated, monkeypatch):
    """The split strategy's states-only pass: the dedicated kernel rtk_chunk_states (16-bit
    default) and the fused kernel's states-only mode give the fp64 answer, Dk up to 256 included."""
    force_chunk(monkeypatch, dedicated_states=dedicated)
    base.test_chunk_split_sequence_strategy(shape, torch.bfloat16, 3, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_states_pass_unaligned(dtype, monkeypatch):
    """Operands that start off 16 bytes take the scalar loaders (VEC false) of both passes."""
    force_chunk(monkeypatch, segments=4)
    b, h, n, d = 1, 2, 1500, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d + 1, device="cuda", generator=g).to(dtype)[..., 1:] for _ in range(3))
    decay = torch.tensor([0.999, 0.9], dtype=torch.float64)
    out, state = rtkernels.causal_linear_attention(q, k, v, decay, method="chunk", return_state=True)
    ref, ref_state = base.reference(q, k, v, decay)
    base.assert_close(out, ref, dtype, "unaligned split", n=n)
    base.assert_close(state, ref_state, dtype, "unaligned split state")


@pytest.mark.parametrize("reverse", [False, True], ids=("forward", "reversed"))
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 4096, 128, 128), (2, 3, 1000, 40, 72), (1, 2, 700, 256, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_final_state_alone(shape, dtype, layout, reverse, monkeypatch):
    """launch.kernel_final_state (the states-only mode and the segment scan: context parallel's
    own-state pass, and reversed its D_r pass) gives the fp64 final state from zero of the sequence
    (or of the reversed one), gamma 0.9 and 0.99 among the heads, in either layout, with no host
    sync; an unsplit plan answers None."""
    from rtkernels.decay import KIND_FACTOR, LogDecay
    from rtkernels.methods.chunk.launch import kernel_final_state

    from inputs import no_host_sync

    b, h, n, dk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(11)
    k = torch.randn(b, h, n, dk, device="cuda", generator=g) / dk ** 0.5
    v = torch.randn(b, h, n, dv, device="cuda", generator=g)
    gammas = torch.tensor([0.9, 0.99, 1e-6][:h], dtype=torch.float64)
    log_decay = LogDecay(torch.device("cuda"), raw=gammas.float().cuda(), kind=KIND_FACTOR)
    kv = [x.to(dtype) if layout == "bhnd" else x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
          for x in (k, v)]
    force_chunk(monkeypatch, segments=1, key_pieces=False)  # Dk 256 in one pass: key pieces have no such pass
    assert kernel_final_state(*kv, log_decay, reverse=reverse) is None
    force_chunk(monkeypatch, segments=3, key_pieces=False)
    with no_host_sync():
        state = kernel_final_state(*kv, log_decay, reverse=reverse)
    ref_k, ref_v = (x.flip(2) if reverse else x for x in kv)
    _, want = base.reference(ref_k, ref_k, ref_v, gammas.float().double())
    assert state.dtype == torch.float32 and state.shape == (b, h, dk, dv)
    base.assert_close(state, want, dtype, f"final state alone {shape} {dtype} {layout}")
    # the same signature again with other gammas: the kept plan reads the new decay, not the planned one
    other = torch.tensor([0.5, 0.999, 0.9][:h], dtype=torch.float64)
    other_decay = LogDecay(torch.device("cuda"), raw=other.float().cuda(), kind=KIND_FACTOR)
    with no_host_sync():
        again = kernel_final_state(*kv, other_decay, reverse=reverse)
    _, want = base.reference(ref_k, ref_k, ref_v, other.float().double())
    base.assert_close(again, want, dtype, f"final state alone, kept plan {shape} {dtype} {layout}")
