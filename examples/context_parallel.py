"""Context parallel with torchrun: one sequence split across the ranks, checked and timed.

    torchrun --nproc_per_node=2 examples/context_parallel.py [--tokens N] [--heads H] [--dim D]
        [--batch B] [--dtype bfloat16|float16|float32|float64] [--reps R] [--check] [--single]
        [--train-decay] [--state-loss]

On GPUs every rank takes the GPU of its LOCAL_RANK and the group uses NCCL; without a GPU the
ranks run on the CPU over gloo. The sequence of N tokens is cut into one contiguous piece per
rank (the last takes the remainder); each rank draws only its own piece (seeded per piece, so
any rank can draw any piece) and calls ``rtkernels.distributed.context_parallel_attention`` on it
with RetNet's per-head decays and ``return_state=True``.

Printed by rank 0: the forward and forward + backward times (median over the repetitions, the
slowest rank's) and on GPUs each rank's peak memory during forward + backward. The timed loss is
the output's (what a model trains with); ``--state-loss`` adds the final state's, whose gradient
then flows back through the exchange.

``--single`` also times the single-device call on the whole sequence (every rank runs it on its
own device at the same time, so each number is one device's) and prints the speedup; the whole
sequence and its gradients must fit one device. ``--check`` compares every rank's output, the
final state and the gradients of q, k, v (and of the decay with ``--train-decay``) with that
single-device call and exits with status 1 when a relative error exceeds the dtype's tolerance;
it always takes the loss on both the output and the final state.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import rtkernels
from rtkernels.distributed import context_parallel_attention

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
#: Relative Frobenius error allowed between the split and the single-device call (both round).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4, torch.float64: 1e-10}


def parse(argv: list[str], on_gpu: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=262144 if on_gpu else 8192, help="tokens of the whole sequence")
    p.add_argument("--heads", type=int, default=32 if on_gpu else 4)
    p.add_argument("--dim", type=int, default=128 if on_gpu else 64, help="Dk = Dv")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16" if on_gpu else "float32")
    p.add_argument("--reps", type=int, default=10 if on_gpu else 3)
    p.add_argument("--check", action="store_true", help="compare with the single-device call on the whole sequence")
    p.add_argument("--single", action="store_true", help="time the single-device call on the whole sequence too")
    p.add_argument("--train-decay", action="store_true", help="the decay tensor requires grad")
    p.add_argument("--state-loss", action="store_true", help="the timed loss uses the final state too")
    return p.parse_args(argv)


def draw_piece(r: int, b: int, h: int, n: int, d: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Piece r's q, k, v and output gradient, from a generator seeded by r (any rank can draw any piece)."""
    gen = torch.Generator().manual_seed(1000 + r)
    return {name: torch.randn(b, h, n, d, generator=gen).to(device, dtype) for name in ("q", "k", "v", "go")}


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up run, the slowest rank's."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(reps):
        sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (one row per rank)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300)) if b.numel() else 0.0


def main(argv: list[str]) -> int:
    on_gpu = torch.cuda.is_available()
    args = parse(argv, on_gpu)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return run(args, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    b, h, n, d, dtype = args.batch, args.heads, args.tokens, args.dim, DTYPES[args.dtype]
    base = n // world
    lengths = [base] * (world - 1) + [n - base * (world - 1)]
    mine = draw_piece(rank, b, h, lengths[rank], d, dtype, device)
    # RetNet's decays: gamma_h = 1 - exp(linspace(log(1/32), log(1/512), H)), a float32 tensor on the device
    gamma = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).to(device, torch.float32)
    decay = gamma.clone().requires_grad_(args.train_decay)
    scale = d ** -0.5
    q, k, v = (mine[x].requires_grad_() for x in "qkv")
    gs = torch.randn(b, h, d, d, generator=torch.Generator().manual_seed(7)).to(device) / world

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        return context_parallel_attention(q, k, v, decay, scale=scale, return_state=True, lengths=lengths)

    def train_step(state_loss: bool = args.state_loss) -> tuple:
        out, state = forward()
        wrt = (q, k, v, decay) if args.train_decay else (q, k, v)
        loss = (out * mine["go"]).sum() + ((state * gs).sum() if state_loss else 0)
        return (out, state) + torch.autograd.grad(loss, wrt)

    if rank == 0:
        print(f"context parallel over {world} ranks ({device.type}, {dist.get_backend()}): B={b} H={h} N={n} "
              f"(pieces {lengths}) D={d} {args.dtype}, decay {'trained' if args.train_decay else 'fixed'}, "
              f"loss on the output{' and the final state' if args.state_loss else ''}")
    with torch.no_grad():
        fwd_ms = timed(forward, args.reps, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = timed(train_step, args.reps, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    peaks = gather_floats([peak], device)
    if rank == 0:
        print(f"  split:  forward {fwd_ms:9.3f} ms   forward+backward {step_ms:9.3f} ms   peak MiB per rank "
              + ("n/a (CPU)" if device.type != "cuda" else " ".join(f"{p[0]:.0f}" for p in peaks)))

    status = 0
    if args.single or args.check:
        if device.type == "cuda":  # what this process holds already is not the single call's memory
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
        pieces = [mine if r == rank else draw_piece(r, b, h, lengths[r], d, dtype, device) for r in range(world)]
        whole = {x: torch.cat([p[x].detach() for p in pieces], dim=2) for x in ("q", "k", "v", "go")}
        del pieces
        wq, wk, wv = (whole[x].requires_grad_() for x in "qkv")
        wdecay = gamma.clone().requires_grad_(args.train_decay)

        def single_forward() -> tuple[torch.Tensor, torch.Tensor]:
            return rtkernels.causal_linear_attention(wq, wk, wv, wdecay, scale=scale, return_state=True)

        def single_step(state_loss: bool = args.state_loss) -> tuple:
            out, state = single_forward()
            wrt = (wq, wk, wv, wdecay) if args.train_decay else (wq, wk, wv)
            loss = (out * whole["go"]).sum() + ((state * gs * world).sum() if state_loss else 0)
            return (out, state) + torch.autograd.grad(loss, wrt)

        if args.single:
            with torch.no_grad():
                one_fwd = timed(single_forward, args.reps, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            one_step = timed(single_step, args.reps, device)
            one_peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" \
                else float("nan")
            if rank == 0:
                print(f"  single: forward {one_fwd:9.3f} ms   forward+backward {one_step:9.3f} ms   peak MiB "
                      + ("n/a (CPU)" if device.type != "cuda" else f"{one_peak:.0f}"))
                print(f"  speedup: forward {one_fwd / fwd_ms:.2f}x   forward+backward {one_step / step_ms:.2f}x"
                      + ("" if device.type != "cuda" else f"   peak memory {max(p[0] for p in peaks) / one_peak:.2f}x"
                         " of one device's"))
        if args.check:
            got = train_step(True)
            ref = single_step(True)
            start = sum(lengths[:rank])
            sl = slice(start, start + lengths[rank])
            names = ["output", "final state", "dq", "dk", "dv"] + (["d(decay)"] if args.train_decay else [])
            errs = [rel(got[0], ref[0][:, :, sl]), rel(got[1], ref[1])]
            errs += [rel(g, r[:, :, sl]) for g, r in zip(got[2:5], ref[2:5])]
            if args.train_decay:  # each rank holds its share of the decay gradient
                share = got[5].detach().clone()
                dist.all_reduce(share)
                errs.append(rel(share, ref[5]))
            worst = [max(col) for col in zip(*gather_floats(errs, device))]
            tol = TOLERANCE[dtype]
            bad = [nm for nm, e in zip(names, worst) if not e <= tol]
            if rank == 0:
                print("  check against the single-device call (relative Frobenius error, worst rank): "
                      + ", ".join(f"{nm} {e:.2e}" for nm, e in zip(names, worst))
                      + (f"  -> FAIL ({', '.join(bad)} > {tol:g})" if bad else f"  -> ok (<= {tol:g})"))
            status = 1 if bad else 0
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
