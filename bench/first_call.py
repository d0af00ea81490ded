"""Scratch: where the first chunk call of a new process goes (warm kernel cache), step by step.
Run twice: the first run fills the cache."""
import time

T = [("start", time.perf_counter())]
mark = lambda name: T.append((name, time.perf_counter()))
import torch  # noqa: E402
mark("import torch")
x = torch.randn(1, 2, 256, 128, device="cuda").bfloat16()
torch.cuda.synchronize()
mark("cuda init")
import rtkernels  # noqa: E402
mark("import rtkernels")
from rtkernels.jit import jit, kernel_cache, load_source  # noqa: E402
from rtkernels.methods import chunk  # noqa: E402
jit.cupy_available()
mark("cupy_available")
from rtkernels.autotune import store_for_device  # noqa: E402
store_for_device(0)
mark("autotune store")
name, bv, nseg, smem, threads, opts = chunk._plan(torch.bfloat16, 128, 128, True, 2, 256, 0, ())
mark("plan")
arch, o = jit._target(0, opts)
key = kernel_cache.cache_key(load_source("chunk.cu"), name, ("-std=c++17", *o), arch)
mark("cache key")
cached = kernel_cache.load(key)
mark("cache read" + ("" if cached else " (miss)"))
if cached:
    fn = jit.Kernel.load(cached, 0, smem)
    mark("module load")
rtkernels.causal_linear_attention(x, x, x, 0.9, method="chunk")
torch.cuda.synchronize()
mark("first call")
rtkernels.causal_linear_attention(x, x, x, 0.9, method="chunk")
torch.cuda.synchronize()
mark("second call")
print(" | ".join(f"{n} {(t - T[i][1]) * 1e3:.1f} ms" for i, (n, t) in enumerate(T[1:])))
print("cupy imported:", "cupy" in __import__("sys").modules)
