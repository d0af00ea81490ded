"""Large heads on the GPU (marker ``gpu``): the ``chunk`` kernels with Dk in {192, 200, 256} (KMAX 256)
and Dv in {256, 320, 384, 512} (value widths past the key limit: RetNet's Dv = 2 Dk = 512), against
the fp64 reference (tests/reference.py, autograd through it for the gradients).

Each case is one call with an initial state and ``return_state=True`` and one backward through a
loss on the output and on the final state; it checks the output, the final state and dq, dk, dv,
d(initial_state), d(decay) (a CUDA float32 ``[H]`` tensor that requires grad). The four heads of a
call carry the four decays of :data:`GAMMAS` (1e-6, 0.9, 0.99, 1), and every check is made **head by
head**, so a head whose errors are small next to another head's magnitude (gamma = 1 sums N tokens,
gamma = 1e-6 about one) is held to its own tolerance: the row error (tests/tolerances.py) of
outputs and of dq, dk, dv is relative to the typical row of its own (batch, head); the final state,
d(initial_state) and d(decay) are compared on each head's slice.

Strictness: the inputs have a positive mean (as in tests/test_gpu_variants_gamma.py), so the
contributions that cross a chunk boundary add up; for the heads at gamma 0.9 and 0.99 (fp32 in both
modes and fp16; bf16 at 0.9) the test builds the fp64 *mutants* of the kernel's chunk-level powers
(tests/fp64_models.py: the outputs' factor on the state, the key weights, the state update's carry
gamma^(C+1) instead of gamma^C; for the backward the same slips in the dq pass and, reversed, in
the dk and dv passes) and asserts with :func:`tolerances.assert_catches` that each one is at least
MUTANT_MARGIN tolerances away from the truth in that head's own metric: a kernel with such a slip
fails.

Cases: a covering design, not the cross product (the GPU suite is time-limited). Every
(Dk, Dv) pair and every (dtype / fp32 mode, Dv) pair occurs; each dtype / mode runs N = 1, 130,
644 and 1030 (several 64-token chunks, short last chunks: 2, 4, 6 tokens) and both layouts; Dk = 256,
Dv = 512 runs in fp16 at N = 1030 and in bf16 at N = 644. Plus: the kernel forward and the kernel
backward are what the library picks for Dv in (256, 512] where Dk <= 256, and Dv = 513 (over the
kernels' limit) runs the torch path, with a warning, and is still correct.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import rtkernels
from rtkernels.autograd import backward_impl, torch_backward
from rtkernels.methods import METHODS, chunk, registry
from rtkernels.methods.chunk import plan
from rtkernels.methods.chunk.backward import kernel_backward

import fp64_models as fm
from reference import reference
from tolerances import (assert_catches, assert_close, assert_close_to_magnitude, assert_rows_close, close_ratio,
                        row_error, row_tolerance)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
#: One decay per head: the edges (1e-6: about one token; 1: no decay) and the two factors at which a
#: wrong power of gamma is claimed to be caught.
GAMMAS = (1e-6, 0.9, 0.99, 1.0)
H = len(GAMMAS)
CAUGHT = (0.9, 0.99)
SCALE = 0.8
CHUNK = 64  # tokens per chunk of the chunk kernels
#: dtype / fp32 mode -> (input dtype, fp32_precision).
MODES = {"fp16": (F16, None), "bf16": (BF16, None), "fp32-exact": (F32, "exact"), "fp32-tf32": (F32, "tf32")}


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    layout: str
    b: int
    n: int
    dk: int
    dv: int

    def __str__(self) -> str:
        return f"{self.mode}-{self.layout}-B{self.b}xH{H}xN{self.n}-Dk{self.dk}-Dv{self.dv}"

    @property
    def dtype(self) -> torch.dtype:
        return MODES[self.mode][0]

    @property
    def precision(self):
        return MODES[self.mode][1]

    @property
    def kind(self):
        """The row-tolerance key of outputs and dq, dk, dv: the dtype, or "tf32"."""
        return "tf32" if self.mode == "fp32-tf32" else self.dtype

    @property
    def state_kind(self) -> torch.dtype:
        """Tolerance dtype of the final state and of d(initial_state): the chunk kernels form them from
        16-bit (TF32) operands, so the input dtype's (bf16's for TF32), fp32's in the exact mode."""
        return BF16 if self.mode == "fp32-tf32" else self.dtype

    @property
    def decay_kind(self) -> torch.dtype:
        """Tolerance dtype of d(decay): the dlog(gamma) kernel for 16-bit inputs (16-bit operands),
        the torch formula in fp32 for float32 inputs (either mode)."""
        return self.dtype


#: 16 cases (rows: Dv; columns: fp16, bf16, fp32-exact, fp32-tf32). Every (Dk, Dv) pair and every
#: (mode, Dv) pair; per mode every N of {1, 130, 644, 1030} and both layouts; B = 2 where N = 130.
CASES = [
    Case("fp16", "bhnd", 2, 130, 192, 256), Case("bf16", "bnhd", 1, 1, 200, 256),
    Case("fp32-exact", "bhnd", 1, 1030, 256, 256), Case("fp32-tf32", "bnhd", 1, 644, 192, 256),
    Case("fp16", "bnhd", 1, 644, 200, 320), Case("bf16", "bhnd", 1, 1030, 256, 320),
    Case("fp32-exact", "bnhd", 1, 1, 192, 320), Case("fp32-tf32", "bhnd", 2, 130, 200, 320),
    Case("fp16", "bhnd", 1, 1, 256, 384), Case("bf16", "bnhd", 2, 130, 192, 384),
    Case("fp32-exact", "bhnd", 1, 644, 200, 384), Case("fp32-tf32", "bnhd", 1, 1030, 256, 384),
    Case("fp16", "bnhd", 1, 1030, 256, 512), Case("bf16", "bhnd", 1, 644, 256, 512),
    Case("fp32-exact", "bnhd", 2, 130, 200, 512), Case("fp32-tf32", "bhnd", 1, 1, 192, 512),
]


# ------------------------------------------------------------------------------------- inputs --- #

def _inputs(b: int, n: int, dk: int, dv: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """[B, H, N, D] (bhnd, contiguous) q, k, v and loss weights g = dL/do in ``dtype``, and float32
    [B, H, Dk, Dv] s0 (initial state) and gs = dL/dS_N, on :data:`DEVICE`. Drawn in float64 from a
    seeded CPU generator and rounded (tests/inputs.py), so the fp64 reference sees the values the
    kernel sees: normal values plus 1, scaled by D^-1/2 (q . k and g . v about 1 and positive, the
    contributions across a chunk boundary add up; fp16 gradients far from overflow at gamma = 1);
    s0 of the size of the state of 4 such tokens, gs of one token's (its terms in dk_j, dv_j,
    gamma^(N-1-j) v_j gs^T and k_j gs, are then about one token's: at gamma = 1e-6 the last row is
    not an outlier that the row error, relative to the typical row, would hold to its rounding)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(shape: tuple, std: float, to: torch.dtype) -> torch.Tensor:
        return ((torch.randn(shape, generator=gen, dtype=torch.float64) + 1.0) * std).to(to).to(DEVICE)

    keys, values = (b, H, n, dk), (b, H, n, dv)
    return {"q": draw(keys, dk ** -0.5, dtype), "k": draw(keys, dk ** -0.5, dtype),
            "v": draw(values, dv ** -0.5, dtype), "g": draw(values, dv ** -0.5, dtype),
            "s0": draw((b, H, dk, dv), 4 * (dk * dv) ** -0.5, F32),
            "gs": draw((b, H, dk, dv), (dk * dv) ** -0.5, F32)}


def _in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A [B, H, N, D] tensor as the argument for ``layout``, contiguous in that layout."""
    return x if layout == "bhnd" else x.transpose(1, 2).contiguous()


def _bhnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The [B, H, N, D] view of a tensor in ``layout``."""
    return x if layout == "bhnd" else x.transpose(1, 2)


def _decay() -> torch.Tensor:
    return torch.tensor(GAMMAS, dtype=F32, device=DEVICE, requires_grad=True)


def _require_kernel(dtype: torch.dtype, dk: int, dv: int) -> None:
    """Skip a float32 case where no fp32 kernel tile fits this GPU's shared memory (KMAX 256 needs
    about 180 KB per CTA: an H100/H200 or A100 has it, consumer GPUs do not)."""
    if dtype == F32:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if plan.f32_config(dk, dv, props.shared_memory_per_block_optin) is None:
            pytest.skip(f"no fp32 chunk-kernel tile for Dk = {dk} fits this GPU's shared memory")


# -------------------------------------------------------------------------------- the run --- #

def _run(x: dict, layout: str, precision, expect_kernel: bool) -> dict[str, torch.Tensor]:
    """One call (initial state, final state returned) and one backward of
    L = sum(g * out) + sum(gs * S_N): the output, the state and the gradients, as [B, H, ...]."""
    leaves = {name: _in_layout(x[name], layout).detach().requires_grad_(True) for name in "qkv"}
    s0 = x["s0"].detach().clone().requires_grad_(True)
    decay = _decay()
    qb, vb = _bhnd(leaves["q"], layout), _bhnd(leaves["v"], layout)
    assert METHODS["chunk"].uses_kernel(qb, vb) is expect_kernel, "the chunk kernel forward (or not)"
    assert (backward_impl(qb, vb) is kernel_backward) is expect_kernel, "the chunk kernel backward (or not)"
    assert (backward_impl(qb, vb) is torch_backward) is not expect_kernel
    out, state = rtkernels.causal_linear_attention(leaves["q"], leaves["k"], leaves["v"], decay, scale=SCALE,
                                                   method="chunk", layout=layout, initial_state=s0,
                                                   return_state=True, fp32_precision=precision)
    loss = (out.float() * _in_layout(x["g"], layout).float()).sum() + (state * x["gs"]).sum()
    loss.backward()
    got = {"out": _bhnd(out, layout), "state": state, "initial_state": s0.grad, "decay": decay.grad}
    for name in "qkv":
        assert leaves[name].grad.dtype == leaves[name].dtype, f"d{name}: {leaves[name].grad.dtype}"
        got[name] = _bhnd(leaves[name].grad, layout)
    return got


def _want(x: dict, absolute: bool = False) -> dict[str, torch.Tensor]:
    """fp64 output, final state and gradients of the same loss through tests/reference.py (on the
    inputs' device). ``absolute``: on |inputs| and |loss weights|, every term positive: the
    magnitude that d(decay)'s rounding error is bounded by (tests/test_gpu_kernel_backward.py)."""
    prep = (lambda t: t.detach().double().abs()) if absolute else (lambda t: t.detach().double())
    leaves = {name: prep(x[name]).requires_grad_(True) for name in ("q", "k", "v", "s0")}
    gam = _decay().detach().double().requires_grad_(True)  # the fp32-rounded factors the kernel reads
    out, state = reference(leaves["q"], leaves["k"], leaves["v"], gam, SCALE, "bhnd", leaves["s0"])
    loss = (out * prep(x["g"])).sum() + (state * prep(x["gs"])).sum()
    grads = torch.autograd.grad(loss, [leaves["q"], leaves["k"], leaves["v"], leaves["s0"], gam])
    return {"out": out.detach(), "state": state.detach(),
            **dict(zip(("q", "k", "v", "initial_state", "decay"), grads))}


def _claims(dtype: torch.dtype, gamma: float) -> bool:
    """Where wrong powers are claimed caught (tests/test_gpu_variants_gamma.py): gamma 0.9 and 0.99 in
    fp32 (both modes) and fp16, 0.9 in bf16 (at 0.99 an error of 1 - gamma is within bf16's rounding)."""
    return gamma in CAUGHT and (dtype != BF16 or gamma == 0.9)


def _mutants(n: int, device) -> dict[str, tuple]:
    """The chunk-level slips of the kernel (tests/fp64_models.py), as (extra exponents of the outputs,
    of the final state). The state carry reaches the outputs only through keys two chunks back
    (gamma^(C+1): 1e-3 at 0.9); at 0.9 it is claimed through the final state (the short last chunk)."""
    return {"output factor gamma^(t+2)": fm.output_factor(n, CHUNK, device),
            "key weight gamma^(len-s)": fm.key_weight(n, CHUNK, device),
            "state carry gamma^(len+1)": fm.state_carry(n, CHUNK, device)}


def _assert_catches_mutants(case: Case, x: dict, want: dict, log: dict) -> None:
    """For every head whose gamma is claimed: each mutant of :func:`_mutants` (forward: the output's
    row error or the final state's error; backward: the same slip in the dq pass, in token order, and
    in the reversed dk and dv passes) is at least MUTANT_MARGIN of that head's tolerance away. The
    mutants change the q.k part of the operator (fp64_models.masked and masked_grads, which have no
    initial state and no state loss), added as a difference to the full fp64 answer."""
    n = case.n
    dev = x["q"].device
    heads = [h for h, gamma in enumerate(GAMMAS) if _claims(case.dtype, gamma)]
    if n <= CHUNK or not heads:
        return
    q, k, v, g = (x[name] for name in "qkvg")
    gam = _decay().detach().double()
    tol = row_tolerance(case.kind, n)
    exact_out = fm.masked(q, k, v, gam, SCALE)
    exact_state = fm.final_state(k, v, gam)
    exact_grads = fm.masked_grads(q, k, v, g, gam, SCALE)
    for mutant, (extra, to_end) in _mutants(n, dev).items():
        out = want["out"] + (fm.masked(q, k, v, gam, SCALE, extra) - exact_out)
        state = want["state"] + (fm.final_state(k, v, gam, to_end) - exact_state)
        grads = [w + (m - e) for w, m, e in
                 zip((want[c] for c in "qkv"), fm.masked_grads(q, k, v, g, gam, SCALE, extra, fm.in_reverse(extra)),
                     exact_grads)]
        for h in heads:
            what = f"{case} head {h} gamma={GAMMAS[h]}: {mutant}"
            fwd = {"output": row_error(out[:, h], want["out"][:, h]) / tol,
                   "state": close_ratio(state[:, h], want["state"][:, h], case.state_kind, n)}
            bwd = {f"d{c}": row_error(m[:, h], want[c][:, h]) / tol for c, m in zip("qkv", grads)}
            log.setdefault(f"head{h}", {})[mutant] = {**fwd, **bwd}
            assert_catches(fwd, f"{what} (forward)")
            if mutant != "state carry gamma^(len+1)" or GAMMAS[h] == 0.99:  # the backward has no state
                assert_catches({"dq": bwd["dq"]}, f"{what} (dq pass)")  # carry at 0.9: gamma^(C+1) ~ 1e-3
                assert_catches({"dk": bwd["dk"], "dv": bwd["dv"]}, f"{what} (dk, dv passes)")


def _assert_per_head(case: Case, got: dict, want: dict, magnitude: torch.Tensor, log: dict) -> None:
    """Every check on each head's slice (heads of gamma 1e-6 and 1 differ in size by ~N); ``log``
    gets each error as a fraction of its tolerance (for calibration, in the JUnit XML)."""
    n = case.n
    for h, gamma in enumerate(GAMMAS):
        what = f"{case} head {h} gamma={gamma}"
        entry = log.setdefault(f"head{h}", {})
        for name in ("out", "q", "k", "v"):
            label = "output" if name == "out" else f"d{name}"
            err = assert_rows_close(got[name][:, h], want[name][:, h], case.kind, f"{what} {label}", n)
            entry[label] = err / row_tolerance(case.kind, n)
        for name, label in (("state", "final state"), ("initial_state", "d(initial_state)")):
            entry[label] = close_ratio(got[name][:, h], want[name][:, h], case.state_kind, n)
            assert_close(got[name][:, h], want[name][:, h], case.state_kind, f"{what} {label}", n=n)
        s = slice(h, h + 1)
        assert_close_to_magnitude(got["decay"][s], want["decay"][s], magnitude[s], case.decay_kind,
                                  f"{what} d(decay)", n=n)


# ------------------------------------------------------------------------------------- tests --- #

@pytest.mark.parametrize("case", CASES, ids=str)
def test_large_heads_match_fp64(case, record_property):
    """Output, final state, dq, dk, dv, d(initial_state), d(decay) of the chunk kernels (forward and
    kernel backward) within the dtype's (mode's) tolerance of fp64, head by head, with the chunk-level
    wrong powers shown to be caught at gamma 0.9 / 0.99."""
    _require_kernel(case.dtype, case.dk, case.dv)
    x = _inputs(case.b, case.n, case.dk, case.dv, case.dtype, seed=CASES.index(case) * 1000 + case.n)
    got = _run(x, case.layout, case.precision, expect_kernel=True)
    want = _want(x)
    log: dict = {}
    _assert_catches_mutants(case, x, want, log)
    _assert_per_head(case, got, want, _want(x, absolute=True)["decay"], log)
    record_property("large_heads", json.dumps(log))


#: (Dk, Dv) the chunk kernels take (Dk <= 256, Dv <= 512) with Dv past the key limit, and ones they
#: do not (Dv = 513, Dk = 257).
KERNEL_HEADS = [(256, 257), (256, 512), (200, 384), (192, 320), (128, 512), (64, 448), (16, 300)]
TORCH_HEADS = [(256, 513), (64, 1024), (257, 256), (257, 512)]


@pytest.mark.parametrize("dtype", (F16, BF16, F32), ids=str)
def test_kernel_path_for_value_widths_up_to_512(dtype):
    """The chunk kernels' predicate (``plan.kernel_supports``, behind ``Method.uses_kernel``) and the
    backward the library picks (``backward_impl``: the kernel backward) for Dv in (256, 512], Dk <= 256,
    in both layouts' views; Dv > 512 or Dk > 256: neither (the torch paths)."""
    for dk, dv in KERNEL_HEADS + TORCH_HEADS:
        takes = dk <= 256 and dv <= 512
        if takes:
            _require_kernel(dtype, dk, dv)
        for layout in ("bhnd", "bnhd"):
            q = _bhnd(torch.empty(_shape(layout, dk), dtype=dtype, device=DEVICE), layout)
            v = _bhnd(torch.empty(_shape(layout, dv), dtype=dtype, device=DEVICE), layout)
            what = f"Dk = {dk}, Dv = {dv}, {dtype}, {layout}"
            assert chunk.kernel_supports(q, v) is takes, what
            assert METHODS["chunk"].uses_kernel(q, v) is takes, what
            assert backward_impl(q, v) is (kernel_backward if takes else torch_backward), what


def _shape(layout: str, d: int, b: int = 2, h: int = 3, n: int = 130) -> tuple:
    return (b, h, n, d) if layout == "bhnd" else (b, n, h, d)


@pytest.mark.parametrize("dtype", (F16, F32), ids=str)
def test_value_width_over_the_limit_runs_the_torch_path(dtype, monkeypatch):
    """Dv = 513 (Dk = 256): the chunk method runs its torch path (forward and torch backward), warns
    once naming the kernels' limit, and is still correct against fp64, head by head, for every output
    and gradient (the torch path computes in fp32; the dtype's tolerance)."""
    b, n, dk, dv, layout = 1, 130, 256, 513, "bnhd"
    case = Case("fp16" if dtype == F16 else "fp32-exact", layout, b, n, dk, dv)
    x = _inputs(b, n, dk, dv, dtype, seed=513)
    monkeypatch.setattr(registry, "_warned_heads", set())  # the warning is once per (method, Dk, Dv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(x, layout, None, expect_kernel=False)
    limit = f"Dk <= {chunk.MAX_DIM} and Dv <= {chunk.MAX_VALUE_DIM} only; Dk = {dk}, Dv = {dv} runs its torch path"
    assert any(issubclass(w.category, RuntimeWarning) and limit in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    want = _want(x)
    _assert_per_head(case, got, want, _want(x, absolute=True)["decay"], {})
