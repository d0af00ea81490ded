"""Scratch: where the first chunk call of a new process goes (warm CuPy disk cache), step by step."""
import time

t0 = time.perf_counter()
import torch  # noqa: E402
t1 = time.perf_counter()
torch.cuda.init()
x = torch.randn(1, 2, 256, 128, device="cuda").bfloat16()
torch.cuda.synchronize()
t2 = time.perf_counter()
import rtkernels  # noqa: E402
t3 = time.perf_counter()
import cupy  # noqa: E402
t4 = time.perf_counter()
cupy.cuda.runtime.getDeviceCount()
t5 = time.perf_counter()
from rtkernels.autotune import store_for_device  # noqa: E402
store_for_device(0)
t6 = time.perf_counter()
rtkernels.causal_linear_attention(x, x, x, 0.9, method="chunk")
torch.cuda.synchronize()
t7 = time.perf_counter()
rtkernels.causal_linear_attention(x, x, x, 0.9, method="chunk")
torch.cuda.synchronize()
t8 = time.perf_counter()
ms = lambda a, b: f"{(b - a) * 1e3:.1f} ms"
print("import torch", ms(t0, t1), "| cuda init", ms(t1, t2), "| import rtkernels", ms(t2, t3),
      "| import cupy", ms(t3, t4), "| getDeviceCount", ms(t4, t5), "| autotune store", ms(t5, t6),
      "| first call", ms(t6, t7), "| second call", ms(t7, t8))
from rtkernels.runtime import compile_log  # noqa: E402
print(compile_log())
