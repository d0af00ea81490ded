"""A copy of the compiled entry (cuda_src/host/compiled_call.cpp) that runs on a CPU: CPU tensors
count as CUDA ones and ``run()`` allocates the outputs without launching anything. With it a CPU
machine checks the entry's autograd node (its gradients come from the Python Function's backward,
which does not read the forward's outputs) and times a call (bench/profiling/compiled_node_cpu.py)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from rtkernels import call_cache, compiled_call, decay
from rtkernels.autotune import answers
from rtkernels.decay import KIND_FACTOR
from rtkernels.jit.sources import source_dir
from rtkernels.methods.chunk import plan


def build_cpu_copy() -> Any:
    """The patched copy, built in a temporary directory and initialised (no launch function is ever
    called: its programs have no launches)."""
    from torch.utils import cpp_extension

    src = (source_dir() / compiled_call.SOURCE).read_text()
    cuda = "return t.defined() && t.is_cuda() && t.has_storage();"
    assert cuda in src, "compiled_call.cpp's cuda_tensor() changed: update tests/compiled_cpu_copy.py"
    patched = src.replace(cuda, "return t.defined() && t.has_storage();")
    start = patched.index("bool run(const Entry& e, Operands& x) {")
    end = patched.index("\n}\n", start) + 3
    # allocate() as the real run() does, on the CPU; the final state in the inputs' dtype (float64
    # here, as the gradients the tests compare)
    patched = patched[:start] + """bool run(const Entry& e, Operands& x) {  // CPU copy: allocate only
  allocate(e, x, at::TensorOptions().device(c10::kCPU));
  if (x.final.defined()) x.final = x.final.to(e.out_dtype);
  return true;
}
""" + patched[end:]
    # its own module name: the real entry may be loaded in the same process
    for a, b in (("PyInit_rtk_compiled_call(", "PyInit_rtk_compiled_call_cpu("),
                 ('"rtk_compiled_call",', '"rtk_compiled_call_cpu",')):
        assert patched.count(a) == 1, f"compiled_call.cpp's module definition changed: {a}"
        patched = patched.replace(a, b)
    work = Path(tempfile.mkdtemp(prefix="rtk-compiled-cpu-"))
    (work / "compiled_call_cpu.cpp").write_text(patched)
    ext = cpp_extension.load("rtk_compiled_call_cpu", [str(work / "compiled_call_cpu.cpp")],
                             build_directory=str(work), extra_cflags=["-O2"], with_cuda=False)
    init(ext, compiled_call.node_backward)
    return ext


def init(ext: Any, backward: Any) -> None:
    """(Re)initialise the copy with ``backward`` as its nodes' Python backward (it forgets every
    registered call)."""
    src = (source_dir() / compiled_call.SOURCE).read_text()
    n_init = int(re.search(r'TORCH_CHECK\(n == (\d+), "init:', src).group(1))
    addresses = (1,) + (0,) * (n_init - 6)  # a launch address, then any other driver addresses
    ext.init(*addresses, backward, answers, plan, decay, compiled_call.MISS)


def register(ext: Any, args: tuple, out_like: torch.Tensor, state_shape: tuple = (), host_decay: Any = None,
             grad: bool = True, temps: tuple = (), keep: int = -1) -> bool:
    """Register ``args`` (the 11 call arguments) with a program of no launches: an output like
    ``out_like``, a final state of ``state_shape`` when given, the decay tensor of ``args`` read
    where ``host_decay`` is None; with ``grad``, a node whose backward is the Python Function's.
    ``temps``: the temporaries' shapes; ``keep``: the one the node hands its backward, or -1."""
    info = None
    if grad:
        info = compiled_call.NodeInfo(call_cache.GradCall("chunk", float(args[5]), args[7] == "bnhd",
                                                          bool(state_shape), args[10], host_decay, KIND_FACTOR), None)
    spec = (0, tuple(out_like.shape), torch.empty(0, dtype=out_like.dtype), bool(state_shape), state_shape,
            host_decay is None and isinstance(args[3], torch.Tensor), list(temps), [], keep, None, info)
    return ext.register(args, spec)
