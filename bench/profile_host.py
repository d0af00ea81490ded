"""Scratch: where the host time of one cached-kernel call goes (µs per call)."""
import math, time
import torch
import rtkernels
from rtkernels import api
from rtkernels.methods import chunk
from rtkernels.methods._launch import fwd_args, operands
from rtkernels.runtime import jit

def tm(fn, n=3000):
    for _ in range(200): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt

g = 1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), 32))
q, k, v = (torch.randn(1, 32, 64, 128, device="cuda").bfloat16() for _ in range(3))
out = torch.empty_like(v)
ld = api._log_decay(g, None, 32, q.device)
print("full call (decay CPU tensor)", tm(lambda: rtkernels.causal_linear_attention(q, k, v, g, method="chunk")))
print("full call (decay float)     ", tm(lambda: rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk")))
print("check_inputs                ", tm(lambda: api._check_inputs(q, k, v, "bhnd")))
print("log_decay                   ", tm(lambda: api._log_decay(g, None, 32, q.device)))
print("torch.empty                 ", tm(lambda: torch.empty(1, 32, 64, 128, dtype=torch.bfloat16, device="cuda")))
print("kernel_forward              ", tm(lambda: chunk.kernel_forward(q, k, v, ld, 1.0, out, None, False)))
name, bv, smem, threads, _ = chunk._launch_config(q.dtype, 128, 128, True, 32, 0)
fn = jit.get_function(chunk.SOURCE, name, 0, dynamic_smem=smem)
args = (*fwd_args(q, k, v, out, ld, None, None, 1.0), 64, 0)
print("fast launch path:", fn.fast)
print("fwd_args                    ", tm(lambda: fwd_args(q, k, v, out, ld, None, None, 1.0)))
print("operands                    ", tm(lambda: operands(q, k, v, None, False)))
print("cupy_stream                 ", tm(lambda: jit.cupy_stream(0)))
print("launch                      ", tm(lambda: jit.launch(fn, (32, 2, 1), (threads, 1, 1), args, 0, shared_mem=smem)))
s = jit.cupy_stream(0)
print("CuPy fn call                ", tm(lambda: fn.function((32, 2, 1), (threads, 1, 1), args, shared_mem=smem, stream=s)))
print("uses_kernel                 ", tm(lambda: rtkernels.METHODS["chunk"].uses_kernel(q, v)))
