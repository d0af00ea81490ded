"""The side-by-side benchmark of docs/benchmark.md: ``rtkernels bench`` (or ``python -m rtkernels.cli.bench.harness``).

Every (implementation, method) on the standard shapes, with the peers measured in the same run, then
JSON + Markdown + PNG under ``--out``. Without CUDA it times on the CPU (``--quick`` for a smoke run).
A failure becomes a row with its error text; the run goes on and exits 0.

``--pass fwd`` (the default) times the forward call; ``--pass fwdbwd`` times one forward and one
backward per call: the inputs require grad, ``out.backward(grad)`` with a fixed random ``grad``, the
gradients set to None before each call. Its rows give the time and peak memory of the whole, the
output's error and the largest error of dq, dk, dv (and dγ with ``--trainable``) against fp64
gradients; the decode rows (a forward step) are skipped.

The decay is a ``[H]`` tensor on the GPU, where a model keeps it (``--decay cpu``: on the CPU, the
host path). ``--trainable`` (with ``--pass fwdbwd``) makes it a tensor that requires grad, as a
learned decay is: rtkernels takes it as ``decay``, fla as per-token gates ``g`` (its ``g_gamma``
gets no gradient). ``--graph`` adds the kernel time alone: ten forward calls captured in one CUDA
graph and replayed, no Python and no launch overhead. Errors are against the fp64 reference of
:mod:`.reference`, which shares no code with the library, on every batch.

``--impls ... linear_attention`` adds ``rtkernels.linear_attention`` rows (method "identity" and
"1+qk": the feature), on request only: q, k = elu(x) + 1 of the bench's x (a positive
denominator), scale Dk^-1/2, against a normalized fp64 reference built from four reference calls
per head; name ``rtkernels`` too for the core call's time and memory in the same run.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from ...api import METHOD_NAMES

if TYPE_CHECKING:
    import torch

#: One shape: (B, H, N, D, dtypes), or (B, H, N, Dk, Dv, dtypes) where the value width differs from
#: the key width (QUICK's entries: the same without the dtypes).
Shape = Union[tuple[int, int, int, int, tuple[str, ...]], tuple[int, int, int, int, int, tuple[str, ...]]]
#: The standard shapes of docs/benchmark.md: name -> [Shape]; decode is one token, one entry per B
SHAPES: dict[str, list[Shape]] = {
    "small": [(2, 32, 1024, 128, ("bf16", "fp32"))],
    "mid": [(4, 32, 4096, 128, ("bf16", "fp16", "fp32"))],
    "long": [(1, 32, 16384, 128, ("bf16", "fp32"))],
    "d64": [(8, 16, 2048, 64, ("bf16",))],
    "d256": [(2, 16, 4096, 256, ("bf16",))],
    "retnet": [(2, 8, 4096, 256, 512, ("bf16",))],  # RetNet's heads: Dv = 2 Dk
    "huge": [(1, 8, 1048576, 128, ("bf16",))],
    "huge128k": [(1, 8, 131072, 128, ("bf16",))],  # for time(1M) / time(128K), the O(N) check
    "decode": [(64, 32, 1, 128, ("bf16",)), (256, 32, 1, 128, ("bf16",))],
}
#: --quick: tiny shapes of the same names, a smoke run (e.g. on the CPU)
QUICK: dict[str, list[tuple[int, ...]]] = {
    "small": [(1, 2, 64, 16)], "mid": [(2, 2, 128, 16)], "long": [(1, 2, 512, 16)], "d64": [(2, 2, 128, 64)],
    "d256": [(1, 2, 128, 256)], "retnet": [(1, 2, 128, 256, 512)],
    "huge": [(1, 2, 1024, 16)], "huge128k": [(1, 2, 128, 16)], "decode": [(2, 2, 1, 16), (4, 2, 1, 16)]}
METHODS = METHOD_NAMES  # every method of the registry, and "auto"
PASSES = ("fwd", "fwdbwd")
IMPLS = ("rtkernels", "fla", "leetdecoding", "torch", "linear_attention")
#: run unless --impls names others; linear_attention (normalized, its own inputs and reference) on request
DEFAULT_IMPLS = ("rtkernels", "fla", "leetdecoding", "torch")
O_N_MEMORY = ("scan", "fleet", "block", "chunk", "auto")  # rtkernels methods run on "huge*"
FLUSH_BYTES = 256 << 20
DEFAULT_OUT = Path("bench-out")  # under the working directory


def dims(entry: Sequence[Any]) -> tuple[int, int, int, int, int]:
    """(B, H, N, Dk, Dv) of a :data:`SHAPES` or :data:`QUICK` entry (Dv = D where it gives one D)."""
    b, h, n, dk, *rest = (x for x in entry if isinstance(x, int))
    return b, h, n, dk, (rest[0] if rest else dk)


@dataclass
class Case:
    """One shape: ``name`` from the standard table, ``label`` as the table shows it; ``d`` is Dk and
    ``dv`` the value width (0: the same as ``d``)."""

    name: str
    label: str
    b: int
    h: int
    n: int
    d: int
    dtypes: tuple[str, ...]
    decode: bool
    dv: int = 0

    def __post_init__(self) -> None:
        self.dv = self.dv or self.d

    @property
    def dims_text(self) -> str:
        """B×H×N×D, with D as Dk/Dv where they differ."""
        return "×".join(map(str, (self.b, self.h, self.n))) + "×" + (
            str(self.d) if self.dv == self.d else f"{self.d}/{self.dv}")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (also used by ``rtkernels bench``)."""
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                        help="standard shapes to run (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16", "fp32"), default=["bf16", "fp16", "fp32"],
                        help="dtypes to run, where the shape's row lists them (default: all)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                        help="implementations (default: all but linear_attention, the normalized call: its rows, "
                             "'identity' and '1+qk', take positive-feature q, k and their own fp64 reference)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="rtkernels methods")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions, exactly (default: at least 20, more for a short call, "
                             "up to 200 or 0.1 s of calls; 3 with --quick)")
    parser.add_argument("--max-call-s", type=float, default=2.0,
                        help="a call slower than this gets 3 repetitions only (default 2 s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default ./bench-out)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, e.g. on the CPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--no-jit", action="store_true",
                        help="skip the JIT figures (cold compile per kernel, first call with a warm disk cache)")
    parser.add_argument("--pass", dest="pass_", choices=PASSES, default="fwd",
                        help="what a call times: the forward (fwd, default) or forward + backward with "
                             "out.backward(grad) (fwdbwd; decode shapes are skipped)")
    parser.add_argument("--decay", choices=("cuda", "cpu"), default="cuda",
                        help="where rtkernels' [H] decay tensor lives: on the GPU as in a model (default), "
                             "or on the CPU")
    parser.add_argument("--trainable", action="store_true",
                        help="with --pass fwdbwd: the decay requires grad and its gradient is part of the call")
    parser.add_argument("--fp32-precision", choices=("exact", "tf32"), default=None,
                        help="rtkernels' fp32_precision for fp32 rows (default: torch's float32 matmul setting, "
                             "'exact' unless changed)")
    parser.add_argument("--graph", action="store_true",
                        help="also time the forward kernels alone: 10 calls captured in a CUDA graph, replayed")
    return parser


def make_cases(shapes: Sequence[str], dtypes: Sequence[str], quick: bool) -> list[Case]:
    """The selected shapes with the dtypes both their table row and ``--dtypes`` list."""
    cases = []
    for name in shapes:
        for i, entry in enumerate(SHAPES[name]):
            b, h, n, dk, dv = dims(QUICK[name][i] if quick else entry)
            kept = tuple(x for x in entry[-1] if x in dtypes)
            if kept:
                label = f"decode B={b}" if name == "decode" else name
                cases.append(Case(name, label, b, h, n, dk, kept, name == "decode", dv))
    return cases


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int,
                with_grad: bool = False) -> dict[str, Any]:
    """q, k = randn/sqrt(Dk) in ``[B, H, N, Dk]``, v = randn in ``[B, H, N, Dv]``;
    γ = 1 − exp(linspace(log(1/32), log(1/512), H)) (float64, CPU); for decode also a float32 state S
    ``[B, H, Dk, Dv]``; with ``with_grad`` the incoming gradient of the output ``grad`` = randn
    ``[B, H, N, Dv]`` (else None)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, div: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).div_(div).to(dtype)

    keys, values = (case.b, case.h, case.n, case.d), (case.b, case.h, case.n, case.dv)
    inp = {"qkv": (randn(*keys, div=math.sqrt(case.d)), randn(*keys, div=math.sqrt(case.d)), randn(*values)),
           "gamma": -torch.expm1(torch.linspace(math.log(1 / 32), math.log(1 / 512), case.h, dtype=torch.float64)),
           "state": None}
    if case.decode:
        inp["state"] = torch.randn(case.b, case.h, case.d, case.dv, generator=gen, device=device)
    inp["grad"] = randn(*values) if with_grad else None
    return inp


@dataclass
class Reference:
    """The fp64 answer of one input: the output ``[B, H, N, Dv]``, how it was made, and with an
    incoming gradient dq, dk, dv of batch 0 (``[H, N, Dk]``, ``[H, N, Dk]``, ``[H, N, Dv]``) and
    dL/dγ ``[H]`` (all batches)."""

    out: torch.Tensor
    note: str
    grads: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    dgamma: Optional[torch.Tensor] = None


def reference(inp: dict[str, Any], case: Case, head: Any = None) -> Reference:
    """The fp64 reference of :mod:`.reference` (no code shared with the library) on every batch;
    ``head(q, k, v, gamma)`` replaces its per-head function (:func:`normalized_case`)."""
    import torch

    from .reference import head_reference

    head_reference = head or head_reference
    q, k, v = inp["qkv"]
    gamma = inp["gamma"]
    if case.decode:
        s = gamma.to(q.device)[:, None, None] * inp["state"].double() + k.double().transpose(-1, -2) @ v.double()
        return Reference(q.double() @ s, "fp64 one-step recurrence")
    grad = inp.get("grad")
    ref = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    grads = None if grad is None else tuple(torch.empty(t.shape[1:], dtype=torch.float64, device=t.device)
                                            for t in (q, k, v))
    dgamma = None if grad is None else torch.zeros(case.h, dtype=torch.float64)
    for b in range(case.b):
        for h in range(case.h):  # one head at a time bounds the memory
            leaves = [t[b, h].double().requires_grad_(grad is not None) for t in (q, k, v)]
            g = gamma[h].to(q.device, copy=True).requires_grad_(grad is not None)
            with torch.set_grad_enabled(grad is not None):
                out = head_reference(*leaves, g)
            ref[b, h] = out.detach()
            if grad is not None:
                dq, dk, dv, dg = torch.autograd.grad(out, (*leaves, g), grad[b, h].double())
                if b == 0:
                    grads[0][h], grads[1][h], grads[2][h] = dq, dk, dv
                dgamma[h] += float(dg)
    note = "fp64 blockwise reference (bench/reference), every batch" + (", normalized" if head else "")
    return Reference(ref, note + (", gradients by autograd through it" if grad is not None else ""), grads, dgamma)


def normalized_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, feature: str,
                    eps: float = 1e-6) -> torch.Tensor:
    """linear_attention's answer for one head in fp64 from four reference calls: ``o = num / (den + eps)``,
    num and den the operator with v and with a ones column (``"1+qk"``: plus the same with a query
    and key of ones); scale Dk^-1/2 as the bench's linear_attention rows pass it. Differentiable."""
    import torch

    from .reference import head_reference

    scale = q.shape[-1] ** -0.5
    e = torch.ones(q.shape[0], 1, dtype=torch.float64, device=q.device)
    num = head_reference(q, k, v, gamma) * scale
    den = head_reference(q, k, e, gamma) * scale
    if feature == "1+qk":
        num = num + head_reference(e, e, v, gamma)
        den = den + head_reference(e, e, e, gamma)
    return num / (den + eps)


def normalized_case(inp: dict[str, Any], case: Case, feature: str) -> tuple[dict[str, Any], Reference]:
    """The inputs of a linear_attention row -- q, k = elu(x) + 1 with the bench's x = randn (positive
    features: a denominator well above 0), v and the gradient as given -- and their fp64 reference."""
    import functools

    import torch

    q, k, v = inp["qkv"]
    root = math.sqrt(case.d)
    pos = tuple((torch.nn.functional.elu(t.float() * root) + 1).to(t.dtype) for t in (q, k))
    new = {**inp, "qkv": (*pos, v)}
    return new, reference(new, case, functools.partial(normalized_head, feature=feature))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖_F / ‖ref‖_F over every leading index (fp64, one slice at a time)."""
    num = den = 0.0
    out, ref = out.reshape(-1, *out.shape[-2:]), ref.reshape(-1, *ref.shape[-2:])
    for i in range(ref.shape[0]):
        num += float((out[i].double() - ref[i]).square().sum())
        den += float(ref[i].square().sum())
    return math.sqrt(num / den) if den else float("nan")


def skip_reason(case: Case, impl: Any, pass_: str = "fwd", trainable: bool = False) -> Optional[str]:
    """Why ``impl`` does not run on ``case`` in ``pass_`` (None: it runs)."""
    if trainable and pass_ == "fwdbwd" and impl.trainable is None:
        return "no gradient of the decay"
    if case.decode and pass_ == "fwdbwd":
        return "decode is a forward step: --pass fwdbwd times the other shapes"
    if case.decode and impl.decode is None:
        return "no decode step (the decode rows run rtkernels method 'scan' with initial_state)" \
            if impl.name == "rtkernels" else "no decode API (one token from a given state)"
    if case.name.startswith("huge") and impl.name == "torch":
        return "N² mask at N = 1M needs terabytes"
    if case.name.startswith("huge") and impl.name == "rtkernels" and impl.method not in O_N_MEMORY:
        return f"'{impl.method}' is not O(N) in memory (or is O(N²) in work); huge runs O(N)-memory methods only"
    return None


def forward_backward(forward: Any, leaves: Sequence[torch.Tensor], g: Any, grad: torch.Tensor) -> Any:
    """A call of ``--pass fwdbwd``: the gradients of ``leaves`` (and of ``g`` if it requires grad)
    set to None, ``out = forward(*leaves, g)``, ``out.backward(grad)``; returns the output (detached)."""
    def fn() -> Any:
        for t in leaves:
            t.grad = None
        if getattr(g, "requires_grad", False):
            g.grad = None
        out = forward(*leaves, g)
        if not out.requires_grad:
            raise RuntimeError("no backward: the output does not require grad")
        out.backward(grad)
        return out.detach()
    return fn


def measure(impl: Any, case: Case, inp: dict[str, Any], ref: Reference, device: torch.device,
            reps: int, flush: Optional[torch.Tensor], max_call_s: float, backward: bool = False,
            trainable: bool = False, graph: bool = False, extend: bool = False) -> dict[str, Any]:
    """Time one implementation on one input; its error vs ``ref`` (every batch) and its peak memory.
    With ``backward`` (``--pass fwdbwd``) each call is a forward and a backward, and the row also
    gives ``grad_rel_err``, the largest error of dq, dk, dv (batch 0) and, with ``trainable``, of
    dL/dγ, and ``fixed_ms``, the same step with a fixed decay timed interleaved with it (``x_fixed``:
    the ratio). With ``graph`` a forward row also gets ``graph_ms``, the kernel time alone.
    ``extend``: a short call repeats more than ``reps`` times (:func:`.timing.time_calls`; the
    default when ``--reps`` is not given)."""
    from . import timing

    g = impl.decay(inp["gamma"], device)
    if trainable and backward:
        g = g.detach().clone().requires_grad_(True)
    layout = (lambda t: t) if impl.layout == "bhnd" else (lambda t: t.transpose(1, 2).contiguous())
    args = inp["qkv"] if impl.layout == "bhnd" else tuple(layout(t) for t in inp["qkv"])
    leaves: list[torch.Tensor] = []
    if case.decode:
        def fn() -> Any:
            return impl.decode(*args, g, inp["state"])
    elif backward:
        leaves = [t.detach().requires_grad_(True) for t in args]
        fn = forward_backward(impl.trainable if trainable else impl.forward, leaves, g, layout(inp["grad"]))
    else:
        def fn() -> Any:
            return impl.forward(*args, g)
    row: dict[str, Any] = {"method": impl.decode_method if case.decode else impl.method}
    if impl.path is not None:
        row["path"] = impl.path(args[0], args[2])
        if leaves and impl.backward_path is not None:
            row["path"] += f", bwd: {impl.backward_path(args[0], args[2])}"
    if trainable and backward:  # the same step with the decay fixed, interleaved with it: "x fixed"
        fixed = forward_backward(impl.forward, leaves, impl.decay(inp["gamma"], device), layout(inp["grad"]))
        t_fixed, t = timing.time_calls([fixed, fn], device, reps, flush, max_call_s, extend)
        row.update(t)
        row["fixed_ms"], row["x_fixed"] = t_fixed["ms"], t["ms"] / t_fixed["ms"]
    else:
        row.update(timing.time_call(fn, device, reps, flush, max_call_s, extend))
    if graph and not backward and device.type == "cuda":
        try:
            row["graph_ms"] = timing.graph_replay_ms(fn, reps)
        except Exception as exc:  # a call that cannot be captured says so in its row
            row["graph_error"] = _err(exc)
    for t in leaves:  # the last repetition's gradients are not part of the measured call
        t.grad = None
    out, extra = timing.run_with_peak(fn, device)
    in_bytes = sum(t.numel() * t.element_size() for t in (*args, *([inp["state"]] if case.decode else []),
                                                           *([inp["grad"]] if leaves else [])))
    if extra is not None:
        row["extra_mb"], row["peak_mb"] = extra / 2 ** 20, (extra + in_bytes) / 2 ** 20
    row["rel_err"] = rel_err(out if impl.layout == "bhnd" else out.transpose(1, 2), ref.out)
    if leaves:
        errs = [rel_err(t.grad[0] if impl.layout == "bhnd" else t.grad[0].transpose(0, 1), r)
                for t, r in zip(leaves, ref.grads)]
        if trainable:
            dg = g.grad.double().cpu()
            if impl.decay_is_log:  # dL/dlog γ -> dL/dγ
                dg = dg / inp["gamma"]
            row["decay_grad_rel_err"] = float((dg - ref.dgamma).norm() / ref.dgamma.norm())
            errs.append(row["decay_grad_rel_err"])
        row["grad_rel_err"] = max(errs)
    return row


def host_overheads(impls: list[Any], device: torch.device) -> dict[str, Any]:
    """µs per call of 200 back-to-back calls at a tiny shape (1, 1, 64, 64): rtkernels chunk and scan
    (decay as a [H] CPU tensor and as a float, chunk also as a CUDA tensor and with autograd history;
    chunk's repeated calls take the cached-call path, in compiled code where it is built, and on a
    GPU also on Python's cached path) and fla, where loaded."""
    import torch
    from ... import causal_linear_attention as cla

    from . import timing

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 1, 64, 64, device=device, dtype=dtype) for _ in range(3))
    g = torch.tensor([0.97])
    res: dict[str, Any] = {"shape": "1x1x64x64 " + str(dtype).replace("torch.", "")}
    res["rtkernels chunk, decay [H] CPU tensor"] = timing.host_overhead(lambda: cla(q, k, v, g, method="chunk"), device)
    if device.type == "cuda":
        from ... import compiled_call

        gd = g.to(device)
        res["rtkernels chunk, decay [H] CUDA tensor"] = timing.host_overhead(lambda: cla(q, k, v, gd, method="chunk"),
                                                                            device)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        gp = torch.nn.Parameter(gd.clone())
        res["rtkernels chunk, with autograd history (q, k, v and a CUDA decay parameter)"] = timing.host_overhead(
            lambda: cla(*xs, gp, method="chunk"), device)
        if compiled_call.module is not None:
            with compiled_call.suspended():
                res["rtkernels chunk, decay [H] CUDA tensor, Python's cached path"] = timing.host_overhead(
                    lambda: cla(q, k, v, gd, method="chunk"), device)
                res["rtkernels chunk, with autograd history, Python's cached path"] = timing.host_overhead(
                    lambda: cla(*xs, gp, method="chunk"), device)
    res["rtkernels chunk, decay float"] = timing.host_overhead(lambda: cla(q, k, v, 0.97, method="chunk"), device)
    res["rtkernels scan, decay [H] CPU tensor"] = timing.host_overhead(lambda: cla(q, k, v, g, method="scan"), device)
    res["rtkernels scan, decay float"] = timing.host_overhead(lambda: cla(q, k, v, 0.97, method="scan"), device)
    fla = next((impl for impl in impls if impl.name == "fla"), None)
    if fla is not None:
        gf, qt, kt, vt = fla.decay(g.double(), device), *(t.transpose(1, 2).contiguous() for t in (q, k, v))
        res["fla chunk_simple_gla"] = timing.host_overhead(lambda: fla.forward(qt, kt, vt, gf), device)
    return res


def load_impls(names: Sequence[str], methods: Sequence[str], device: torch.device,
               decay_on: str = "cuda", fp32_precision: Optional[str] = None) -> tuple[list[Any], dict]:
    """The implementations to run, and what each peer's loading said (version, or why it is absent);
    ``decay_on``: where rtkernels' decay tensor lives."""
    from . import peers

    impls = [peers.rtkernels_impl(m, decay_on, fp32_precision) for m in methods] if "rtkernels" in names else []
    if "linear_attention" in names:
        impls += peers.linear_attention_impls(decay_on, fp32_precision)
    info: dict[str, Any] = {}
    for name, loader in (("fla", peers.load_fla), ("leetdecoding", peers.load_leetdecoding)):
        if name not in names:
            info[name] = {"loaded": False, "reason": "not requested (--impls)"}
            continue
        impl, info[name] = loader(device)
        impls += [impl] if impl else []
    return impls + ([peers.torch_impl()] if "torch" in names else []), info


def _err(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _free(device: torch.device) -> None:
    import gc

    import torch

    gc.collect()
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    except RuntimeError:  # a dead CUDA context: every later row records its own error
        pass


def run_case(case: Case, dt: str, impls: list[Any], device: torch.device, args: argparse.Namespace, reps: int,
             flush: Optional[torch.Tensor]) -> list[dict[str, Any]]:
    """Every implementation on one (shape, dtype): one row each, a failure becoming a row with its error."""
    import torch

    from . import report, timing

    bwd = args.pass_ == "fwdbwd" and not case.decode
    trainable = bwd and args.trainable
    base = {"shape": case.label, "B": case.b, "H": case.h, "N": case.n, "D": case.d, "Dv": case.dv, "dtype": dt,
            "pass": "decode" if case.decode else args.pass_,
            "decay": (args.decay if device.type == "cuda" else "cpu") + (", trainable" if trainable else "")}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    try:
        inp = make_inputs(case, dtype, device, args.seed, bwd)
        ref = reference(inp, case)
    except Exception as exc:
        _free(device)
        return [{**base, "impl": "inputs/reference", "error": _err(exc)}]
    in_bytes = sum(t.numel() * t.element_size() for t in inp["qkv"])
    flush = flush if flush is not None and in_bytes < 2 * timing.l2_bytes(device) else None
    rows = []
    normalized: dict[str, Any] = {}  # feature -> (inputs, reference) of the linear_attention rows
    for impl in impls:
        row = {**base, "impl": impl.name, "method": impl.decode_method if case.decode else impl.method,
               "ref": ref.note, "l2_flush": flush is not None}
        reason = skip_reason(case, impl, args.pass_, trainable)
        try:
            i_inp, i_ref = inp, ref
            if impl.normalized and not reason:
                if impl.normalized not in normalized:
                    normalized[impl.normalized] = normalized_case(inp, case, impl.normalized)
                i_inp, i_ref = normalized[impl.normalized]
                row["ref"] = i_ref.note
            row.update({"skipped": reason} if reason else
                       measure(impl, case, i_inp, i_ref, device, reps, flush, args.max_call_s, bwd, trainable,
                               args.graph, extend=args.reps is None and not args.quick))
        except Exception as exc:
            row["error"] = _err(exc)
        rows.append(row)
        status = "skipped" if reason else row.get("error") or f"{row['ms']:.3f} ms, rel err {row['rel_err']:.1e}" + (
            f", grad rel err {row['grad_rel_err']:.1e}" if "grad_rel_err" in row else "")
        print(f"  [{case.label} {dt}] {report.label(row)}: {status}", flush=True)
        _free(device)
    del inp, ref, normalized
    _free(device)
    return rows


def scaling(rows: list[dict[str, Any]]) -> dict[str, float]:
    """time(N = 1M) / time(N = 128K) per implementation run on both "huge" shapes (8 when the time
    is linear in N)."""
    from . import report

    times: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.get("shape") in ("huge", "huge128k") and isinstance(r.get("ms"), (int, float)):
            times[(r["shape"], report.label(r))] = r["ms"]
    return {impl: times[("huge", impl)] / t for (shape, impl), t in times.items()
            if shape == "huge128k" and ("huge", impl) in times}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; write OUT/bench.json, OUT/bench.md, OUT/bench.png; print the table."""
    args = add_arguments(argparse.ArgumentParser(prog="rtkernels bench", description=__doc__)).parse_args(argv)
    import torch

    from . import report

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = args.reps or (3 if args.quick else 20)
    if reps < 20 and not args.quick:
        print(f"warning: --reps {reps} < 20, below the protocol of docs/benchmark.md", file=sys.stderr)
    print(f"bench: device {device}, reps {reps}, out {args.out}", flush=True)
    env = report.environment(device, args.quick)
    if args.trainable and args.pass_ != "fwdbwd":
        print("rtkernels bench: --trainable needs --pass fwdbwd", file=sys.stderr)
        return 2
    impls, env["peers"] = load_impls(args.impls, args.methods, device, args.decay if device.type == "cuda" else "cpu",
                                     args.fp32_precision)
    env["fp32_precision"] = args.fp32_precision or "torch setting: " + torch.get_float32_matmul_precision()
    if device.type == "cuda":  # the steady state of a long-running process: cached calls in compiled code
        from ... import compiled_call

        compiled_call.build(wait=True)
        env["compiled_call"] = compiled_call.status()
    try:
        env["host_overhead_us"] = host_overheads(impls, device)
    except Exception as exc:
        env["host_overhead_us"] = {"error": _err(exc)}
    if not args.no_jit:
        from . import jit

        print("bench: JIT figures (cold compile per kernel, warm first call) ...", flush=True)
        env["jit"] = jit.measure(device.type == "cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    cases = make_cases(args.shapes, args.dtypes, args.quick)
    shapes = {c.label: c.dims_text for c in cases}
    given = {k: str(v) for k, v in vars(args).items()}
    todo = [(case, dt) for case in cases for dt in case.dtypes]
    rows: list[dict[str, Any]] = []
    for i, (case, dt) in enumerate(todo, 1):
        rows += run_case(case, dt, impls, device, args, reps, flush)
        if i < len(todo):  # a run stopped from outside (a slow peer's compile, a time limit) leaves these
            report.write(args.out, env, rows, shapes, given, partial=(i, len(todo)))
    env["scaling_1m_over_128k"] = scaling(rows)
    print(report.write(args.out, env, rows, shapes, given))
    for impl, ratio in env["scaling_1m_over_128k"].items():
        print(f"time(1M) / time(128K), {impl}: {ratio:.2f} (8 = linear)")
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
