"""Packed variable-length batches on a GPU: ``cu_seqlens`` against one sequence of the same length,
and against fla's varlen ``chunk_simple_gla``.

    python bench/varlen_bench.py [--json PATH] [--seqs 16] [--tokens 65536] [--reps 20] [--trainable]

Rows (H = 32, Dk = Dv = 128, bf16, the decay a float32 [H] CUDA tensor): the packed call with S
random lengths summing to N (seeded; every length >= 1), the same N tokens as one sequence, and
fla with the same offsets when it imports (``source bench/setup_peers.sh`` on the GPU machine);
forward, and forward + backward (``out.backward(grad)``; with ``--trainable`` the decay is a leaf
that requires grad there, fla's ``g_gamma = log(gamma)`` likewise). Time: CUDA events around the call on an
idle GPU (the Python call included), median of ``--reps``; ``vs one`` is the packed call's time
over the single sequence's (the target is <= 1.15). ``rel err``: the packed output against each
sequence run alone through the non-packed call, relative Frobenius norm.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any, Callable

import torch

import rtkernels

H, D = 32, 128


def _lengths(seqs: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=g)[: seqs - 1].add(1).sort().values.tolist()
    edges = [0, *cuts, tokens]
    return [b - a for a, b in zip(edges, edges[1:])]


def _time(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trainable", action="store_true", help="fwd+bwd with the decay requiring grad")
    args = ap.parse_args()
    dev = torch.device("cuda")
    lens = _lengths(args.seqs, args.tokens, args.seed)
    n = args.tokens
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=dev)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    q, k = ((torch.randn(1, n, H, D, generator=g) / math.sqrt(D)).to(dev, torch.bfloat16) for _ in range(2))
    v = torch.randn(1, n, H, D, generator=g).to(dev, torch.bfloat16)
    gamma = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), H))).float().to(dev)
    grad = torch.randn(1, n, H, D, generator=g).to(dev, torch.bfloat16)

    # the decay each impl reads: a leaf requiring grad with --trainable (its gradient reset by each step)
    decay = gamma.clone().requires_grad_(args.trainable)

    def ours(packed: bool) -> Callable[..., torch.Tensor]:
        return lambda a, b, c: rtkernels.causal_linear_attention(a, b, c, decay, layout="bnhd",
                                                                cu_seqlens=cu if packed else None)

    impls: dict[str, Callable[..., torch.Tensor]] = {"rtkernels packed": ours(True), "rtkernels one sequence": ours(False)}
    try:
        from fla.ops.simple_gla import chunk_simple_gla

        g_gamma = torch.log(gamma).detach().requires_grad_(args.trainable)
        impls["fla packed"] = lambda a, b, c: chunk_simple_gla(a, b, c, g_gamma=g_gamma, scale=1.0, cu_seqlens=cu)[0]
        impls["fla one sequence"] = lambda a, b, c: chunk_simple_gla(a, b, c, g_gamma=g_gamma, scale=1.0)[0]
    except Exception as e:  # a peer that does not import is reported, not fatal
        print(f"fla: not importable ({type(e).__name__}: {e})")

    # correctness of the packed call: each sequence alone through the non-packed call
    with torch.no_grad():
        out = impls["rtkernels packed"](q, k, v)
    parts = [rtkernels.causal_linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], gamma, layout="bnhd")
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    want = torch.cat(parts, dim=1).double()
    err = ((out.double() - want).norm() / want.norm()).item()

    rows = []
    for name, fn in impls.items():
        with torch.no_grad():
            fwd = _time(lambda: fn(q, k, v), args.reps)
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

        def step() -> None:
            for x in (*leaves, decay, g_gamma if "fla" in name else decay):
                x.grad = None
            fn(*leaves).backward(grad)

        try:
            fwdbwd = _time(step, args.reps)
        except Exception as e:  # e.g. fla's gated backward on a Triton it does not support
            print(f"{name}: fwd+bwd failed ({type(e).__name__}: {str(e)[:200]})")
            fwdbwd = math.nan
        rows.append({"impl": name, "fwd_ms": fwd, "fwdbwd_ms": fwdbwd})
        print(f"{name}: fwd {fwd:.3f} ms, fwd+bwd {fwdbwd:.3f} ms", flush=True)
    one = {r["impl"].split()[0]: r for r in rows if r["impl"].endswith("one sequence")}
    print(f"varlen: {args.seqs} sequences, lengths {lens}, N = {n}, H = {H}, D = {D}, bf16, "
          f"decay {'trainable' if args.trainable else 'fixed'}, "
          f"{torch.cuda.get_device_name()}; packed vs separate calls rel err {err:.2e}")
    print("| impl | fwd ms | fwd vs one | fwd+bwd ms | fwd+bwd vs one |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        base = one.get(r["impl"].split()[0])
        ratio = (lambda key: f"{r[key] / base[key]:.2f}") if base else (lambda key: "—")
        print(f"| {r['impl']} | {r['fwd_ms']:.3f} | {ratio('fwd_ms')} | {r['fwdbwd_ms']:.3f} | {ratio('fwdbwd_ms')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lens, "rel_err": err, "rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
