r"""``decode``: a generation step against a pool of states, updated in place.

Sequence b of a batch owns row ``state_indices[b]`` of a pool ``[S, H, Dk, Dv]`` (a serving engine
keeps the states of all live requests in one pool and passes slot indices). A step brings T >= 1
new tokens per sequence (T = 1 for plain decoding, a few for speculative decoding) and runs the
recurrence of :func:`rtkernels.causal_linear_attention` from the state in the pool:

    for t = 0 .. T-1:   S <- gamma_h S + k_t^T v_t,      o_t = scale * q_t S

then writes S back into the same row. T steps of this are exactly a call of
``causal_linear_attention`` on the T tokens with ``initial_state`` = the row and
``return_state=True``, without allocating a new state.

Work O(B H T Dk Dv); memory traffic: the fp32 state read and written once (B H Dk Dv * 8 bytes) plus
q, k, v and the output. The step is bound by that traffic, so on a CUDA device (fp32/fp16/bf16
inputs, an fp32 pool, Dk <= 256) it is one launch of ``cuda_src/decode.cu``: one CTA per (batch,
head, tile of value columns) holding its slice of the state in registers across the T tokens. No
host sync and no copy, so a CUDA graph captures it. A repeated step of the same signature (shapes,
strides, dtypes, devices, pool alignment, decay form, scale, layout, index dtype) skips the checks
and the planning and repeats the bound launch with the new pointers (:mod:`rtkernels.call_cache`):
what a generation loop calls every token. Everything else (the CPU, float64, a float64 pool, larger
Dk, no CuPy) runs a loop over the T tokens in torch operations (:func:`torch_step`), which is also
the reference for the kernel and is free of host syncs on a GPU too.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from . import call_cache
from .api import (Array, _check_inputs, _check_scale, _check_storage, _fmt_dtype, _func_active, _is_compiling,
                  _log_decay, _results, _to_torch)
from .call_cache import _NO_KEY as NO_KEY, _decay_key as decay_key
from .decay import LogDecay
from .jit import BoundLaunch, dtype_code, get_function, kernels_available
from .jit.dtypes import KERNEL_DTYPES, compute_dtype
from .methods import scan
from .methods._launch import fwd_tail, unit_stride

__all__ = ["decode", "torch_step", "instances", "kernel_takes", "SOURCE", "MAX_DK", "STATE_DTYPES", "INDEX_DTYPES"]

SOURCE = "decode.cu"
#: Largest Dk the kernel takes (its state rows live in registers); Dv is tiled and has no limit.
MAX_DK = 256
#: Accepted dtypes of the pool (the kernel takes float32; float64 runs the torch path).
STATE_DTYPES = (torch.float32, torch.float64)
#: Accepted dtypes of ``state_indices``.
INDEX_DTYPES = (torch.int32, torch.int64)

_KMAX = (32, 64, 128, 256)   # state rows a CTA holds (template KMAX): the next one >= Dk
_THREADS = 128               # threads per CTA (rtk_decode_step's NT)
_COLUMN_THREADS = 8          # threads along a state row (CT): a CTA holds 8 * VEC value columns
_INDEX_MODES = {None: 0, torch.int32: 1, torch.int64: 2}

#: The step as one ``torch.library`` op, set by :mod:`rtkernels.decode_op` (which imports this
#: module): taken while torch.compile / torch.export trace the step (and for torch.func transforms,
#: which it refuses); NotImplemented from inside the op, whose kernel is the eager step.
op_call: Optional[Callable[..., Any]] = None


def name_expression(dtype_code_: int, kmax: int, vec: int) -> str:
    """The template instance of ``rtk_decode_step`` for element type code, state rows, vector width."""
    return f"rtk_decode_step<{dtype_code_}, {kmax}, {vec}>"


def instances() -> dict[str, list[str]]:
    """Every template instance :func:`decode` can ask for, by source (the CI compile test)."""
    return {SOURCE: [name_expression(code, kmax, vec) for code in sorted(KERNEL_DTYPES.values())
                     for kmax in _KMAX for vec in (1, 4)]}


def kernel_takes(q: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether a step with these ``[B, H, T, Dk]`` inputs and this pool runs the CUDA kernel."""
    return (q.dtype in KERNEL_DTYPES and state.dtype == torch.float32 and q.shape[3] <= MAX_DK
            and state.stride(3) == 1 and kernels_available(q.device))


def _check_pool(state: Any, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s, _ = _to_torch(state, "state")
    _check_storage(s, "state")
    _, h, _, dk = q.shape
    dv = v.shape[3]
    if s.dim() != 4 or tuple(s.shape[1:]) != (h, dk, dv):
        raise ValueError(f"state must be a pool of shape [S, H, Dk, Dv] = [S, {h}, {dk}, {dv}], "
                         f"got {tuple(s.shape)}")
    if s.dtype not in STATE_DTYPES:
        raise TypeError(f"state must be float32 (or float64), got {_fmt_dtype(s.dtype)}")
    if s.device != q.device:
        raise ValueError(f"state must be on the device of q ({q.device}), got {s.device}")
    return s


def _check_indices(indices: Any, b: int, slots: int, device: torch.device, values: bool = True
                   ) -> Optional[torch.Tensor]:
    """The ``[B]`` slot indices (None: row b), checked. Indices on the CPU are also range-checked
    and checked for repeats (unless ``values`` is False: the op's fake implementation has no
    values); on a GPU that would cost a sync, so the kernel skips rows outside the pool instead
    (see :func:`decode`)."""
    if indices is None:
        if slots < b:
            raise ValueError(f"state must have at least B = {b} rows when state_indices is None "
                             f"(sequence b uses row b), got S = {slots}")
        return None
    if isinstance(indices, bool) or not (isinstance(indices, torch.Tensor)
                                         or hasattr(indices, "__cuda_array_interface__")):
        raise TypeError(f"state_indices must be None or an int32 tensor of shape [B] = [{b}], "
                        f"got {type(indices).__name__}")
    t, _ = _to_torch(indices, "state_indices")
    _check_storage(t, "state_indices")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"state_indices must have dtype int32 (or int64), got {_fmt_dtype(t.dtype)}")
    if tuple(t.shape) != (b,):
        raise ValueError(f"state_indices must have shape [B] = [{b}], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"state_indices must be on the device of q ({device}), got {t.device}")
    if values and t.device.type == "cpu":  # known on the host: checked for free
        rows = [i for i in t.tolist() if i >= 0]
        if any(i >= slots for i in rows):
            raise ValueError(f"state_indices must be < S = {slots} (the rows of the pool) or negative "
                             f"(padding), got {max(rows)}")
        if len(set(rows)) != len(rows):
            raise ValueError("state_indices must name each row of the pool at most once, got "
                             f"{sorted(i for i in set(rows) if rows.count(i) > 1)} repeated")
    return t if t.stride(0) == 1 else t.contiguous()


def _refuse_grad(tensors: tuple[tuple[str, Any], ...]) -> None:
    """ValueError when grad mode is on and one of the tensors requires grad: a step overwrites its
    state and has no backward, and nothing is detached silently."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"decode has no gradient (it updates the state in place), but {name} requires "
                             f"grad; call it under torch.no_grad() or torch.inference_mode(), or train "
                             f"with causal_linear_attention")


def torch_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, state: torch.Tensor,
               indices: Optional[torch.Tensor], log_decay: LogDecay, scale: float) -> None:
    """The step in torch operations on ``[B, H, T, D]`` views: any device and dtype, computed in
    float64 when the inputs or the pool are float64, else in float32 (the scan method's token
    loop). Writes ``out`` (zeros for padded sequences) and the pool's rows, with no host sync:
    rows outside the pool are padding, and a padded sequence's write goes to a row that gets the
    same value anyway (the first valid sequence's, or row 0 unchanged), so every write to a row
    agrees and no data-dependent shape is needed."""
    b, slots = q.shape[0], state.shape[0]
    cdt = torch.float64 if torch.float64 in (q.dtype, state.dtype) else compute_dtype(q.dtype)
    if indices is None:
        rows, valid = None, None
        s0 = state.narrow(0, 0, b).to(cdt)
    else:
        rows = indices.to(torch.int64)
        valid = (rows >= 0) & (rows < slots)
        if slots == 0:  # nothing to read or write: every sequence is padding
            out.zero_()
            return
        s0 = state.index_select(0, torch.where(valid, rows, 0)).to(cdt)
    o, s1 = scan.torch_forward(q.to(cdt), k.to(cdt), v.to(cdt), log_decay.tensor(cdt), s0, True)
    o = o * scale
    if rows is None:
        out.copy_(o)
        state.narrow(0, 0, b).copy_(s1)
        return
    per_seq = valid.view(-1, 1, 1, 1)
    out.copy_(torch.where(per_seq, o, 0.0))
    first = valid.to(torch.uint8).argmax().view(1)  # the first valid sequence (0 when none is)
    some = valid.any()
    target = torch.where(valid, rows, torch.where(some, rows.index_select(0, first), 0))
    fill = torch.where(some, s1.index_select(0, first), state.narrow(0, 0, 1).to(cdt))
    state.index_put_((target,), torch.where(per_seq, s1, fill).to(state.dtype))


def _vector_width(v: torch.Tensor, state: torch.Tensor) -> int:
    """4 (16-byte state loads and stores) when every row of the pool is 16-byte aligned, else 1."""
    aligned = state.data_ptr() % 16 == 0 and all(s % 4 == 0 for s in state.stride()[:3])
    return 4 if aligned and v.shape[3] % 4 == 0 else 1


def _plan_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, state: torch.Tensor,
                 indices: Optional[torch.Tensor], decay_mode: int, scale: float) -> BoundLaunch:
    """``rtk_decode_step`` bound to everything but its seven pointers, for ``[B, H, T, D]`` views
    with unit last stride: call it with the pointers of q, k, v, out, the decay, the pool and the
    indices (0 for None) to launch on torch's current stream."""
    b, h, _, dk = q.shape
    vec = _vector_width(v, state)
    tiles = -(-v.shape[3] // (_COLUMN_THREADS * vec))
    dev = q.device.index
    fn = get_function(SOURCE, name_expression(dtype_code(q.dtype), next(c for c in _KMAX if c >= dk), vec), dev)
    index_mode = _INDEX_MODES[None if indices is None else indices.dtype]
    tail = (*fwd_tail(q, k, v, out, scale, decay_mode), state.shape[0], *state.stride()[:3], index_mode, tiles)
    return fn.bind((b * h * tiles, 1, 1), (_THREADS, 1, 1), 0, dev, 7, tail)


def _run_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, state: torch.Tensor,
                indices: Optional[torch.Tensor], log_decay: LogDecay, scale: float) -> Optional[Callable[..., None]]:
    """One launch of ``rtk_decode_step``; returns the launcher a repeated call of the same signature
    can reuse (:mod:`rtkernels.call_cache`), or None when q, k or v had to be copied to unit stride."""
    copied = unit_stride(q, k, v)
    decay_ptr, decay_mode = log_decay.kernel_arg()
    bound = _plan_kernel(*copied, out, state, indices, decay_mode, scale)
    bound(*(x.data_ptr() for x in copied), out.data_ptr(), decay_ptr, state.data_ptr(),
          0 if indices is None else indices.data_ptr())
    if any(c is not x for c, x in zip(copied, (q, k, v))):
        return None
    host_ptr = None if log_decay.raw is not None else decay_ptr

    def launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, state: torch.Tensor,
                 decay: Optional[torch.Tensor], indices: Optional[torch.Tensor], _hold: LogDecay = log_decay) -> None:
        # _hold keeps a host decay's float32 log tensor (host_ptr) alive with the launcher
        bound(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), host_ptr if decay is None else decay.data_ptr(),
              state.data_ptr(), 0 if indices is None else indices.data_ptr())

    return launcher


_Tensor = torch.Tensor


def _signature(q: Any, k: Any, v: Any, state: Any, decay: Any, decay_rate: Any, scale: Any, indices: Any,
               layout: Any) -> Optional[tuple]:
    """What a kernel step's checks and launch depend on, or None for a call the cache does not take
    (not all torch tensors on a GPU, tensors requiring grad in grad mode, a decay the cache cannot
    key, indices on the CPU, whose values are checked, or not contiguous)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor or type(state) is not _Tensor:
        return None
    if not q.is_cuda or (type(scale) is not float and type(scale) is not int) or type(layout) is not str:
        return None
    grad = torch.is_grad_enabled()
    if grad and (q.requires_grad or k.requires_grad or v.requires_grad or state.requires_grad):
        return None
    dk, dr = decay_key(decay, grad), decay_key(decay_rate, grad)
    if dk is NO_KEY or dr is NO_KEY:
        return None
    if indices is None:
        ik = None
    elif type(indices) is _Tensor and indices.is_cuda and indices.stride() == (1,):
        ik = (indices.dtype, indices.shape, indices.get_device())
    else:
        return None
    return ("decode", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), state.shape, state.stride(), state.dtype,
            state.get_device(), state.data_ptr() & 15, ik, dk, dr, type(scale), scale, layout)


def decode(q: Array, k: Array, v: Array, state: Array, decay: Union[None, float, Array] = None, *,
           decay_rate: Union[None, float, Array] = None, scale: float = 1.0,
           state_indices: Optional[Array] = None, layout: str = "bhnd") -> Any:
    r"""One decode step: T new tokens per sequence against a pool of states, updated in place.

    For each sequence b with row ``i = state_indices[b]`` of the pool (``b`` without indices):

    .. math:: S \leftarrow \gamma_h S + k_t^\top v_t,\qquad o_t = \text{scale}\; q_t S
              \qquad (t = 0, \dots, T-1,\ S = \text{state}[i, h])

    and ``state[i]`` ends as the S after the last token: the same numbers as
    ``causal_linear_attention(q, k, v, decay, initial_state=state[i], return_state=True)``.

    Args:
        q, k: ``[B, H, T, Dk]`` (``layout="bhnd"``) or ``[B, T, H, Dk]`` (``layout="bnhd"``), T >= 1.
        v: ``[B, H, T, Dv]`` or ``[B, T, H, Dv]``. q, k and v share one dtype (float64, float32,
            float16, bfloat16) and one device; torch tensors or all CUDA arrays (CuPy).
        state: the pool ``[S, H, Dk, Dv]``, float32 (float64 runs the torch path), on the device of
            q. Updated in place; rows no sequence names are left alone.
        decay, decay_rate: per-head factors gamma in (0, 1] or rates r >= 0, exactly as in
            :func:`~rtkernels.causal_linear_attention` (floats and CPU tensors are checked on the
            host; a CUDA tensor is read where it is, and a value outside the domain makes that
            head's outputs and state NaN, unless :func:`~rtkernels.set_strict_decay` is on).
        scale: multiplies the output.
        state_indices: None (sequence b uses row b; needs S >= B), or an int32 (or int64) tensor
            ``[B]`` on the device of q. A negative index marks padding: that sequence's output
            rows are zeros and no state is read or written. Indices must be distinct among the
            non-negative ones and < S. On the CPU both are checked (``ValueError``); on a GPU
            checking would need a sync, so an index >= S is treated as padding, and a repeated
            index leaves that row undefined.
        layout: ``"bhnd"`` or ``"bnhd"``.

    Returns:
        The output ``[B, H, T, Dv]`` (or ``[B, T, H, Dv]``) in q's dtype, contiguous; zeros for
        padded sequences. CUDA arrays in give a CuPy array out.

    Complexity: O(B H T Dk Dv) work, the fp32 state of each sequence read and written once. On
    CUDA (fp32/fp16/bf16 inputs, a float32 pool with unit stride along Dv, Dk <= 256, CuPy
    present) one kernel launch on torch's current stream: no host sync, no copy, capturable in a
    CUDA graph; a repeated call of the same signature skips the checks (the call cache).
    Everything else runs :func:`torch_step`.

    Raises:
        TypeError / ValueError naming the argument for a malformed input; ValueError when grad
        mode is on and a tensor argument requires grad (the step has no backward). NaN is data: a
        NaN in q_t reaches o_t, one in k_t or v_t the state and every later output.
    """
    if (_is_compiling() or _func_active()) and op_call is not None:  # traced: one op that mutates the pool
        res = op_call(q, k, v, state, decay, decay_rate, scale, state_indices, layout)
        if res is not NotImplemented:
            return res
    key = _signature(q, k, v, state, decay, decay_rate, scale, state_indices, layout)
    if key is not None:
        hit = call_cache.lookup(key)
        if hit is not None:  # this signature passed every check and launched before: launch again
            out = torch.empty_like(v) if hit.like_v else torch.empty(hit.out_shape, dtype=hit.dtype, device=hit.device)
            device_decay = (decay if decay_rate is None else decay_rate) if hit.device_decay else None
            hit.launcher(q, k, v, out, state, device_decay, state_indices)
            return out
    qt, kt, vt, kind = _check_inputs(q, k, v, layout)
    scale = _check_scale(scale)
    b, h, t, _ = qt.shape
    pool = _check_pool(state, qt, vt)
    indices = _check_indices(state_indices, b, pool.shape[0], qt.device)
    _refuse_grad((("q", qt), ("k", kt), ("v", vt), ("state", pool), ("decay", decay), ("decay_rate", decay_rate)))
    log_decay = _log_decay(decay, decay_rate, h, qt.device)
    dv = vt.shape[3]
    if layout == "bhnd":
        out = out_view = torch.empty(b, h, t, dv, dtype=qt.dtype, device=qt.device)
    else:
        out = torch.empty(b, t, h, dv, dtype=qt.dtype, device=qt.device)
        out_view = out.transpose(1, 2)
    if out.numel() > 0:  # else there is nothing to compute and no token to add to any state
        if kernel_takes(qt, pool):
            launcher = _run_kernel(qt, kt, vt, out_view, pool, indices, log_decay, scale)
            if key is not None and launcher is not None:
                call_cache.remember(key, launcher, out, v, log_decay.raw is not None)
        else:
            torch_step(qt, kt, vt, out_view, pool, indices, log_decay, scale)
    return _results(out, None, False, kind)  # CuPy / PyCUDA arrays in give the same kind out
