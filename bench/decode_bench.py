"""Decode-step timings on a GPU: ``rtkernels.decode`` against fla's ``fused_recurrent_simple_gla``.

    python bench/decode_bench.py [--json PATH] [--short-n]

Rows: B in {1, 64, 256}, T in {1, 4} new tokens per sequence, H = 32, Dk = Dv = 128, bf16 q, k, v,
an fp32 state per sequence, the decay a float32 [H] tensor on the GPU (where a model keeps it).
rtkernels runs ``decode`` on a pool of B rows with permuted int32 slot indices; for reference also
the call it replaces (``causal_linear_attention(..., method="scan", initial_state=s,
return_state=True)``, a new state per step) and fla (same inputs in its [B, T, H, D] layout, when
``fla`` imports: ``source bench/setup_peers.sh`` on the GPU machine).

Columns:
  * ``ms``: device time of one step with a cold L2 (a 256 MiB buffer is rewritten before each
    step; CUDA events around the step alone), median of 50;
  * ``% copy``: (fp32 state read + written = B H Dk Dv 8 bytes) / ms / the copy bandwidth measured
    in the same run (a 1 GiB device-to-device copy, bytes read + written);
  * ``wall us``: wall time per step of a loop of 200 eager steps (the Python call included, warm
    L2, no flush), after a synchronize: what a generation loop pays when the host is the limit;
  * ``rel err``: the output against an fp64 token loop.
``--short-n`` adds the table behind ``auto``'s rule for short sequences: ``causal_linear_attention``
with an initial state over N tokens, methods scan and chunk, N from 1 to 256.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Optional

import torch

import rtkernels

H, D = 32, 128
BATCHES = (1, 64, 256)
TOKENS = (1, 4)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting the bytes read and written."""
    src = torch.empty(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 4 / (start.elapsed_time(end) / 1e3)


_flush_buf: Optional[torch.Tensor] = None


def cold_ms(fn: Callable[[], Any], reps: int = 50) -> float:
    """Median device time of ``fn`` with the L2 rewritten before each call (events around ``fn`` only)."""
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(1 << 26, device="cuda")
    times = []
    for _ in range(reps):
        _flush_buf.add_(1.0)  # also gives the host time to enqueue fn before the GPU reaches it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def wall_us(fn: Callable[[], Any], reps: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def fp64_step(q, k, v, states, gamma):
    """(output [B, H, T, D], final states) of T steps from ``states`` [B, H, D, D], in float64
    (a plain token loop)."""
    s = states.double()
    g = gamma.double().view(-1, 1, 1)
    outs = []
    for t in range(q.shape[2]):
        s = g * s + k[:, :, t, :, None].double() * v[:, :, t, None, :].double()
        outs.append(q[:, :, t, None, :].double() @ s)
    return torch.cat(outs, dim=2), s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def load_fla():
    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except Exception as exc:  # not installed, or its Triton kernels do not load here
        return None, f"fla not importable: {type(exc).__name__}: {exc}"[:200]
    return fused_recurrent_simple_gla, "fla loaded"


def decode_rows(bw: float, only: str = "", tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    fla, fla_note = load_fla() if only in "fla fused_recurrent_simple_gla" else (None, "fla not asked for")
    print(fla_note)
    rows = []
    gamma = 1 - torch.logspace(-5, -1, H, device="cuda")  # float32 [H] on the GPU
    lg = torch.log(gamma)
    for b in BATCHES:
        for t in tokens:
            g = torch.Generator(device="cuda").manual_seed(b * 10 + t)
            q, k = ((torch.randn(b, H, t, D, generator=g, device="cuda") / D ** 0.5).bfloat16() for _ in range(2))
            v = torch.randn(b, H, t, D, generator=g, device="cuda").bfloat16()
            states = torch.randn(b, H, D, D, generator=g, device="cuda") / D ** 0.5
            idx = torch.randperm(b, generator=torch.Generator().manual_seed(b)).to(torch.int32).cuda()
            pool = torch.empty_like(states)
            pool[idx.long()] = states
            ref, ref_states = fp64_step(q, k, v, states, gamma)
            byte_count = b * H * D * D * 4 * 2
            start = pool.clone()
            impls: dict[str, Callable[[], Any]] = {
                "rtkernels decode": lambda: rtkernels.decode(q, k, v, pool, gamma, state_indices=idx),
                "rtkernels scan (initial_state)": lambda: rtkernels.causal_linear_attention(
                    q, k, v, gamma, method="scan", initial_state=states, return_state=True)[0],
            }
            if fla is not None:
                qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                impls["fla fused_recurrent_simple_gla"] = lambda: fla(
                    qf, kf, vf, g_gamma=lg, scale=1.0, initial_state=states, output_final_state=True)[0].transpose(1, 2)
            for name, fn in impls.items():
                if only not in name:
                    continue
                pool.copy_(start)
                out = fn()
                err = rel_err(out, ref)  # sequence b's state is pool[idx[b]] = states[b]
                if name == "rtkernels decode":  # the error of the updated rows counts too
                    err = max(err, rel_err(pool[idx.long()], ref_states))
                ms = cold_ms(fn)
                row = {"impl": name, "B": b, "T": t, "ms": ms, "pct_copy": 100 * byte_count / (ms / 1e3) / bw,
                       "wall_us": wall_us(fn), "rel_err": err}
                rows.append(row)
                print(f"| {name} | {b} | {t} | {ms:.4f} | {row['pct_copy']:.1f} | {row['wall_us']:.1f} | {err:.1e} |",
                      flush=True)
    return rows


def short_n_rows() -> list[dict]:
    """causal_linear_attention from an initial state over N tokens: scan against chunk (B = 64)."""
    rows = []
    gamma = 1 - torch.logspace(-5, -1, H, device="cuda")
    for b in (4, 64):
        for n in (1, 2, 3, 4, 6, 8, 16, 64, 256):
            q, k, v = (torch.randn(b, H, n, D, device="cuda").bfloat16() for _ in range(3))
            s = torch.randn(b, H, D, D, device="cuda")
            times = {}
            for method in ("scan", "chunk"):
                fn = lambda: rtkernels.causal_linear_attention(q, k, v, gamma, method=method, initial_state=s,
                                                               return_state=True)
                fn()
                times[method] = cold_ms(fn)
            rows.append({"B": b, "N": n, **{f"{m}_ms": x for m, x in times.items()}})
            print(f"| {b} | {n} | {times['scan']:.4f} | {times['chunk']:.4f} | "
                  f"{'scan' if times['scan'] < times['chunk'] else 'chunk'} |", flush=True)
    return rows


def host_rows() -> dict[str, float]:
    """Host microseconds per call of ``decode`` at B = 1, T = 1 and of its pieces (no sync; the
    kernel runs behind), the decay a CUDA tensor and int32 indices on the GPU."""
    import importlib

    from rtkernels import api

    mod = importlib.import_module("rtkernels.decode")
    q, k, v = (torch.randn(1, H, 1, D, device="cuda").bfloat16() for _ in range(3))
    pool = torch.zeros(4, H, D, D, device="cuda")
    idx = torch.tensor([2], dtype=torch.int32, device="cuda")
    gamma = 1 - torch.logspace(-5, -1, H, device="cuda")
    qt, kt, vt, _ = api._check_inputs(q, k, v, "bhnd")
    out = torch.empty(1, H, 1, D, dtype=q.dtype, device="cuda")
    lg = api._log_decay(gamma, None, H, q.device)
    launcher = mod._run_kernel(qt, kt, vt, out, pool, idx, lg, 1.0)
    pieces: dict[str, Callable[[], Any]] = {
        "decode, decay tensor": lambda: rtkernels.decode(q, k, v, pool, gamma, state_indices=idx),
        "decode, float decay": lambda: rtkernels.decode(q, k, v, pool, 0.9, state_indices=idx),
        "_check_inputs": lambda: api._check_inputs(q, k, v, "bhnd"),
        "_check_scale": lambda: api._check_scale(1.0),
        "_check_pool": lambda: mod._check_pool(pool, qt, vt),
        "_check_indices": lambda: mod._check_indices(idx, 1, 4, q.device),
        "_refuse_grad": lambda: mod._refuse_grad((("q", qt), ("k", kt), ("v", vt), ("state", pool), ("decay", gamma),
                                                  ("decay_rate", None))),
        "_log_decay": lambda: api._log_decay(gamma, None, H, q.device),
        "torch.empty": lambda: torch.empty(1, H, 1, D, dtype=q.dtype, device="cuda"),
        "kernel_takes": lambda: mod.kernel_takes(qt, pool),
        "_run_kernel (plan and launch)": lambda: mod._run_kernel(qt, kt, vt, out, pool, idx, lg, 1.0),
        "_signature": lambda: mod._signature(q, k, v, pool, gamma, None, 1.0, idx, "bhnd"),
        "cached launcher": lambda: launcher(q, k, v, out, pool, gamma, idx),
    }
    res = {}
    for name, fn in pieces.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        res[name] = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        print(f"| {name} | {res[name]:.2f} |", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--short-n", action="store_true", help="add the scan-vs-chunk table behind auto's short-N rule")
    ap.add_argument("--host", action="store_true", help="add the host microseconds of a B = 1 step and its pieces")
    ap.add_argument("--impl", default="", help="only the implementations whose name contains this")
    ap.add_argument("--tokens", default="1,4", help="tokens per step, comma-separated (default 1,4)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_bench needs a CUDA GPU")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| impl | B | T | ms | % copy | wall us | rel err |\n|---|---:|---:|---:|---:|---:|---:|")
    tokens = tuple(int(t) for t in args.tokens.split(","))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_bw": bw,
                              "decode": decode_rows(bw, args.impl, tokens)}
    if args.host:
        print("\n| host, B = 1, T = 1 | us per call |\n|---|---:|")
        result["host"] = host_rows()
    if args.short_n:
        print("\n| B | N | scan ms | chunk ms | faster |\n|---:|---:|---:|---:|---|")
        result["short_n"] = short_n_rows()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
