"""Generation with rtkernels: prefill a prompt, then decode token by token against a state pool.

    python examples/generate.py [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--new 32]

A toy one-layer "model" with random weights: the input x_t (H * D numbers per sequence) is
projected to q_t, k_t, v_t, the attention output o_t of the previous token is projected back to
become the next input. The prompt goes through ``causal_linear_attention(..., return_state=True)``
in one call, whose final states are stored in rows of a pool (as a serving engine keeps the states
of its live requests); each new token is one ``rtkernels.decode`` step, which reads and updates
those rows in place. At the end the whole sequence (prompt and generated inputs) is recomputed in
one ``causal_linear_attention`` call: its outputs at the generated positions and its final states
must equal what the decode steps gave.
"""

from __future__ import annotations

import argparse
import math

import torch

import rtkernels


class ToyLayer:
    """q, k, v = x W_q, x W_k, x W_v (per head), next input = tanh(o W_o): random, fixed weights."""

    def __init__(self, heads: int, dim: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        width = heads * dim
        self.heads, self.dim = heads, dim
        self.w = [(torch.randn(width, width, generator=g) / math.sqrt(width)).to(device, dtype) for _ in range(4)]
        # per-head decay factors between 0.9 and 0.999, a float32 tensor on the model's device
        self.gamma = (1 - torch.logspace(-1, -3, heads)).to(device, torch.float32)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H*D] -> q, k, v [B, T, H, D] (layout "bnhd": no transposes)."""
        b, t, _ = x.shape
        q, k, v = (x @ w for w in self.w[:3])
        return tuple(x.view(b, t, self.heads, self.dim) for x in (q, k, v))

    def next_input(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, 1, H, D] -> x [B, 1, H*D]."""
        return torch.tanh(o.flatten(2) @ self.w[3])

    def attention(self, x: torch.Tensor, **kwargs):
        q, k, v = self.qkv(x)
        return rtkernels.causal_linear_attention(q, k, v, self.gamma, scale=self.dim ** -0.5, layout="bnhd", **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=50)
    ap.add_argument("--new", type=int, default=32, help="tokens to generate")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    b, h, d = args.batch, args.heads, args.dim
    model = ToyLayer(h, d, device, dtype)

    with torch.inference_mode():
        # The pool holds more rows than live sequences; sequence i lives in row slots[i].
        pool = torch.zeros(2 * b, h, d, d, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                           device=device)
        slots = torch.randperm(2 * b, generator=torch.Generator().manual_seed(1))[:b].to(device, torch.int32)

        prompt = torch.randn(b, args.prompt, h * d, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        out, states = model.attention(prompt, return_state=True)
        pool[slots.long()] = states.to(pool.dtype)

        inputs, outputs = [prompt], []
        x = model.next_input(out[:, -1:])
        for _ in range(args.new):
            inputs.append(x)
            q, k, v = model.qkv(x)
            o = rtkernels.decode(q, k, v, pool, model.gamma, scale=d ** -0.5, state_indices=slots, layout="bnhd")
            outputs.append(o)
            x = model.next_input(o)

        # Check: the whole sequence at once gives the same outputs and the same final states.
        whole, final = model.attention(torch.cat(inputs, dim=1), return_state=True)
        generated = torch.cat(outputs, dim=1)
        expected = whole[:, args.prompt:]
        err = ((generated.double() - expected.double()).norm() / expected.double().norm()).item()
        state_err = ((pool[slots.long()].double() - final.double()).norm() / final.double().norm()).item()
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    print(f"{args.new} tokens on {device} ({args.dtype}), B={b} H={h} D={d}: decode steps vs one call over the "
          f"whole sequence: output rel err {err:.2e}, state rel err {state_err:.2e} (tolerance {tol:g})")
    if not (err <= tol and state_err <= tol):
        raise SystemExit("decode steps differ from the whole-sequence computation")


if __name__ == "__main__":
    main()
