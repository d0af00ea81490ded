"""Malformed arguments: each raises TypeError (wrong kind of object) or ValueError (right kind,
wrong value) with a message that names the argument and says what was expected, before any
computation starts."""

from __future__ import annotations

import math
import warnings

import numpy as np

import pytest
import torch

import rtkernels
import rtkernels.api as api
from inputs import make_qkv

B, H, N, DK, DV = 2, 3, 5, 4, 6
Q, K, V = make_qkv(0, B, H, N, DK, DV, torch.float32)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors; they must still be refused
    QUANTIZED = torch.quantize_per_tensor(Q, 0.1, 0, torch.quint8)
QT, KT, VT = (x.transpose(1, 2).contiguous() for x in (Q, K, V))  # the same in layout="bnhd"
NAN, INF = math.nan, math.inf


class ComputationStarted(Exception):
    """Raised in place of the computation: a bad input got past the checks."""


@pytest.fixture(autouse=True)
def no_computation(monkeypatch):
    def refuse(*args, **kwargs):
        raise ComputationStarted("the arguments were accepted and the computation started")

    monkeypatch.setattr(api, "run_method", refuse)
    monkeypatch.setattr(api, "auto_method", refuse)


def call(**changes):
    args = dict(q=Q, k=K, v=V)
    args.update(changes)
    return rtkernels.causal_linear_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def randn(*shape, dtype=torch.float32, **kw):
    return torch.randn(*shape, dtype=dtype, **kw)


def full(value, shape=(H,), dtype=torch.float64, **kw):
    return torch.full(shape, value, dtype=dtype, **kw)


def per_head(*values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def case(id_, exc, match, **changes):
    return pytest.param(changes, exc, match, id=id_)


TENSOR_OR_CUDA = r"must be a torch\.Tensor or a CUDA array .*got "
DTYPES = r"must have dtype float64, float32, float16 or bfloat16, got "


def sizes(n: int = N) -> str:
    return rf"must have the batch, head and sequence sizes of q: expected \(B, H, N\) = \(2, 3, {n}\), got "


SIZES = sizes()
DECAY_SHAPE = r"^decay must be a float or a tensor of shape \[H\] = \[3\], got "
RATE_SHAPE = r"^decay_rate must be a float or a tensor of shape \[H\] = \[3\], got "
FACTOR = r"^decay must be a factor gamma in \(0, 1\], got "
FACTORS = r"^decay must hold a factor gamma in \(0, 1\] per head, got "
RATE = r"^decay_rate must be a rate r >= 0, got "
RATES = r"^decay_rate must hold a rate r >= 0 per head, got "
STATE_SHAPE = r"^initial_state must have shape \[B, H, Dk, Dv\] = \[2, 3, 4, 6\], got "

CASES = [
    # ---- q, k, v: sizes
    case("k-batch", ValueError, "^k " + SIZES + r"\(1, 3, 5\) \(layout='bhnd'\)$", k=randn(1, H, N, DK)),
    case("v-batch", ValueError, "^v " + SIZES + r"\(3, 3, 5\)", v=randn(3, H, N, DV)),
    case("k-heads", ValueError, "^k " + SIZES + r"\(2, 2, 5\)", k=randn(B, 2, N, DK)),
    case("v-heads", ValueError, "^v " + SIZES + r"\(2, 4, 5\)", v=randn(B, 4, N, DV)),
    case("k-seq", ValueError, "^k " + SIZES + r"\(2, 3, 4\)", k=randn(B, H, N - 1, DK)),
    case("v-seq", ValueError, "^v " + SIZES + r"\(2, 3, 6\)", v=randn(B, H, N + 1, DV)),
    case("v-seq-bnhd", ValueError, "^v " + SIZES + r"\(2, 3, 6\) \(layout='bnhd'\)$",
         q=QT, k=KT, v=randn(B, N + 1, H, DV), layout="bnhd"),
    # k in layout bhnd while q and v are in bnhd: H and N swapped
    case("k-other-layout", ValueError, "^k " + SIZES + r"\(2, 5, 3\) \(layout='bnhd'\)$", q=QT, k=K, v=VT,
         layout="bnhd"),
    case("k-dk", ValueError, r"^k must have the key dimension Dk of q: expected 4, got 3$", k=randn(B, H, N, DK - 1)),
    case("q-dk", ValueError, r"^k must have the key dimension Dk of q: expected 5, got 4$", q=randn(B, H, N, DK + 1)),
    case("dk-zero", ValueError, r"^q must have Dk >= 1, got shape \(2, 3, 5, 0\)$",
         q=randn(B, H, N, 0), k=randn(B, H, N, 0)),
    case("dv-zero", ValueError, r"^v must have Dv >= 1, got shape \(2, 3, 5, 0\)$", v=randn(B, H, N, 0)),
    # ---- q, k, v: rank
    case("q-3d", ValueError, r"^q must be a 4-D tensor \[B, H, N, Dk\] for layout='bhnd', got 3-D shape \(3, 5, 4\)$",
         q=randn(H, N, DK)),
    case("k-5d", ValueError, r"^k must be a 4-D tensor \[B, H, N, Dk\] for layout='bhnd', got 5-D", k=K[None]),
    case("v-3d-bnhd", ValueError, r"^v must be a 4-D tensor \[B, N, H, Dv\] for layout='bnhd', got 3-D",
         q=QT, k=KT, v=VT[0], layout="bnhd"),
    case("v-0d", ValueError, r"^v must be a 4-D tensor .* got 0-D shape \(\)$", v=torch.tensor(1.0)),
    # ---- q, k, v: dtypes and devices
    case("q-int64", TypeError, "^q " + DTYPES + "int64$", q=Q.to(torch.int64)),
    case("k-int32", TypeError, "^k " + DTYPES + "int32$", k=K.to(torch.int32)),
    case("v-bool", TypeError, "^v " + DTYPES + "bool$", v=V > 0),
    case("all-bool", TypeError, "^q " + DTYPES + "bool$", q=Q > 0, k=K > 0, v=V > 0),
    case("q-complex", TypeError, "^q " + DTYPES + "complex64$", q=Q.to(torch.complex64)),
    case("mixed-dtypes", TypeError, r"^q, k and v must share one dtype, got q float32, k float32, v float64$",
         v=V.double()),
    case("mixed-half-dtypes", TypeError, r"^q, k and v must share one dtype, got q bfloat16, k float16, v bfloat16$",
         q=Q.bfloat16(), k=K.half(), v=V.bfloat16()),
    case("k-meta-device", TypeError, r"^k must hold data \(a CPU or CUDA tensor\), got a tensor on the meta device$",
         k=K.to("meta")),
    case("q-meta-device", TypeError, r"^q must hold data \(a CPU or CUDA tensor\), got a tensor on the meta device$",
         q=Q.to("meta")),
    case("q-sparse", TypeError, r"^q must be a dense \(strided\) tensor, got layout sparse_coo; convert it",
         q=Q.to_sparse()),
    case("v-sparse-csr", TypeError, r"^v must be a dense \(strided\) tensor, got layout sparse_csr",
         v=V.reshape(-1, DV).to_sparse_csr()),
    case("q-quantized", TypeError, "^q " + DTYPES + "quint8$", q=QUANTIZED),
    case("state-sparse", TypeError, r"^initial_state must be a dense \(strided\) tensor",
         initial_state=torch.zeros(B, H, DK, DV).to_sparse()),
    # ---- q, k, v: not tensors
    case("q-list", TypeError, "^q " + TENSOR_OR_CUDA + "list$", q=Q.tolist()),
    case("q-numpy", TypeError, "^q " + TENSOR_OR_CUDA + "ndarray$", q=Q.numpy()),
    case("k-numpy", TypeError, "^k " + TENSOR_OR_CUDA + "ndarray$", k=K.numpy()),
    case("v-float", TypeError, "^v " + TENSOR_OR_CUDA + "float$", v=1.0),
    case("k-none", TypeError, "^k " + TENSOR_OR_CUDA + "NoneType$", k=None),
    # ---- decay: shape, dtype, kind
    case("decay-too-long", ValueError, DECAY_SHAPE + r"shape \(4,\)$", decay=full(0.5, (H + 1,))),
    case("decay-1xH", ValueError, DECAY_SHAPE + r"shape \(1, 3\)$", decay=full(0.5, (1, H))),
    case("decay-0d-tensor", ValueError, DECAY_SHAPE + r"shape \(\)$", decay=torch.tensor(0.5)),
    case("decay-B-heads-bnhd", ValueError, DECAY_SHAPE + r"shape \(5,\)$", q=QT, k=KT, v=VT, layout="bnhd",
         decay=full(0.5, (N,))),
    case("rate-too-short", ValueError, RATE_SHAPE + r"shape \(2,\)$", decay_rate=full(0.1, (H - 1,))),
    case("decay-int-tensor", TypeError, r"^decay must have a floating dtype, got int64$",
         decay=torch.ones(H, dtype=torch.int64)),
    case("decay-bool-tensor", TypeError, r"^decay must have a floating dtype, got bool$",
         decay=torch.ones(H, dtype=torch.bool)),
    case("rate-int-tensor", TypeError, r"^decay_rate must have a floating dtype, got int32$",
         decay_rate=torch.zeros(H, dtype=torch.int32)),
    case("decay-bool", TypeError, DECAY_SHAPE + "bool$", decay=True),
    case("rate-bool", TypeError, RATE_SHAPE + "bool$", decay_rate=False),
    case("decay-list", TypeError, DECAY_SHAPE + r"list; wrap the values: torch\.tensor\(values\)$", decay=[0.5] * H),
    case("decay-numpy", TypeError, DECAY_SHAPE + r"ndarray; wrap the values", decay=np.full(H, 0.5)),
    case("decay-sparse", TypeError, r"^decay must be a dense \(strided\) tensor, got layout sparse_coo",
         decay=full(0.5).to_sparse()),
    case("decay-str", TypeError, DECAY_SHAPE + "str$", decay="0.5"),
    case("decay-meta-device", TypeError, r"^decay must hold data \(a CPU or CUDA tensor\), got a tensor on the meta",
         decay=full(0.5, device="meta")),
    # ---- decay: values (gamma in (0, 1], finite rate >= 0)
    case("decay-zero", ValueError, FACTOR + r"0\.0$", decay=0.0),
    case("decay-int-zero", ValueError, FACTOR + r"0\.0$", decay=0),
    case("decay-negative", ValueError, FACTOR + r"-0\.5$", decay=-0.5),
    case("decay-above-one", ValueError, FACTOR + r"1\.5$", decay=1.5),
    case("decay-just-above-one", ValueError, FACTOR + r"1\.0000001$", decay=1.0000001),
    case("decay-nan", ValueError, FACTOR + "nan$", decay=NAN),
    case("decay-inf", ValueError, FACTOR + "inf$", decay=INF),
    case("decay-tensor-zero", ValueError, FACTORS + r"0\.0$", decay=per_head(0.5, 0.0, 0.5)),
    case("decay-tensor-negative", ValueError, FACTORS + r"-0\.25$", decay=per_head(0.5, 0.5, -0.25)),
    case("decay-tensor-above-one", ValueError, FACTORS + r"2\.0$", decay=per_head(2.0, 0.5, 0.5, dtype=torch.float32)),
    case("decay-tensor-nan", ValueError, FACTORS + "nan$", decay=per_head(0.5, NAN, 0.5)),
    case("decay-and-rate", ValueError, r"^pass decay \(factors gamma\) or decay_rate \(rates r.*\), not both$",
         decay=0.9, decay_rate=0.1),
    case("decay-and-rate-tensors", ValueError, r"decay.*decay_rate.*not both",
         decay=full(0.9), decay_rate=full(0.1)),
    case("rate-negative", ValueError, RATE + r"-0\.1$", decay_rate=-0.1),
    case("rate-nan", ValueError, RATE + "nan$", decay_rate=NAN),
    case("rate-inf", ValueError, RATE + "inf$", decay_rate=INF),
    case("rate-tensor-negative", ValueError, RATES + r"-1\.0$", decay_rate=per_head(0.1, -1.0, 0.1)),
    case("rate-tensor-nan", ValueError, RATES + "nan$", decay_rate=per_head(NAN, 0.1, 0.1, dtype=torch.float32)),
    case("rate-tensor-inf", ValueError, RATES + "inf$", decay_rate=per_head(0.1, 0.1, INF)),
    # ---- method, layout
    case("method-unknown", ValueError, r"^method must be one of 'vanilla', .*'chunk', 'auto', got 'fast'$",
         method="fast"),
    case("method-capitalised", ValueError, r"^method must be one of .*, got 'Chunk'$", method="Chunk"),
    case("method-none", TypeError, r"^method must be a string, one of .*chunk, auto; got NoneType$", method=None),
    case("method-index", TypeError, r"^method must be a string, .*got int$", method=3),
    case("layout-unknown", ValueError, r"^layout must be one of 'bhnd', 'bnhd', got 'bnd'$", layout="bnd"),
    case("layout-upper-case", ValueError, r"^layout must be one of 'bhnd', 'bnhd', got 'BHND'$", layout="BHND"),
    # a wrong type is a TypeError everywhere else in the API (method, scale, return_state, decay)
    case("layout-none", TypeError, r"^layout must be .*bhnd.*bnhd.*None", layout=None),
    # ---- scale
    case("scale-str", TypeError, r"^scale must be a real number, got str$", scale="2"),
    case("scale-none", TypeError, r"^scale must be a real number, got NoneType$", scale=None),
    case("scale-bool", TypeError, r"^scale must be a real number, got bool$", scale=True),
    case("scale-complex", TypeError, r"^scale must be a real number, got complex$", scale=1j),
    case("scale-nan", ValueError, r"^scale must be finite, got nan$", scale=NAN),
    case("scale-inf", ValueError, r"^scale must be finite, got -inf$", scale=-INF),
    # ---- initial_state, return_state
    case("state-dk-dv-swapped", ValueError, STATE_SHAPE + r"\(2, 3, 6, 4\)$", initial_state=randn(B, H, DV, DK)),
    case("state-3d", ValueError, STATE_SHAPE + r"\(3, 4, 6\)$", initial_state=randn(H, DK, DV)),
    case("state-shape-of-the-layout", ValueError, STATE_SHAPE + r"\(2, 5, 4, 6\)$", q=QT, k=KT, v=VT,
         layout="bnhd", initial_state=randn(B, N, DK, DV)),
    case("state-float16", TypeError, r"^initial_state must be float32 \(or float64\), got float16$",
         initial_state=randn(B, H, DK, DV, dtype=torch.float16)),
    case("state-bfloat16", TypeError, r"^initial_state must be float32 \(or float64\), got bfloat16$",
         q=Q.bfloat16(), k=K.bfloat16(), v=V.bfloat16(), initial_state=randn(B, H, DK, DV, dtype=torch.bfloat16)),
    case("state-int", TypeError, r"^initial_state must be float32 \(or float64\), got int64$",
         initial_state=torch.zeros(B, H, DK, DV, dtype=torch.int64)),
    case("state-meta-device", TypeError, r"^initial_state must hold data \(a CPU or CUDA tensor\), got a tensor on",
         initial_state=randn(B, H, DK, DV, device="meta")),
    case("state-list", TypeError, "^initial_state " + TENSOR_OR_CUDA + "list$",
         initial_state=torch.zeros(B, H, DK, DV).tolist()),
    case("return-state-int", TypeError, r"^return_state must be a bool, got int$", return_state=1),
    case("return-state-str", TypeError, r"^return_state must be a bool, got str$", return_state="yes"),
    case("return-state-none", TypeError, r"^return_state must be a bool, got NoneType$", return_state=None),
    # ---- fp32_precision
    case("fp32-precision-torch-name", ValueError, r"^fp32_precision must be None, 'exact' or 'tf32', got 'highest'$",
         fp32_precision="highest"),
    case("fp32-precision-upper-case", ValueError, r"^fp32_precision must be None, 'exact' or 'tf32', got 'TF32'$",
         fp32_precision="TF32"),
    case("fp32-precision-empty", ValueError, r"^fp32_precision must be None, 'exact' or 'tf32', got ''$",
         fp32_precision=""),
    case("fp32-precision-int", TypeError, r"^fp32_precision must be None or a string, 'exact' or 'tf32'; got int$",
         fp32_precision=3),
    case("fp32-precision-bool", TypeError, r"^fp32_precision must be None or a string, .*; got bool$",
         fp32_precision=True),
    case("fp32-precision-dtype", TypeError, r"^fp32_precision must be None or a string, .*; got dtype$",
         fp32_precision=torch.float32),
]


@pytest.mark.parametrize("changes, exc, match", CASES)
def test_bad_argument(changes, exc, match):
    with pytest.raises(exc, match=match):
        call(**changes)


def test_good_arguments_reach_the_computation():
    """The base arguments of every case above are valid (each case is bad for one reason only),
    and the fixture really stops the computation (so a case that got through would fail)."""
    with pytest.raises(ComputationStarted):
        call()
    with pytest.raises(ComputationStarted):
        call(q=QT, k=KT, v=VT, layout="bnhd", decay=full(0.5), initial_state=randn(B, H, DK, DV),
             return_state=True, scale=2, method="scan")
    with pytest.raises(ComputationStarted):
        call(decay_rate=per_head(0.0, 1.0, 30.0, dtype=torch.float32), initial_state=randn(B, H, DK, DV).double())
    for precision in (None, "exact", "tf32"):
        with pytest.raises(ComputationStarted):
            call(fp32_precision=precision)


@pytest.mark.parametrize("changes, exc, match", [
    case("decay-zero", ValueError, FACTOR + r"0\.0$", decay=0.0),
    case("method-unknown", ValueError, r"^method must be one of .*, got 'fast'$", method="fast"),
    case("state-dk-dv-swapped", ValueError, STATE_SHAPE + r"\(2, 3, 6, 4\)$",
         initial_state=randn(B, H, DV, DK), return_state=True),
    case("k-seq", ValueError, "^k " + sizes(0) + r"\(2, 3, 1\)", k=randn(B, H, 1, DK)),
    case("fp32-precision", ValueError, r"^fp32_precision must be None, 'exact' or 'tf32', got 'fast'$",
         fp32_precision="fast"),
])
def test_checks_come_before_the_empty_shortcut(changes, exc, match):
    """An empty sequence (N = 0) skips the computation, not the checks."""
    q, k, v = (x[:, :, :0] for x in (Q, K, V))
    with pytest.raises(exc, match=match):
        call(**{"q": q, "k": k, "v": v, **changes})
