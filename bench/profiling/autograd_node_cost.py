"""Scratch: the host cost of an autograd node, a Python ``torch.autograd.Function`` (through
``apply``; the library's call skips its Python wrapper) against a C++ ``torch::autograd::Function``
compiled here by ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler and ninja). Each
node saves q, k, v and the decay and allocates its output, as the cached call's Function does;
none launches a kernel. µs per call, three rounds.

    python bench/profiling/autograd_node_cost.py [cuda|cpu]
"""
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r'''
#include <torch/extension.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
static py::object* backward_fn = new py::object();  // never freed: no decref after Python ends
struct Node : public torch::autograd::Function<Node> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor g) {
    ctx->save_for_backward({q, k, v, g});
    return at::empty_like(v);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    py::gil_scoped_acquire gil;  // the backward runs on autograd's device thread
    auto s = ctx->get_saved_variables();
    auto r = (*backward_fn)(s[0], s[1], s[2], s[3], grads[0]).cast<std::vector<torch::Tensor>>();
    return {r[0], r[1], r[2], r[3]};
  }
};
torch::Tensor apply(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g) {
  return Node::apply(q, k, v, g);
}
void set_backward(py::object f) { *backward_fn = f; }
'''


class Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g):
        ctx.save_for_backward(q, k, v, g)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad, None


def per_call_us(fn, n=20000):
    for _ in range(500):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
t0 = time.time()
ext = load_inline("rtk_autograd_node_cost", cpp_sources=[SOURCE], functions=["apply", "set_backward"],
                  extra_cflags=["-O2"])
print(f"compiled in {time.time() - t0:.1f} s")
ext.set_backward(lambda q, k, v, g, grad: [grad, grad, grad, torch.zeros_like(g)])
xs = [torch.randn(2, 3, 4, 5, device=dev, requires_grad=True) for _ in range(3)]
gp = torch.nn.Parameter(torch.rand(3, device=dev))
for _ in range(3):
    print(f"Function.apply {per_call_us(lambda: Bare.apply(*xs, gp)):.2f}  "
          f"C++ node {per_call_us(lambda: ext.apply(*xs, gp)):.2f}  "
          f"empty_like alone {per_call_us(lambda: torch.empty_like(xs[2])):.2f}")
out = ext.apply(*xs, gp)
out.sum().backward()
assert torch.equal(xs[0].grad, torch.ones_like(xs[0])), "the C++ node's backward reached the leaves"
