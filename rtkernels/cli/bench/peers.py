"""One small adapter per implementation. A peer that cannot load gives ``(None, info)`` with the reason.

Every adapter takes inputs already in its own layout (prepared untimed, so no one pays a transpose)
and its decay argument already converted (``Impl.decay``, untimed).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

Tensor = torch.Tensor

#: GPU names LeetDecoding 0.0.3's table knows, tried in order until its import succeeds (its table
#: has no "NVIDIA A100-SXM4-80GB"; the name only picks a block size of a path not benchmarked here).
LEET_KNOWN_GPUS = ("NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "NVIDIA A800-SXM4-80GB", "NVIDIA RTX A6000")


@dataclass
class Impl:
    """One implementation as the benchmark calls it."""

    name: str                                          # rtkernels | fla | leetdecoding | torch
    method: str                                        # what runs for a forward pass
    layout: str                                        # "bhnd" or "bnhd"
    decay: Callable[[Tensor, torch.device], Any]       # γ [H] float64 CPU -> its decay argument
    forward: Callable[[Tensor, Tensor, Tensor, Any], Tensor]
    decode: Optional[Callable[[Tensor, Tensor, Tensor, Any, Tensor], Tensor]] = None  # -> o
    decode_method: str = ""
    path: Optional[Callable[[Tensor, Tensor], str]] = None  # "kernel" / "torch" for rtkernels
    backward_path: Optional[Callable[[Tensor, Tensor], str]] = None  # rtkernels: the backward that runs
    #: the forward with a trainable decay (its argument from ``decay``, requiring grad); None: no decay gradient
    trainable: Optional[Callable[[Tensor, Tensor, Tensor, Any], Tensor]] = None
    decay_is_log: bool = False  # the decay argument is log γ (its gradient is converted to dL/dγ)
    #: rtkernels.linear_attention's feature ("identity", "1+qk"): the row takes positive-feature q, k
    #: and the normalized fp64 reference (harness.normalized_case); "" for the plain operator
    normalized: str = ""


def dist_version(*names: str) -> Optional[str]:
    """The installed version of the first distribution of ``names`` found, or None."""
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None


def _err(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def rtkernels_impl(method: str, decay_on: str = "cuda", fp32_precision: Optional[str] = None) -> Impl:
    """``rtkernels.causal_linear_attention`` with one method; decay as a [H] float32 tensor on the
    GPU (``decay_on="cuda"``, where a model keeps it) or on the CPU (``"cpu"``); ``fp32_precision``
    as the call takes it (None: torch's float32 matmul setting)."""
    from ... import METHODS, causal_linear_attention as cla
    from ...autograd import backward_impl
    from ...methods import auto_method

    def path(q: Tensor, v: Tensor) -> str:
        name = auto_method(q, v) if method == "auto" else method
        return ("kernel" if METHODS[name].uses_kernel(q, v) else "torch") + (f": {name}" if method == "auto" else "")

    def decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s: Tensor) -> Tensor:
        return cla(q, k, v, g, method=method, initial_state=s, return_state=True)[0]

    def forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
        return cla(q, k, v, g, method=method, fp32_precision=fp32_precision)

    return Impl("rtkernels", method, "bhnd", lambda gamma, dev: gamma.float().to(dev if decay_on == "cuda" else "cpu"),
                forward, decode if method == "scan" else None, method, path,
                lambda q, v: backward_impl(q, v).__name__, trainable=forward)


def linear_attention_impls(decay_on: str = "cuda", fp32_precision: Optional[str] = None) -> list[Impl]:
    """``rtkernels.linear_attention`` (normalized), one row per feature, method "auto", scale
    Dk^-1/2, eps 1e-6; its inputs are positive features (harness.normalized_case)."""
    from ... import linear_attention
    from ...normalize_op import kernel_takes

    def impl(feature: str) -> Impl:
        def forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
            return linear_attention(q, k, v, g, scale=q.shape[-1] ** -0.5, feature=feature,
                                    fp32_precision=fp32_precision)

        def path(q: Tensor, v: Tensor) -> str:
            return "fused normalization kernel" if kernel_takes(q) else "torch normalization"

        return Impl("linear_attention", feature, "bhnd",
                    lambda gamma, dev: gamma.float().to(dev if decay_on == "cuda" else "cpu"), forward, path=path,
                    trainable=forward, normalized=feature)

    return [impl("identity"), impl("1+qk")]


def load_fla(device: torch.device) -> tuple[Optional[Impl], dict[str, Any]]:
    """fla-core: ``chunk_simple_gla`` (forward) and ``fused_recurrent_simple_gla`` (decode), layout bnhd."""
    if device.type != "cuda":
        return None, {"loaded": False, "reason": "skipped: fla's Triton kernels need a CUDA GPU"}
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except Exception as exc:
        return None, {"loaded": False, "reason": f"not importable: {_err(exc)}"}

    def decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s: Tensor) -> Tensor:
        return fused_recurrent_simple_gla(q, k, v, g_gamma=g, scale=1.0, initial_state=s,
                                          output_final_state=True)[0]

    def trainable(q: Tensor, k: Tensor, v: Tensor, lg: Tensor) -> Tensor:
        # g_gamma gets no gradient in fla; a learned per-head decay goes in as per-token gates g
        return chunk_simple_gla(q, k, v, g=lg.expand(q.shape[0], q.shape[1], lg.shape[0]), scale=1.0)[0]

    impl = Impl("fla", "chunk_simple_gla", "bnhd", lambda gamma, dev: torch.log(gamma).float().to(dev),
                lambda q, k, v, g: chunk_simple_gla(q, k, v, g_gamma=g, scale=1.0)[0],
                decode, "fused_recurrent_simple_gla", trainable=trainable, decay_is_log=True)
    return impl, {"loaded": True, "version": dist_version("fla-core", "flash-linear-attention") or "unknown"}


def load_leetdecoding(device: torch.device) -> tuple[Optional[Impl], dict[str, Any]]:
    """LeetDecoding: ``causal_linear_decoder(q, k, v, is_mask_weight=True, gamma=γ, is_need_exp=False)``.

    Its import raises KeyError on GPUs missing from its GPU-name table, so ``pycuda.driver.Device.name``
    is patched (for this process) to return a name it knows; the info records which one. Its
    ``import pycuda.autoinit`` would push a second CUDA context; ``pycuda.autoprimaryctx`` stands in
    for it, so that LeetDecoding and torch share the primary context.
    """
    if device.type != "cuda":
        return None, {"loaded": False, "reason": "skipped: needs a CUDA GPU (pycuda, CUDA extensions)"}
    try:
        import pycuda.autoprimaryctx
        import pycuda.driver as drv

        sys.modules["pycuda.autoinit"] = pycuda.autoprimaryctx
    except Exception as exc:
        return None, {"loaded": False, "reason": f"pycuda not importable: {_err(exc)}"}
    original, tried = drv.Device.name, []
    for fake in LEET_KNOWN_GPUS:
        drv.Device.name = lambda self, _n=fake: _n
        try:
            from leetDecoding.efficient_linear_decoding import causal_linear_decoder
            break
        except KeyError as exc:  # the name table again: drop the half-imported modules, try the next
            tried.append(f"{fake}: {_err(exc)}")
            for mod in [m for m in sys.modules if m.split(".")[0] == "leetDecoding"]:
                del sys.modules[mod]
        except Exception as exc:
            drv.Device.name = original
            return None, {"loaded": False, "reason": f"not importable: {_err(exc)}", "tried": tried}
    else:
        drv.Device.name = original
        return None, {"loaded": False, "reason": "KeyError for every known GPU name", "tried": tried}

    impl = Impl("leetdecoding", "causal_linear_decoder", "bhnd", lambda gamma, dev: gamma.float().to(dev),
                lambda q, k, v, g: causal_linear_decoder(q, k, v, is_mask_weight=True, gamma=g,
                                                         is_need_exp=False))
    return impl, {"loaded": True, "version": dist_version("leetDecoding", "LeetDecoding") or "unknown",
                  "gpu_name_patch": f"pycuda.driver.Device.name returns {fake!r} (real GPU: "
                                    f"{torch.cuda.get_device_name(device)}) so its name table accepts it",
                  "context": "pycuda.autoinit aliased to pycuda.autoprimaryctx (torch's primary context)",
                  "tried": tried}


def _naive_forward(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor) -> Tensor:
    """The N² masked matmul as a naive user writes it (mask built in the input dtype each call)."""
    i = torch.arange(q.shape[2], device=q.device)
    diff = (i[:, None] - i[None, :]).float()
    mask = torch.where(diff >= 0, gamma[:, None, None] ** diff, 0.0).to(q.dtype)
    return ((q @ k.transpose(-1, -2)) * mask) @ v


def _naive_decode(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, s: Tensor) -> Tensor:
    """One recurrence step in plain torch: S ← γ S + kᵀv, o = q S (fp32 state)."""
    s = gamma[:, None, None] * s + k.transpose(-1, -2).float() @ v.float()
    return (q.float() @ s).to(q.dtype)


def torch_impl() -> Impl:
    """Plain torch: the N² masked matmul (forward) and a recurrence step (decode)."""
    return Impl("torch", "N² masked matmul", "bhnd", lambda gamma, dev: gamma.float().to(dev),
                _naive_forward, _naive_decode, "recurrence step", trainable=_naive_forward)
