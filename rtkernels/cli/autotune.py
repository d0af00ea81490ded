"""``rtkernels autotune``: tune ``method="auto"`` and every kernel's config for this GPU, per shape bucket."""

from __future__ import annotations

import argparse
import sys

from .common import PROG, require_gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..autotune.presets import PRESETS

    parser.add_argument("--preset", choices=list(PRESETS), default="standard",
                        help="named set of shapes and dtypes (default: standard, the forward shapes of docs/benchmark.md)")
    parser.add_argument("--shapes", nargs="+", metavar="SHAPE",
                        help="shapes of the preset by name (standard: small mid long d64 d256 retnet huge) or explicit "
                             "BxHxNxD / BxHxNxDkxDv (default: all of the preset)")
    parser.add_argument("--dtype", "--dtypes", dest="dtype", nargs="+", choices=("bf16", "fp16", "fp32"),
                        help="dtypes (default: those each preset shape lists; bf16 for explicit shapes)")
    parser.add_argument("--methods", nargs="+", metavar="METHOD",
                        help="methods to consider (default: all; auto picks the fastest)")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per candidate (default 15)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")


def parse_problems(args: argparse.Namespace) -> list:
    from ..autotune.presets import PRESETS, parse_shape
    from ..autotune.space import Problem

    preset = PRESETS[args.preset]
    out = []
    for name in args.shapes or list(preset):
        if name in preset:
            shape, dtypes = preset[name]
        else:
            shape, dtypes = parse_shape(name), ("bf16",)
        for dt in args.dtype or dtypes:
            if args.dtype is None or dt in args.dtype:
                out.append(Problem(*shape, dt))
    return out


class _Progress:
    """A one-line progress bar on stderr (a line per problem when stderr is not a terminal)."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = max(total, 1), 0, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = ""

    def step(self, trial) -> None:
        self.done += 1
        if self.tty:
            width = 30
            fill = int(width * self.done / self.total)
            text = f"{trial.candidate.label()}: {trial.status}" + (f" {trial.ms:.3f} ms" if trial.ms is not None else "")
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {self.label} "
                              f"{text[:60]:<60}")
            self.stream.flush()

    def problem(self, label: str) -> None:
        self.label = label
        if not self.tty:
            print(f"[{self.done}/{self.total}] {label}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def run(args: argparse.Namespace) -> int:
    status = require_gpu("autotune", "autotuning")
    if status is not None:
        return status
    import time

    from .. import METHODS
    from ..autotune import bucket, cuda, record, store_for_device

    try:
        problems = parse_problems(args)
    except ValueError as exc:
        print(f"{PROG} autotune: {exc}", file=sys.stderr)
        return 2
    bad = [m for m in args.methods or () if m not in METHODS]
    if bad:
        print(f"{PROG} autotune: unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}.",
              file=sys.stderr)
        return 2
    store = store_for_device(args.device)
    if store is None:
        print(f"{PROG} autotune: the results store could not be opened (see the warning above).", file=sys.stderr)
        return 1
    limits = cuda.device_limits(args.device)
    total = sum(len(cuda.candidates(p, limits, args.methods)) for p in problems)
    print(f"autotune: {len(problems)} problem(s), {total} candidates; results: {store.path}", flush=True)
    bar = _Progress(total)
    t0 = time.perf_counter()
    rows = []
    for p in problems:
        bar.problem(p.label())
        res = cuda.tune_problem(p, args.device, methods=args.methods, reps=args.reps, progress=bar.step)
        record(store, res)
        rows.append((p, bucket(p.dtype, p.bh, p.n, p.dk, p.dv), res))
    bar.close()
    elapsed = time.perf_counter() - t0
    print(table(rows))
    saved = "saved to " + str(store.path) if store.writable else "kept in memory only (the store is not writable)"
    print(f"autotune: {elapsed:.1f} s; results {saved}")
    return 0 if all(r.best is not None for _, _, r in rows) else 1


def table(rows: list) -> str:
    head = ("shape", "bucket", "best", "config", "ms", "heuristic ms", "speed-up", "ok/pruned/failed")
    lines = [head]
    for p, key, res in rows:
        best, heur = res.best, res.heuristic()
        c = res.counts()
        failed = sum(v for k, v in c.items() if k not in ("ok", "pruned"))
        counts = f"{c.get('ok', 0)}/{c.get('pruned', 0)}/{failed}"
        if best is None:
            lines.append((p.label(), key, "NONE PASSED", "", "", "", "", counts))
            continue
        hms = heur.ms if heur is not None and heur.ms is not None else None
        cfg = " ".join(f"{k}={v}" for k, v in best.candidate.config) or "-"
        lines.append((p.label(), key, best.candidate.method, cfg, f"{best.ms:.4f}",
                      "-" if hms is None else f"{hms:.4f}", "-" if hms is None else f"{hms / best.ms:.2f}x", counts))
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    out = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
