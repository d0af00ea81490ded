"""The environment, the derived columns (roofline, ratio vs fla), and the outputs: JSON, Markdown, PNG."""

from __future__ import annotations

import datetime
import json
import platform
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

from . import timing
from .peers import dist_version

Row = dict[str, Any]
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
#: The standard shapes that vary the head size at a fixed N, left out of the time-vs-N plot.
HEAD_SHAPES = ("d64", "d256", "retnet")


def _git_commit() -> str:
    """The checkout's commit (``git describe --always --dirty``) when rtkernels runs from a checkout;
    an installed package has none (git would describe whatever repository the environment sits in)."""
    if os.environ.get("RTKERNELS_BENCH_COMMIT"):  # a copy of the tree without its git history
        return os.environ["RTKERNELS_BENCH_COMMIT"]
    root = Path(__file__).resolve().parents[3]  # rtkernels/cli/bench/report.py -> the checkout
    if not ((root / "pyproject.toml").is_file() and (root / "cuda_src").is_dir()):
        return "none (an installed package, not a checkout)"
    try:
        return subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"


def environment(device: torch.device, quick: bool) -> dict[str, Any]:
    """Versions, the GPU, and the two limits measured in this run (copy bandwidth, tensor peak)."""
    from ... import env as rtk_env
    from ...jit import sources_hash

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": rtk_env.torch_version_text(),
        "driver": rtk_env.driver_version(), "cupy": rtk_env.cupy_version() or "not installed",
        "nvrtc": rtk_env.nvrtc_version_text(), "triton": dist_version("triton") or "not installed",
        "rtkernels": f"{rtk_env.VERSION}, sources {sources_hash()}, commit {_git_commit()}",
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                      "memory_gib": round(p.total_memory / 2 ** 30, 1), "l2_mib": timing.l2_bytes(device) / 2 ** 20}
        nbytes, n = (256 << 20, 2048) if quick else (2 << 30, 8192)
    else:
        env["gpu"] = {"name": "none (CPU run: times from time.perf_counter; limits are the CPU's)"}
        nbytes, n = 64 << 20, 512
    env["copy_bw_GBps"] = timing.copy_bandwidth(device, nbytes) / 1e9
    env["copy_bw_how"] = f"device-to-device copy of {nbytes / 2 ** 20:.0f} MiB, bytes read + written / time"
    peak, how = timing.tensor_peak(device, n)
    env["tensor_peak_TFLOPs"], env["tensor_peak_how"] = peak / 1e12, how
    return env


def roofline_pct(row: Row, env: dict[str, Any]) -> Optional[float]:
    """The limit of docs/benchmark.md: % of the roofline time for a forward, % of copy bandwidth for decode
    (None for forward + backward, which the protocol gives no limit for)."""
    if not row.get("ms") or row["pass"] == "fwdbwd":
        return None
    secs, bw = row["ms"] / 1e3, env["copy_bw_GBps"] * 1e9
    b, h, n, dk = row["B"], row["H"], row["N"], row["D"]
    dv = row.get("Dv") or dk  # rows of older runs have one D
    if row["pass"] == "decode":
        return 100 * (2 * b * h * dk * dv * 4 / secs) / bw
    bytes_ = 2 * b * h * n * (dk + dv) * ELEMENT_SIZE[row["dtype"]]
    flop = 2 * b * h * n * (64 * (dk + dv) + 2 * dk * dv)
    return 100 * max(bytes_ / bw, flop / (env["tensor_peak_TFLOPs"] * 1e12)) / secs


def add_derived(rows: list[Row], env: dict[str, Any]) -> None:
    """Fill ``roofline_pct`` and ``vs_fla`` (fla's time / this time: > 1 means faster than fla)."""
    fla = {(r["shape"], r["dtype"], r["pass"]): r for r in rows if r["impl"] == "fla" and r.get("ms")}
    for r in rows:
        r["roofline_pct"] = roofline_pct(r, env)
        ref = fla.get((r["shape"], r["dtype"], r["pass"]), {})
        r["vs_fla"] = ref["ms"] / r["ms"] if ref and r.get("ms") else None
        if r.get("graph_ms"):
            r["graph_roofline_pct"] = roofline_pct({**r, "ms": r["graph_ms"]}, env)
            r["graph_vs_fla"] = ref["graph_ms"] / r["graph_ms"] if ref.get("graph_ms") else None


def label(r: Row) -> str:
    """``impl/method`` plus the path rtkernels took."""
    return "/".join(filter(None, (r["impl"], r.get("method")))) + (f" ({r['path']})" if r.get("path") else "")


def _fmt(x: Optional[float], spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _overhead_text(ho: dict[str, Any]) -> str:
    parts = [f"{k}: {v['wall_us_per_call']:.1f} wall" + (f", {v['events_us_per_call']:.1f} events"
                                                         if "events_us_per_call" in v else "")
             for k, v in ho.items() if isinstance(v, dict)]
    extra = [f"{k}: {v}" for k, v in ho.items() if not isinstance(v, dict)]
    return "Host overhead, µs per call of 200 back-to-back calls: " + "; ".join(extra + parts) + "."


#: What the Markdown adds for ``--pass fwdbwd`` rows.
BWD_NOTE = (" Forward + backward: one call is the forward and out.backward(grad) (q, k, v require grad; the "
            "decay too where it says trainable: rtkernels' decay tensor, fla's per-token gates g, since its "
            "g_gamma gets no gradient); its time and peak memory are the whole's, the inputs counted with grad; no "
            "roofline; rel err of the output; grad rel err: the largest of dq, dk, dv's (and dγ's) vs fp64 gradients. "
            "fixed ms (trainable rows): the same step with the decay fixed, its repetitions interleaved with the "
            "trainable step's; × fixed: the ratio.")
#: ... for ``--graph``.
GRAPH_NOTE = (" graph ms: the kernels alone, ten forward calls captured in one CUDA graph and replayed (no "
              "Python, no launch overhead, no L2 flush between them).")
#: ... for the decay's placement.
DECAY_NOTE = ("rtkernels gets a float32 [H] tensor: cuda = on the GPU, as a model keeps it; cpu = on the host; "
              "fla gets log γ on the GPU")


def markdown(rows: list[Row], env: dict[str, Any], shapes: dict[str, str]) -> str:
    """The table of every measured or failed row; skipped rows and failures listed below it. Rows of
    ``--pass fwdbwd`` get a title saying so and a column of gradient errors."""
    gpu = env["gpu"]["name"]
    bwd = any(r["pass"] == "fwdbwd" for r in rows)
    graph = any(r.get("graph_ms") or r.get("graph_error") for r in rows)
    fixed = any(r.get("fixed_ms") for r in rows)
    decays = sorted({r["decay"] for r in rows if r.get("decay")})
    out = [f"## rtkernels bench{' (forward + backward)' if bwd else ''} on {gpu}", "",
           f"copy BW {env['copy_bw_GBps']:.4g} GB/s ({env['copy_bw_how']}); tensor peak "
           f"{env['tensor_peak_TFLOPs']:.3g} TFLOP/s ({env['tensor_peak_how']}); torch {env['torch']}; "
           f"CuPy {env['cupy']}; NVRTC {env['nvrtc']}; rtkernels {env['rtkernels']}.", "",
           "Shapes (B×H×N×D, D as Dk/Dv where they differ): "
           + "; ".join(f"{k} {v}" for k, v in shapes.items()) + ".", "",
           "Peers: " + "; ".join(f"{k} {v.get('version') or v.get('reason')}" + (
               f" ({v['gpu_name_patch']})" if v.get("gpu_name_patch") else "") for k, v in env["peers"].items())
           + ".", "", _overhead_text(env.get("host_overhead_us", {})), "",
           "vs fla: fla's time / this time (> 1: faster than fla). % roofline: docs/benchmark.md's "
           "max(bytes/copy BW, flop/tensor peak) / time; decode rows: % of copy bandwidth. "
           "peak MB: the call's inputs + the most it allocates." + (BWD_NOTE if bwd else "")
           + (GRAPH_NOTE if graph else "") + f" Decay: {', '.join(decays)} ({DECAY_NOTE})."
           + (f" rtkernels fp32_precision: {env['fp32_precision']}." if env.get("fp32_precision") else ""), "",
           "| shape | dtype | impl/method | ms | vs fla | % roofline |"
           + (" graph ms | graph vs fla | graph % roofline |" if graph else "") + " rel err | peak MB |"
           + (" grad rel err |" if bwd else "") + (" fixed ms | × fixed |" if fixed else ""),
           "|---|---|---|---:|---:|---:|" + ("---:|---:|---:|" if graph else "") + "---:|---:|" + ("---:|" if bwd else "")
           + ("---:|---:|" if fixed else "")]
    notes: list[str] = []
    skipped: dict[str, list[str]] = {}
    for r in rows:
        if r.get("skipped"):
            skipped.setdefault(r["skipped"], []).append(f"{r['shape']} {r['dtype']} {label(r)}")
            continue
        if r.get("error"):
            notes.append(f"- ERROR {r['shape']} {r['dtype']} {label(r)}: {r['error']}")
        ms = _fmt(r.get("ms"), ".3f") if not r.get("error") else "ERROR"
        if r.get("graph_error"):
            notes.append(f"- no CUDA graph for {r['shape']} {r['dtype']} {label(r)}: {r['graph_error']}")
        gcols = (f"{_fmt(r.get('graph_ms'), '.4f')} | {_fmt(r.get('graph_vs_fla'), '.2f')} | "
                 f"{_fmt(r.get('graph_roofline_pct'), '.1f')} | ") if graph else ""
        out.append(f"| {r['shape']} | {r['dtype']} | {label(r)} | {ms} | {_fmt(r.get('vs_fla'), '.2f')} | "
                   f"{_fmt(r.get('roofline_pct'), '.1f')} | {gcols}{_fmt(r.get('rel_err'), '.1e')} | "
                   f"{_fmt(r.get('peak_mb'), '.0f')} |" + (f" {_fmt(r.get('grad_rel_err'), '.1e')} |" if bwd else "")
                   + (f" {_fmt(r.get('fixed_ms'), '.3f')} | {_fmt(r.get('x_fixed'), '.2f')} |" if fixed else ""))
    refs = sorted({f"{r['shape']}: {r['ref']}" for r in rows if r.get("ref")})
    notes += [f"- skipped ({reason}): {', '.join(where)}" for reason, where in skipped.items()]
    return "\n".join(out + [""] + notes + ["", "rel err: Frobenius norm vs an fp64 reference ("
                                           + "; ".join(refs) + ")."]) + "\n"


def plot(rows: list[Row], path: Path) -> str:
    """Time vs N (log-log), one line per implementation: bf16 forward rows of the D = 128 shapes (not
    the head-size shapes d64, d256, retnet); the forward + backward rows instead for a run of
    ``--pass fwdbwd``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    pass_, what = ("fwdbwd", "forward + backward") if any(r["pass"] == "fwdbwd" for r in rows) else ("fwd", "forward")
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["pass"] == pass_ and r["dtype"] == "bf16" and r["shape"] not in HEAD_SHAPES and r.get("ms"):
            series.setdefault(label(r), []).append((r["N"], r["ms"]))
    if not series:
        return f"plot skipped: no bf16 {what} rows"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, pts in sorted(series.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="N (standard shapes; B and H differ per shape)", ylabel="ms",
           title=f"bf16 {what}, standard shapes except " + ", ".join(HEAD_SHAPES))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def write(out_dir: Path, env: dict[str, Any], rows: list[Row], shapes: dict[str, str], args: dict[str, Any],
          partial: Optional[tuple[int, int]] = None) -> str:
    """Write bench.json, bench.md and bench.png under ``out_dir``; return the Markdown.
    ``partial`` = (done, total): the run has finished ``done`` of its ``total`` (shape, dtype)
    cases; the files say so (``"partial"`` in the JSON, a first line in the Markdown) and the plot
    waits for the end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    add_derived(rows, env)
    env["plot"] = "plot: at the end of the run" if partial else plot(rows, out_dir / "bench.png")
    doc = {"environment": env, "args": args, "rows": rows}
    if partial:
        doc["partial"] = {"cases_done": partial[0], "cases": partial[1]}
    (out_dir / "bench.json").write_text(json.dumps(doc, indent=1, default=str))
    head = (f"Partial: {partial[0]} of {partial[1]} (shape, dtype) cases done; the run was still going or was "
            f"stopped.\n\n" if partial else "")
    md = head + markdown(rows, env, shapes) + f"\n{env['plot']}\n"
    (out_dir / "bench.md").write_text(md)
    return md
