"""``rtkernels.decode`` on the CPU (its torch path): one step of T tokens against a pool of states,
checked against a plain fp64 token loop; repeated steps equal one prefill; padding, permuted
indices, bad input; and ``auto``'s rule for short sequences."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import rtkernels
from inputs import DECAY_FORMS, LAYOUTS, decay_args, layout_shape, make_qkv, seq_slice
from fp64_models import decode_step as fp64_step
from reference import reference
from tolerances import assert_close

decode_module = importlib.import_module("rtkernels.decode")  # rtkernels.decode is the function

ALL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
B, H, DK, DV, S = 3, 2, 5, 7, 6
#: Sequence b uses row INDICES[b]: permuted, a padding entry, rows 1, 2, 3 unused.
INDICES = (4, -1, 0)
GAMMAS = [0.9, 1e-6]


def make_pool(seed, slots=S, h=H, dk=DK, dv=DV, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, h, dk, dv, generator=gen, dtype=torch.float64) / math.sqrt(dk)).to(dtype)


def state_dtype_for(dtype, pool_dtype):
    """The tolerance class of the pool after a step: fp64 only when both are fp64 (the step runs in
    float64 when either is, but a float32 pool stores float32)."""
    return torch.float64 if dtype == pool_dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("form", DECAY_FORMS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("t", (1, 3, 16))
def test_step_matches_fp64_token_loop(t, layout, dtype, form):
    q, k, v = make_qkv(t, B, H, t, DK, DV, dtype, layout)
    pool_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    pool = make_pool(t, dtype=pool_dtype)
    before = pool.clone()
    kwargs, gamma = decay_args(form, GAMMAS)
    idx = torch.tensor(INDICES, dtype=torch.int32)
    out = rtkernels.decode(q, k, v, pool, **kwargs, scale=0.8, state_indices=idx, layout=layout)
    ref_out, ref_pool = fp64_step(q, k, v, before, gamma, 0.8, INDICES, layout)
    assert out.shape == layout_shape(B, H, t, DV, layout) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref_out, dtype, f"output T={t}")
    assert_close(pool, ref_pool, state_dtype_for(dtype, pool_dtype), f"pool T={t}")
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a padded sequence's output is not zeros"
    for row in (1, 2, 3, 5):
        assert torch.equal(pool[row], before[row]), f"row {row}, named by no sequence, changed"


@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=str)
def test_default_rows_and_index_dtypes(index_dtype):
    """Without indices sequence b uses row b (rows >= B untouched); int64 indices work as int32."""
    q, k, v = make_qkv(5, B, H, 2, DK, DV, torch.float32)
    gamma = torch.tensor(GAMMAS)
    pool = make_pool(5)
    before = pool.clone()
    out = rtkernels.decode(q, k, v, pool, gamma)
    ref_out, ref_pool = fp64_step(q, k, v, before, gamma, 1.0, None, "bhnd")
    assert_close(out, ref_out, torch.float32, "default rows")
    assert_close(pool, ref_pool, torch.float32, "default rows pool")
    assert torch.equal(pool[B:], before[B:])
    pool2 = before.clone()
    idx = torch.arange(B, dtype=index_dtype)
    assert torch.equal(rtkernels.decode(q, k, v, pool2, gamma, state_indices=idx), out)
    assert torch.equal(pool2, pool)


@pytest.mark.parametrize("indices", [(4, -1, 2), (0, 5, -1), (-7, 3, -1), (5, 4, 3)])
def test_padding_writes_nothing(indices):
    """Rows no valid sequence names keep their bits, wherever the padding sits."""
    q, k, v = make_qkv(13, B, H, 2, DK, DV, torch.float32, "bnhd")
    pool = make_pool(13)
    before = pool.clone()
    gamma = torch.tensor(GAMMAS)
    out = rtkernels.decode(q, k, v, pool, gamma, state_indices=torch.tensor(indices), layout="bnhd")
    ref_out, ref_pool = fp64_step(q, k, v, before, gamma, 1.0, indices, "bnhd")
    assert_close(out, ref_out, torch.float32, f"output {indices}")
    assert_close(pool, ref_pool, torch.float32, f"pool {indices}")
    for row in set(range(S)) - set(indices):
        assert torch.equal(pool[row], before[row]), f"row {row}, named by no sequence, changed"


def test_all_padding_and_empty_steps_touch_nothing():
    q, k, v = make_qkv(6, B, H, 2, DK, DV, torch.float32)
    pool = make_pool(6)
    before = pool.clone()
    out = rtkernels.decode(q, k, v, pool, 0.9, state_indices=torch.full((B,), -1, dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(pool, before)
    empty = rtkernels.decode(*(x[:, :, :0] for x in (q, k, v)), pool, 0.9)
    assert empty.shape == (B, H, 0, DV) and torch.equal(pool, before)
    none = rtkernels.decode(*(x[:0] for x in (q, k, v)), pool, 0.9, state_indices=torch.zeros(0, dtype=torch.int32))
    assert none.shape == (0, H, 2, DV) and torch.equal(pool, before)


def test_strided_pool_is_updated_where_it_lives():
    """A pool that is every other row of a larger buffer (one layer of a stacked cache, say)."""
    q, k, v = make_qkv(7, B, H, 3, DK, DV, torch.float32, "bnhd")
    big = make_pool(7, slots=2 * S)
    before = big.clone()
    pool = big[::2]
    idx = torch.tensor(INDICES, dtype=torch.int32)
    out = rtkernels.decode(q, k, v, pool, decay_rate=0.1, state_indices=idx, layout="bnhd")
    gamma = torch.full((H,), math.exp(-0.1), dtype=torch.float64)
    ref_out, ref_pool = fp64_step(q, k, v, before[::2], gamma, 1.0, INDICES, "bnhd")
    assert_close(out, ref_out, torch.float32, "strided pool output")
    assert_close(big[::2], ref_pool, torch.float32, "strided pool")
    assert torch.equal(big[1::2], before[1::2])


def test_float64_pool_with_float32_inputs():
    q, k, v = make_qkv(8, B, H, 3, DK, DV, torch.float32)
    pool = make_pool(8, dtype=torch.float64)
    before = pool.clone()
    gamma = torch.tensor(GAMMAS)
    out = rtkernels.decode(q, k, v, pool, gamma, state_indices=torch.tensor(INDICES))
    ref_out, ref_pool = fp64_step(q, k, v, before, gamma, 1.0, INDICES, "bhnd")
    assert_close(out, ref_out, torch.float32, "output")
    assert_close(pool, ref_pool, torch.float64, "float64 pool")


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_repeated_steps_equal_one_prefill(layout, dtype):
    """Prefill P tokens with return_state=True, then decode the rest in steps of 1, 3 and 16
    tokens: the outputs and the final state equal one call over the whole sequence (and fp64)."""
    n, prompt = 40, 7
    q, k, v = make_qkv(9, 2, H, n, DK, DV, dtype, layout)
    gamma = torch.tensor([0.95, 0.5], dtype=torch.float64)
    whole, s_whole = rtkernels.causal_linear_attention(q, k, v, gamma, layout=layout, return_state=True)
    ref, s_ref = reference(q, k, v, gamma, layout=layout)
    first, s_prompt = rtkernels.causal_linear_attention(*(seq_slice(x, 0, prompt, layout) for x in (q, k, v)),
                                                        gamma, layout=layout, return_state=True)
    pool = torch.zeros(5, H, DK, DV, dtype=s_prompt.dtype)
    slots = torch.tensor([3, 1])
    pool[slots] = s_prompt
    outs, pos = [first], prompt
    for step in (1, 3, 16, 1, 1, 3, 8):
        outs.append(rtkernels.decode(*(seq_slice(x, pos, pos + step, layout) for x in (q, k, v)), pool, gamma,
                                     state_indices=slots, layout=layout))
        pos += step
    assert pos == n
    out = torch.cat(outs, dim=2 if layout == "bhnd" else 1)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close(out, ref, dtype, "prefill + steps vs fp64", n=n)
    assert_close(out, whole.double(), dtype, "prefill + steps vs one call", n=n)
    assert_close(pool[slots], s_ref, sdt, "state vs fp64", n=n)
    assert_close(pool[slots], s_whole.double(), sdt, "state vs one call", n=n)


def test_nan_is_data():
    """A NaN in q_t reaches o_t only; one in k_t[c] reaches o_t, o_t+1, .. and row c of its
    sequence's state (of its head)."""
    t = 4
    q, k, v = make_qkv(10, B, H, t, DK, DV, torch.float32)
    q[0, 1, 2, 3] = math.nan
    k[2, 0, 1, 0] = math.nan
    pool = make_pool(10)
    out = rtkernels.decode(q, k, v, pool, 0.9)
    nan = torch.isnan(out)
    expected = torch.zeros_like(nan)
    expected[0, 1, 2] = True
    expected[2, 0, 1:] = True
    assert torch.equal(nan, expected)
    state_nan = torch.zeros_like(torch.isnan(pool))
    state_nan[2, 0, 0] = True  # k_t^T v_t: a NaN in k_t[0] reaches row 0 of the state
    assert torch.equal(torch.isnan(pool), state_nan)


def test_refuses_gradients_in_grad_mode_and_runs_under_no_grad():
    q, k, v = make_qkv(11, B, H, 1, DK, DV, torch.float32)
    pool = make_pool(11)
    gamma = torch.tensor(GAMMAS, requires_grad=True)
    with pytest.raises(ValueError, match="decay requires grad"):
        rtkernels.decode(q, k, v, pool, gamma)
    with pytest.raises(ValueError, match="q requires grad"):
        rtkernels.decode(q.clone().requires_grad_(), k, v, pool, 0.9)
    with torch.no_grad():
        out = rtkernels.decode(q.clone().requires_grad_(), k, v, pool, gamma)
    assert not out.requires_grad and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------ bad input

Q, K, V = make_qkv(12, B, H, 2, DK, DV, torch.float32)


def call(**changes):
    args = dict(q=Q, k=K, v=V, state=make_pool(12), decay=0.9)
    args.update(changes)
    return rtkernels.decode(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("state"), **args)


@pytest.mark.parametrize("changes, error, match", [
    ({"state": make_pool(0, h=H + 1)}, ValueError, r"state must be a pool of shape \[S, H, Dk, Dv\] = \[S, 2, 5, 7\]"),
    ({"state": make_pool(0)[0]}, ValueError, "state must be a pool of shape"),
    ({"state": make_pool(0, dtype=torch.bfloat16)}, TypeError, "state must be float32 .* got bfloat16"),
    ({"state": make_pool(0).to("meta")}, TypeError, "state must hold data"),
    ({"state": [[0.0]]}, TypeError, "state must be a torch.Tensor"),
    ({"state": make_pool(0, slots=B - 1)}, ValueError, "at least B = 3 rows"),
    ({"state_indices": [0, 1, 2]}, TypeError, "state_indices must be None or an int32 tensor"),
    ({"state_indices": torch.tensor([0.0, 1, 2])}, TypeError, "state_indices must have dtype int32 .* got float32"),
    ({"state_indices": torch.tensor([0, 1], dtype=torch.int32)}, ValueError,
     r"state_indices must have shape \[B\] = \[3\]"),
    ({"state_indices": torch.tensor([0, 1, S], dtype=torch.int32)}, ValueError, "state_indices must be < S = 6"),
    ({"state_indices": torch.tensor([2, -1, 2], dtype=torch.int32)}, ValueError, r"at most once, got \[2\] repeated"),
    ({"state_indices": torch.zeros(B, dtype=torch.int32, device="meta")}, TypeError, "state_indices must hold data"),
    ({"scale": "1"}, TypeError, "scale must be a real number"),
    ({"scale": math.inf}, ValueError, "scale must be finite"),
    ({"layout": "nhd"}, ValueError, "layout must be one of"),
    ({"decay": 1.5}, ValueError, r"decay must be a factor gamma in \(0, 1\]"),
    ({"decay": torch.tensor([0.9, 0.0])}, ValueError, "decay must hold"),
    ({"decay_rate": 0.1}, ValueError, "not both"),
    ({"decay": torch.ones(H + 1)}, ValueError, r"shape \[H\] = \[2\]"),
    ({"q": Q.half()}, TypeError, "q, k and v must share one dtype"),
    ({"k": K[:, :, :1]}, ValueError, "k must have the batch, head and sequence sizes of q"),
    ({"v": V[..., 0]}, ValueError, "v must be a 4-D tensor"),
])
def test_bad_input_raises_naming_the_argument(changes, error, match):
    pool = changes.get("state")
    before = pool.clone() if isinstance(pool, torch.Tensor) and pool.device.type == "cpu" else None
    with pytest.raises(error, match=match):
        call(**changes)
    if before is not None:
        assert torch.equal(pool, before), "a refused call changed the pool"


# ------------------------------------------------------------------------------ auto, short N

@pytest.mark.parametrize("n, expected", [(1, "scan"), (3, "scan"), (4, "scan"), (5, "chunk"), (64, "chunk"),
                                         (4096, "chunk")])
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
def test_auto_runs_the_scan_kernel_for_short_sequences(n, expected, dtype):
    """Without a store entry, auto takes the scan kernel for N <= SHORT_N = 4 (decode-like calls,
    where it beats the chunk kernel) and the chunk kernel above; asked as the autotuner asks (meta
    tensors). Dk > 256 takes neither kernel: the chunk torch path."""
    from rtkernels.autotune import cuda
    from rtkernels.autotune.space import Problem
    from rtkernels.methods.registry import SHORT_N

    assert SHORT_N == 4
    assert cuda.heuristic_method(Problem(64, 32, n, 128, 128, dtype)) == expected
    assert cuda.heuristic_method(Problem(2, 2, n, 300, 64, dtype)) == "chunk"


def test_auto_on_the_cpu_keeps_the_chunk_torch_path():
    q, v = torch.empty(1, 2, 1, 8), torch.empty(1, 2, 1, 8)
    assert rtkernels.methods.auto_method(q, v) == "chunk"
