"""Scratch: the compiled entry's autograd node, checked and timed on a CPU machine.

The compiled entry (``cuda_src/host/compiled_call.cpp``) serves CUDA calls only. This script builds
a copy of its source with two changes: CPU tensors count as CUDA ones, and ``run()`` allocates the
outputs without launching anything. Then it registers calls by hand, runs them, and checks what a
CPU can check:
- the gradients through the node equal the Python Function's bit for bit, with and without the
  state, the output's or the state's alone;
- an in-place change of a saved input raises autograd's version error;
- the host time of a call without and with autograd history (no launch; µs on this machine).

The forward outputs are uninitialised here; the backward does not read them.

    python bench/profiling/compiled_node_cpu.py
"""
import re
import tempfile
import timeit
from pathlib import Path

import torch
from torch.utils import cpp_extension

import rtkernels
from rtkernels import call_cache, compiled_call, decay
from rtkernels.autotune import answers
from rtkernels.decay import KIND_FACTOR, LogDecay
from rtkernels.jit.sources import source_dir
from rtkernels.methods.chunk import plan

src = (source_dir() / compiled_call.SOURCE).read_text()
patched = src.replace("return t.defined() && t.is_cuda() && t.has_storage();", "return t.defined() && t.has_storage();")
start = patched.index("bool run(const Entry& e, Operands& x) {")
end = patched.index("\n}\n", start) + 3
patched = patched[:start] + """bool run(const Entry& e, Operands& x) {  // CPU: allocate only
  const auto opts = at::TensorOptions().device(c10::kCPU);
  x.out = at::empty(e.out_shape, opts.dtype(e.out_dtype));
  if (e.need_state) x.final = at::empty(e.state_shape, opts.dtype(e.out_dtype));
  return true;
}
""" + patched[end:]
assert patched != src and "t.is_cuda()" not in patched
work = Path(tempfile.mkdtemp(prefix="rtk-node-cpu-"))
(work / "compiled_call_cpu.cpp").write_text(patched)
ext = cpp_extension.load("rtk_compiled_call", [str(work / "compiled_call_cpu.cpp")], build_directory=str(work),
                         extra_cflags=["-O2"], with_cuda=False)
n_init = int(re.search(r'TORCH_CHECK\(n == (\d+), "init:', src).group(1))
addresses = (1,) + (0,) * (n_init - 6)  # a launch address (never called: no launches), then any others
ext.init(*addresses, compiled_call.node_backward, answers, plan, decay, compiled_call.MISS)

torch.manual_seed(0)
B, H, N, D = 2, 3, 70, 16
q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64).requires_grad_() for _ in range(3))
s0 = torch.randn(B, H, D, D, dtype=torch.float64).requires_grad_()
gamma = torch.nn.Parameter(torch.tensor([0.9, 0.99, 0.5], dtype=torch.float64))
g, gs = torch.randn(B, H, N, D, dtype=torch.float64), torch.randn(B, H, D, D, dtype=torch.float64)


def register(args, with_state, host):
    grad = call_cache.GradCall("chunk", 1.0, False, with_state, "exact", host, KIND_FACTOR)
    spec = (0, tuple(v.shape), torch.empty(0, dtype=v.dtype), with_state, (B, H, D, D) if with_state else (),
            host is None, [], [], -1, None, compiled_call.NodeInfo(grad, None))
    assert ext.register(args, spec) is True


# a trainable decay tensor without a state; a host decay (float) with a state in and out
for with_state in (False, True):
    dec = 0.9 if with_state else gamma
    args = (q, k, v, dec, None, 1.0, "chunk", "bhnd", s0 if with_state else None, with_state, "exact")
    register(args, with_state, LogDecay.from_rate_or_factor(0.9, False, H, torch.device("cpu")) if with_state else None)
    inputs = [q, k, v, s0] if with_state else [q, k, v, gamma]
    for use in ("both", "out", "state") if with_state else ("out",):
        got = ext.call(*args)
        want = rtkernels.causal_linear_attention(*args[:4], method="chunk", initial_state=args[8],
                                                 return_state=with_state, fp32_precision="exact")
        pick = {"both": (0, 1), "out": (0,), "state": (1,)}[use]
        outs = lambda r: [r[i] for i in pick] if with_state else [r]  # noqa: E731
        grads = [(g, gs)[i] for i in pick] if with_state else [g]
        a = torch.autograd.grad(outs(got), inputs, grads, allow_unused=True)
        b = torch.autograd.grad(outs(want), inputs, grads, allow_unused=True)
        for name, x, y in zip(("dq", "dk", "dv", "ds0" if with_state else "ddecay"), a, b):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (with_state, use, name)
        print(f"state {with_state}, gradient through {use}: equal to the Python Function's "
              f"({type((got[0] if with_state else got).grad_fn).__name__})")

args = (q, k, v, gamma, None, 1.0, "chunk", "bhnd", None, False, "exact")
out = ext.call(*args)
with torch.no_grad():
    k.add_(0)  # bumps k's version
try:
    out.sum().backward()
    raise AssertionError("an in-place change of a saved input went unnoticed")
except RuntimeError as exc:
    assert "modified by an inplace operation" in str(exc)
    print("an in-place change of a saved input raises autograd's version error")

n = 20000
with torch.no_grad():
    plain = (q.detach(), k.detach(), v.detach(), gamma.detach(), None, 1.0, "chunk", "bhnd", None, False, "exact")
    assert ext.register(plain, (0, tuple(v.shape), torch.empty(0, dtype=v.dtype), False, (), True, [], [], -1, None,
                                None))
    t0 = min(timeit.repeat(lambda: ext.call(*plain), number=n, repeat=5)) / n * 1e6
q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
tracked = (q2, k2, v2, gamma, None, 1.0, "chunk", "bhnd", None, False, "exact")
register(tracked, False, None)
t1 = min(timeit.repeat(lambda: ext.call(*tracked), number=n, repeat=5)) / n * 1e6
print(f"host µs a call on this machine (CPU tensors, no launch): {t0:.2f} without autograd, {t1:.2f} with it")
