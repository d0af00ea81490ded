r"""The backward built from the forward: three passes of the ``chunk`` forward (its CUDA kernels on
fp16, bf16 and fp32 CUDA inputs), the dk and dv passes as one walk where the kernel's DUAL
instance runs them together; no backward kernel of its own.

Per batch and head, with ``g_i = dL/do_i``, ``G = dL/dS_N`` (the gradient of the returned final
state; absent when it is not returned or not used), ``S_i = gamma^(i+1) S_0 + sum_{j<=i}
gamma^(i-j) k_j^T v_j``, ``o_i = scale q_i S_i`` and ``S_N = S_{N-1}``, write the forward operator
and the same operator on the reversed sequence (token N-1 first, its output written back in
reverse order) as

    F(a, b, c, X)_i = scale (gamma^(i+1) a_i X + sum_{j<=i} gamma^(i-j) (a_i . b_j) c_j)
    R(a, b, c)_j    = scale sum_{i>=j} gamma^(i-j) (a_j . b_i) c_i,   final state sum_i gamma^i b_i^T c_i

(the reversed pass's final state: token i sits at reversed position N-1-i, N-1-(N-1-i) = i steps
from the end). Differentiating ``L = sum_i g_i . o_i + <G, S_N>``::

    dq_i = scale g_i S_i^T
         = scale (gamma^(i+1) g_i S_0^T + sum_{j<=i} gamma^(i-j) (g_i . v_j) k_j)   = F(g, v, k, S_0^T)_i
    dk_j = scale sum_{i>=j} gamma^(i-j) (v_j . g_i) q_i + gamma^(N-1-j) v_j G^T      = R(v, g, q)_j + ...
    dv_j = scale sum_{i>=j} gamma^(i-j) (k_j . q_i) g_i + gamma^(N-1-j) k_j G        = R(k, q, g)_j + ...
    dS_0 = scale sum_i gamma^(i+1) q_i^T g_i + gamma^N G     = scale gamma (final state of R(k, q, g)) + gamma^N G

The G terms come free from the reversed passes: R's initial state X enters as scale gamma^(N-j)
x_j X, so ``X = G / (scale gamma)`` (per head) gives gamma^(N-1-j) v_j G^T in dk, gamma^(N-1-j) k_j G
in dv, and gamma^N G in dS_0 through R's final state, with no pass over the sequence of their own
(before, they were batched products in torch operations: at (1, 32, 262144, 128) bf16 they took
more time than the three passes). Where that quotient is unsafe it is not formed:
|scale| < :data:`STATE_GRAD_MIN_SCALE` (0 included) keeps the torch products, and a head whose
gamma is below the compute dtype's eps^2 (:func:`grad_state_entry`) takes its G terms on the last
token only, the only token where they are not below eps^2 of that token's. dlog(gamma), for a
trainable decay, is summed by the dq pass itself where that pass runs the wgmma kernel in 16 bits
(:func:`rtkernels.methods.chunk.decay_grad.dq_pass_sums`; the same sum, no second walk over the
sequence), else it is one more kernel where the passes run the chunk kernel:
:func:`rtkernels.methods.chunk.decay_grad.kernel_log_decay_grad`, which carries W = dS/dlog(gamma)
forward with the state, chunk by chunk, and sums non-negative-weight terms only (its module
docstring has the math): ``cuda_src/chunk/decay_grad.cu`` on 16-bit operands,
``cuda_src/chunk/decay_grad_f32.cu`` on float32 ones in the forward's ``fp32_precision`` mode (on
Hopper, "tf32" with aligned rows and Dk <= 128: ``cuda_src/chunk/decay_grad_tf32.cu``, wgmma).
Elsewhere, the chunked four-term formula of :func:`rtkernels.autograd.log_decay_grad` in torch
operations, shared with the torch backward. (The
identity dlog(gamma) = sum_i i q_i . dq_i - sum_j j k_j . dk_j + ... is exact but subtracts two
large sums of rounded 16-bit gradients: catastrophic cancellation.)

The dk and dv passes read the same reversed sequence and their states are transposes (sum g^T q
and sum q^T g, same weights), so on Hopper, for 16-bit rows that are 16-byte aligned with Dk, Dv
<= 128, one walk of R(k, q, g) also writes R(v, g, q) from v as a fourth tile, reading q, k, v
and g once (:func:`.plan.fuses_dk_dv` decides; ``cuda_src/chunk/fwd16.cu``, DUAL).

The reversed passes cost no copy on the kernel path: :func:`rtkernels.methods.chunk.kernel_forward`
with ``reverse=True`` hands the kernel the pointers of row N-1 and negated token strides. Where
the kernel does not run (the CPU, fp64, Dk > 256 or Dv > 512), :func:`forward_pass` runs the torch
``chunk`` path on flipped copies, so the same decomposition is what the CPU tests check in fp64.

Precision (kernel path): every pass is the forward kernel. fp32 inputs: the fp32 kernel in the
forward's ``fp32_precision`` mode (3xTF32 "exact": fp32 accuracy; "tf32": about 1e-3), gradients in
fp32; dlog(gamma) by the float32 kernel in the same mode. 16-bit inputs: 16-bit operands (g included), fp32
accumulation and state, outputs rounded to the input dtype; in fp16 the products g_i . v_j (the
scores of the dq pass) are rounded to fp16 as the forward's q . k are, so a very large incoming
gradient (loss scaling near fp16's range) can overflow there. dq, dk, dv come back in the input
dtype (:class:`~rtkernels.autograd.Grads` allows it): the Function rounds gradients to the input
dtype anyway, and fp32 copies would triple the backward's memory; the G terms come with the
reversed passes' other state terms (G / (scale gamma) in their fp32 state, its 16-bit copy in the
products), or, where torch adds them, in fp32 rounded once into the gradients. dS_0 and dlog(gamma) are fp32; the dlog(gamma) kernel takes the 16-bit
inputs as they are, rounds each operand it weights by a power of gamma once to 16 bits, and
accumulates in fp32 (about the accuracy of the other gradients, far better where its terms do not
cancel).

Dv up to ``plan.MAX_VALUE_DIM`` (512) where Dk <= ``plan.MAX_DIM`` (256): the dq and dk passes
contract over Dv (their "keys" are v and g); the launch runs a contraction wider than the kernel
takes as pieces of key columns whose outputs add up (``launch.KeyPiecesLaunch``).

Work: three forward passes (the dk and dv passes' reads shared where they run as one walk), plus
O(Dk Dv) per (batch, head) for the G terms (O(N Dk Dv) where torch adds them), plus for a trainable decay the
dlog(gamma) kernel, O(N C (Dk + Dv) + N Dk Dv) (about one more forward pass; inside the dq pass,
about half of one). Memory: the three
gradients (each written in place by its pass), a ``[B, H, Dk, Dv]`` fp32 final state and
transposed S_0, G / (scale gamma) (where torch adds the G terms: token blocks, three fp32
``[B, H, N/8, D]`` temporaries at most),
and for a trainable decay a ``[B, Dv/BV, H]`` fp32 buffer of partial sums (where the torch formula
runs instead: its temporaries, at most :data:`~rtkernels.autograd.DECAY_GRAD_BYTES`). No
per-token state is ever formed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ...autograd import BACKWARD_IMPLS, Grads, log_decay_grad
from ...autotune.answers import plan_state
from ...decay import LogDecay
from ...jit import kernels_available
from ...jit.dtypes import compute_dtype
from .._torch_common import decay_powers, run_torch_path
from . import launch, plan
from .plan import current_overrides
from .decay_grad import PartialSums, dq_pass_sums, kernel_log_decay_grad, z_split_applies
from .torch_path import torch_forward

__all__ = ["KERNEL_DTYPES", "kernel_runs", "forward_pass", "gradient_passes", "kernel_backward", "clear_plans", "supports",
           "register", "grad_state_entry"]

#: The G terms are added over this many token blocks (bounding their fp32 temporaries), where they
#: are torch products (|scale| < :data:`STATE_GRAD_MIN_SCALE`).
STATE_TERM_BLOCKS = 8

#: Below this |scale| the final-state gradient's terms are torch products over the sequence rather
#: than the reversed passes' initial state G / (scale gamma) (which would overflow, or divide by 0).
STATE_GRAD_MIN_SCALE = 2.0 ** -20


#: The input dtypes this backward runs the chunk kernel for: the 16-bit kernel, and the float32
#: kernel in the forward's mode (3xTF32 "exact" or "tf32"), reversed passes included.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_runs(*tensors: torch.Tensor) -> bool:
    """Whether the ``chunk`` kernel takes these operands (q, v or q, k, v[, out]): CUDA tensors of
    one dtype of :data:`KERNEL_DTYPES` (fp16, bf16, fp32), q and k at most ``plan.MAX_DIM`` wide, v
    and out at most ``plan.MAX_VALUE_DIM``, a configuration for (Dk, Dv) = the widths of q and v
    (fp32: one that fits the shared memory), and CuPy with a driver."""
    x, v = tensors[0], tensors[2] if len(tensors) > 2 else tensors[-1]
    return (x.dtype in KERNEL_DTYPES and all(t.dtype == x.dtype for t in tensors) and x.is_cuda
            and plan.kernel_supports(x, v) and kernels_available(x.device))


def forward_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                 out: torch.Tensor, initial_state: Optional[torch.Tensor], need_state: bool,
                 reverse: bool, fp32_precision: str = "exact", on_kernel: Optional[bool] = None,
                 dlog: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 forward_states: Optional[tuple[torch.Tensor, tuple]] = None,
                 keep: Optional[list] = None,
                 dual: Optional[tuple[torch.Tensor, torch.Tensor]] = None, zsplit: bool = False
                 ) -> Optional[torch.Tensor]:
    """The forward operator into ``out`` (``[B, H, N, Dv]``), in token order or, with ``reverse``,
    on the reversed sequence with its output written back in reverse order (``initial_state``
    entering before token N-1, the final state, returned when ``need_state``, after token 0).

    The ``chunk`` kernel where it takes q, k, v and ``out`` (reversal by negated strides, no copy);
    otherwise the torch ``chunk`` path in the compute dtype on ``torch.flip``-ped copies.
    Work O(N C (Dk + Dv) + N Dk Dv). ``on_kernel``: :func:`kernel_runs` for these operands, if the
    caller knows it already. ``dlog``: (x, partial sums) for the dq pass that also sums dlog(gamma)
    (kernel only; :func:`.decay_grad.dq_pass_sums` decides). ``forward_states``, ``keep``: another
    pass's states-pass slots to fold, a list for this pass's (kernel only; :func:`.launch.launch_pass`).
    ``dual``: (x, out2), the dv pass that also writes dk (kernel only, where
    :func:`.plan.fuses_dk_dv` holds; :func:`.launch.kernel_forward`). ``zsplit``: dlog(gamma) by the Z
    split (kernel only; :func:`.launch.kernel_forward`)."""
    if kernel_runs(q, k, v, out) if on_kernel is None else on_kernel:
        return launch.kernel_forward(q, k, v, log_decay, scale, out, initial_state, need_state, fp32_precision,
                                     reverse=reverse, dlog=dlog, forward_states=forward_states, keep=keep,
                                     dual=dual, zsplit=zsplit)
    if not reverse:
        return run_torch_path(torch_forward, q, k, v, log_decay, scale, out, initial_state, need_state)
    flipped = torch.empty_like(out)
    state = run_torch_path(torch_forward, q.flip(2), k.flip(2), v.flip(2), log_decay, scale, flipped,
                           initial_state, need_state)
    out.copy_(flipped.flip(2))
    return state


def _gradient_buffer(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty gradient for ``x`` in ``dtype`` with the strides of ``x`` where they are dense with a
    unit last stride (so the gradient reaches a leaf in its layout without a copy), else contiguous."""
    buf = torch.empty_like(x, dtype=dtype)
    return buf if buf.stride(-1) == 1 else torch.empty(x.shape, dtype=dtype, device=x.device)


def _add_state_term(dst: torch.Tensor, x: torch.Tensor, m: torch.Tensor, lg: torch.Tensor) -> None:
    """``dst_j += gamma^(N-1-j) x_j m`` for every token j, in place (x: ``[B, H, N, Dx]``, m:
    ``[B, H, Dx, D]`` and ``lg`` in the compute dtype), computed in the compute dtype over
    :data:`STATE_TERM_BLOCKS` token blocks and rounded once into ``dst``. Work O(N Dx D)."""
    n = x.shape[2]
    step = -(-n // STATE_TERM_BLOCKS)
    to_end = decay_powers(lg, n).flip(-2)  # [H, N, 1]: gamma^(N-1-j)
    for a in range(0, n, step):
        rows = slice(a, a + step)
        dst[:, :, rows].add_(to_end[:, rows] * (x[:, :, rows].to(m.dtype) @ m))


def grad_state_entry(grad_state: Optional[torch.Tensor], lg: Optional[torch.Tensor], scale: float
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(X, far)``: the final-state gradient G as the reversed passes' initial state, ``X = G /
    (scale gamma)`` per head in the dtype of ``lg`` (``[H]`` log(gamma) in the compute dtype, given
    whenever G is), and ``far`` (bool ``[H]``): the heads whose gamma is below eps^2 of that dtype,
    whose X is 0 instead (their G terms before the last token are below eps^2 of the last token's,
    and the quotient could overflow). NaN in G or in gamma stays NaN. ``(None, None)`` where no G
    is given or |scale| < :data:`STATE_GRAD_MIN_SCALE` (the caller then adds the G terms by torch
    products)."""
    if grad_state is None or abs(scale) < STATE_GRAD_MIN_SCALE:
        return None, None
    gamma = torch.exp(lg)
    far = gamma < torch.finfo(lg.dtype).eps ** 2
    inv = torch.where(far, torch.zeros_like(gamma), 1.0 / (scale * gamma))
    return grad_state.to(lg.dtype) * inv.view(-1, 1, 1), far


def _add_last_token_terms(dk: torch.Tensor, dv: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g_state: torch.Tensor, far: torch.Tensor) -> None:
    """The G terms of token N-1 (weight gamma^0) for the ``far`` heads of :func:`grad_state_entry`:
    dk += v G^T and dv += k G there, in ``g_state``'s dtype, rounded once into dk and dv."""
    mask = far.view(-1, 1, 1)
    zero = torch.zeros((), dtype=g_state.dtype, device=g_state.device)
    dk[:, :, -1:].add_(torch.where(mask, v[:, :, -1:].to(g_state.dtype) @ g_state.transpose(-1, -2), zero))
    dv[:, :, -1:].add_(torch.where(mask, k[:, :, -1:].to(g_state.dtype) @ g_state, zero))


def gradient_passes(run: Callable[..., Optional[torch.Tensor]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    log_decay: LogDecay, scale: float, initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                    grad_state: Optional[torch.Tensor], need_state_grad: bool, dtype: torch.dtype,
                    dlog_partials: Optional[torch.Tensor] = None, dlog_g: Optional[torch.Tensor] = None,
                    forward_states: Optional[tuple[torch.Tensor, tuple]] = None,
                    fuse_dk_dv: Optional[bool] = False, sequences: int = 0,
                    state_grad_entry: Optional[torch.Tensor] = None, lg: Optional[torch.Tensor] = None,
                    dual_partials: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                               Optional[torch.Tensor]]:
    """The three passes of the module docstring, each ``run(q, k, v, log_decay, scale, out,
    initial_state, need_state, reverse)`` (a forward pass into ``out``; :func:`forward_pass` here,
    the packed one for ``cu_seqlens``): ``(dq, dk, dv, scale gamma R or None, log(gamma) or None)``,
    dq, dk, dv in ``dtype``, R the dv pass's final state (the start of dS_0, without the G term),
    log(gamma) in the compute dtype where the G terms or dS_0 need it. ``dlog_partials``: the dq
    pass also writes its partial sums of dlog(gamma) there (``run`` then takes ``dlog=(q, it,
    dlog_g)``), with the term of the final state's gradient ``dlog_g`` (fp32 contiguous) if given.
    ``forward_states``: the forward's states-pass slots, handed to the dq pass (``run`` then takes
    ``states=``), which folds them instead of running its own states pass where they match. The dk
    pass keeps its slots (``run`` takes ``keep=``, a list) and the dv pass folds them the same way:
    its states are their transposes (:func:`.launch.transposed_slots`). ``fuse_dk_dv``: whether the
    dk and dv passes run as one walk (``run`` takes ``dual=(v, dk)``): the dv pass R(k, q, g), whose
    state sum q^T g is the dk pass's transposed, also writing R(v, g, q) into dk. None: where
    :func:`.plan.fuses_dk_dv` holds for these buffers (the chunk kernel runs every pass; ``sequences``:
    the number of packed sequences of ``run``'s passes, 0 for none); True: the caller knows it holds
    (a planned backward repeating one that fused). ``state_grad_entry``: the reversed passes' initial
    state (the dv pass's; its transpose the dk pass's), :func:`grad_state_entry`'s X, or None; R's
    final state, and so dS_0, then holds the G term gamma^N G too. ``lg``: log(gamma) in the compute
    dtype where the caller has formed it (a device decay's costs several operations), else formed
    here where dS_0 or the G terms need it. ``dual_partials``: dlog(gamma) by the Z split
    (:func:`.decay_grad.z_split_sums`; the dk and dv passes fused, no initial state): the dq pass
    writes its partial sums into ``dlog_partials`` and the fused dk/dv pass its own into these
    (``run`` then takes ``zsplit=True`` for both)."""
    cdt = compute_dtype(q.dtype)
    # dk and dv are allocated after the dq pass is launched: the GPU waits for the first launch
    dq = _gradient_buffer(q, dtype)
    s0_t = None if initial_state is None else initial_state.transpose(-1, -2)
    extra = {} if forward_states is None else {"states": forward_states}
    z = {} if dual_partials is None else {"zsplit": True}
    if dlog_partials is None:
        run(grad_out, v, k, log_decay, scale, dq, s0_t, False, False, **extra)
    else:
        run(grad_out, v, k, log_decay, scale, dq, s0_t, False, False, dlog=(q, dlog_partials, dlog_g), **extra, **z)
    dk, dv = _gradient_buffer(k, dtype), _gradient_buffer(v, dtype)
    if fuse_dk_dv is None:
        fuse_dk_dv = plan.fuses_dk_dv(q, k, v, grad_out, dk, current_overrides(), sequences)
    entry = state_grad_entry
    if dual_partials is not None:
        back = run(k, q, grad_out, log_decay, scale, dv, entry, need_state_grad, True, dual=(v, dk),
                   dlog=(v, dual_partials, None), zsplit=True)
    elif fuse_dk_dv:
        back = run(k, q, grad_out, log_decay, scale, dv, entry, need_state_grad, True, dual=(v, dk))
    else:
        kept: list = []
        run(v, grad_out, q, log_decay, scale, dk, None if entry is None else entry.transpose(-1, -2), False, True,
            keep=kept)
        dk_states = {"states": kept[0]} if kept else {}  # slot 0: the dk pass's initial state, transposed back
        back = run(k, q, grad_out, log_decay, scale, dv, entry, need_state_grad, True, **dk_states)
    # log(gamma) in torch only where the state terms need it (a device decay costs several ops)
    if lg is None and (need_state_grad or grad_state is not None):
        lg = log_decay.tensor(cdt)
    d_s0 = back.to(cdt) * (scale * torch.exp(lg)).view(-1, 1, 1) if need_state_grad else None
    return dq, dk, dv, d_s0, lg


class _PlannedBackward(NamedTuple):
    """A backward repeated with new tensors (:func:`kernel_backward`'s plan): the launches of
    :func:`gradient_passes`' passes (three, or two with dk and dv fused), in its order, and where
    the dq pass sums dlog(gamma), its partial sums' buffer shape and sum launch (else None)."""

    passes: tuple[Callable[..., Optional[torch.Tensor]], ...]
    sums: Optional[PartialSums]

    @property
    def fused_dk_dv(self) -> bool:
        """Whether the dk and dv passes ran as one walk (two passes planned, not three)."""
        return len(self.passes) == 2

    def replay(self, decay: int) -> Callable[..., Optional[torch.Tensor]]:
        """A ``run`` for :func:`gradient_passes` that calls the planned launches in turn with the
        new tensors' pointers and the decay's address ``decay`` (the launches read only
        ``data_ptr()``; ``out``'s alignment never shaped them)."""
        passes = iter(self.passes)

        def run(q, k, v, log_decay_, scale, out, initial_state, need_state, reverse, dlog=None, states=None,
                keep=None, dual=None, zsplit=False):
            return launch.launch_pass(next(passes), q, k, v, out, initial_state, decay, dlog=dlog,
                                      forward_states=states, keep=keep, dual=dual)
        return run


#: Planned backwards by call signature (:func:`_plan_key`), for calls without an initial state or a
#: final-state gradient, whose passes all run the chunk kernel (dlog(gamma), if asked, in the dq pass).
_plans: dict[tuple, _PlannedBackward] = {}
_PLANS_MAX = 64


def clear_plans() -> None:
    """Forget the planned backwards (the next backward of each signature plans again)."""
    _plans.clear()


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, log_decay: LogDecay,
              scale: float, need_decay_grad: bool, fp32_precision: str) -> tuple:
    """What the passes' plans depend on (as :func:`.launch.pass_launcher`'s key, for all four operands)."""
    return (q.shape, v.shape, q.stride(), k.stride(), v.stride(), grad_out.stride(), q.dtype, k.dtype, v.dtype,
            grad_out.dtype, q.get_device(), (q.data_ptr() | k.data_ptr() | v.data_ptr() | grad_out.data_ptr()) & 15,
            log_decay.kernel_arg()[1], scale, need_decay_grad, fp32_precision, plan_state(), current_overrides())


def kernel_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: LogDecay, scale: float,
                    initial_state: Optional[torch.Tensor], grad_out: torch.Tensor,
                    grad_state: Optional[torch.Tensor], need_state_grad: bool, need_decay_grad: bool,
                    fp32_precision: str = "exact", forward_states: Optional[tuple[torch.Tensor, tuple]] = None
                    ) -> Grads:
    """A :data:`~rtkernels.autograd.BackwardImpl`: the three forward passes of the module
    docstring (float32: the kernel in ``fp32_precision``'s mode), the G terms and dlog(gamma) (its
    kernel, in the same mode, where the passes run the chunk kernel, else
    :func:`~rtkernels.autograd.log_decay_grad`). dq, dk, dv in the input dtype where the kernel
    runs, else in the compute dtype; dS_0 and dlog(gamma) in the compute dtype.

    A call without an initial state or a final-state gradient whose passes all run the kernel is
    planned once per signature (:func:`_plan_key`): repeating it costs the gradient buffers and the
    launches, about a third of the host time of planning each pass again. ``forward_states``: the
    slots the forward's states pass wrote (:class:`.launch.ChunkLaunch`'s ``keep``): the dq pass
    folds them, transposed, instead of running its own states pass where its split matches."""
    key = planned = None
    if initial_state is None and grad_state is None and not need_state_grad:
        key = _plan_key(q, k, v, grad_out, log_decay, scale, need_decay_grad, fp32_precision)
        planned = _plans.get(key)
    cdt = compute_dtype(q.dtype)
    n = q.shape[2]
    planning = None  # the launches of a call that is being planned
    if planned is not None:
        on_kernel, sums, run = True, planned.sums, planned.replay(log_decay.kernel_arg()[0])
        fuse_dk_dv = planned.fused_dk_dv
    else:
        on_kernel = kernel_runs(q, k, v, grad_out)
        fuse_dk_dv = None if on_kernel else False  # None: gradient_passes asks plan.fuses_dk_dv
        # dlog(gamma) inside the dq pass where it can (decay_grad's docstring), else its own kernel below
        fused = need_decay_grad and on_kernel and dq_pass_sums(q, k, v, grad_out, grad_state)
        # the Z split where it applies: no initial state, G (if any) on the reversed passes
        z_rows = (z_split_applies(q, k, v, grad_out) if fused and initial_state is None and k.is_contiguous()
                  and (grad_state is None or abs(scale) >= STATE_GRAD_MIN_SCALE) else None)
        sums = PartialSums(q, v, log_decay, dual_rows=z_rows) if fused else None
        if key is not None and on_kernel and (fused or not need_decay_grad) and all(
                x.stride(-1) == 1 for x in (q, k, v, grad_out)):  # every pass a kernel_forward launch
            planning = []

        def run(q_, k_, v_, log_decay_, scale_, out, initial_state_, need_state, reverse, dlog=None, states=None,
                keep=None, dual=None, zsplit=False):
            if planning is not None:  # the launch kernel_forward takes (unit strides: no copies)
                planning.append(launch.pass_launcher(q_, k_, v_, log_decay_, scale_, out, need_state, fp32_precision,
                                                     reverse=reverse, dlog=dlog is not None, dual=dual is not None,
                                                     zsplit=zsplit))
            return forward_pass(q_, k_, v_, log_decay_, scale_, out, initial_state_, need_state, reverse,
                                fp32_precision, on_kernel, dlog, states, keep, dual, zsplit)

    partials = None if sums is None else sums.buffer()
    dual_partials = None if sums is None or sums.dq_rows is None else partials[sums.dq_rows * sums.shape[2]:]
    g_fp32 = None if sums is None or grad_state is None else grad_state.to(torch.float32).contiguous()
    lg = None if grad_state is None else log_decay.tensor(cdt)  # formed once for the G terms and dS_0
    entry, far = grad_state_entry(grad_state, lg, scale)  # the G terms ride on the reversed passes
    dq, dk, dv, d_s0, lg = gradient_passes(run, q, k, v, log_decay, scale, initial_state, grad_out, grad_state,
                                           need_state_grad, q.dtype if on_kernel else cdt, partials, g_fp32,
                                           forward_states if on_kernel else None, fuse_dk_dv,
                                           state_grad_entry=entry, lg=lg, dual_partials=dual_partials)
    if grad_state is not None:
        g_state = grad_state.to(cdt)
        if entry is None:  # |scale| too small to divide by: torch products over the sequence
            _add_state_term(dk, v, g_state.transpose(-1, -2), lg)
            _add_state_term(dv, k, g_state, lg)
            if need_state_grad:
                d_s0 += torch.exp(lg * n).view(-1, 1, 1) * g_state
        else:
            _add_last_token_terms(dk, dv, k, v, g_state, far)
            if need_state_grad:
                d_s0 += torch.where(far, torch.exp(lg * n), 0.0).view(-1, 1, 1) * g_state
    d_log, of_source = None, False
    if sums is not None:
        d_log, of_source = sums.total(partials, log_decay.kernel_arg()[0]), True
    elif need_decay_grad:
        if on_kernel:  # its sum kernel applies the decay's chain rule too
            d_log, of_source = kernel_log_decay_grad(q, k, v, log_decay, scale, initial_state, grad_out, grad_state,
                                                     for_source=True, fp32_precision=fp32_precision), True
        else:
            d_log = log_decay_grad(q, k, v, log_decay, scale, initial_state, grad_out, grad_state)
    if planning is not None:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = _PlannedBackward(tuple(planning), sums)
    return Grads(dq, dk, dv, d_s0, d_log, of_source)


#: :func:`rtkernels.autograd.call_gradients` hands this backward the forward's states-pass slots.
kernel_backward.takes_forward_states = True  # type: ignore[attr-defined]


def supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Where :func:`kernel_backward` is registered to run: inputs the ``chunk`` kernel takes (CUDA,
    fp16/bf16/fp32, Dk <= 256 and Dv <= 512, CuPy present)."""
    return kernel_runs(q, v)


def register() -> None:
    """Put :func:`kernel_backward` in front of :data:`~rtkernels.autograd.BACKWARD_IMPLS` (once)."""
    if all(fn is not kernel_backward for _, fn in BACKWARD_IMPLS):
        BACKWARD_IMPLS.insert(0, (supports, kernel_backward))


register()
