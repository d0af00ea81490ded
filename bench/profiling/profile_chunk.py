"""Nsight Compute helper for the chunk kernels (device calls).

    python bench/profiling/profile_chunk.py run CASE        # the workload ncu attaches to (3 calls)
    python bench/profiling/profile_chunk.py top FILE.csv    # the SASS lines with the most stall samples

CASE: mid (4,32,4096,128) bf16, long (1,32,16384,128) bf16, f32 (4,32,4096,128) fp32 exact,
tf32 (same, TF32 mode), dgrad (mid bf16 forward + backward with a trainable CUDA decay: the
dq pass that sums dlog(gamma)), dlog-f32 / dlog-tf32 (the float32 dlog(gamma) kernel alone at mid,
"exact" / "tf32"), dq-dlog / dq-dlog16 (the W form of that dq pass alone at mid, bf16 / fp16), dq-z
(the Z form, 128 wide, bf16: the pass a trainable step at mid runs), dual / dual-z (the backward's
fused dk and dv pass alone at mid, bf16: a fixed decay's, and the one that also sums the Z split's
terms of dlog(gamma), a trainable step's), tf32-long (1,32,16384,128) float32 "tf32": its split sequence
(rtk_chunk_states_tf32, the scan, the fused pass). bench/profiling/ncu_chunk.sh runs ncu over each case and calls ``top``.
"""
import csv
import sys

CASES = {"mid": ((4, 32, 4096, 128), "bfloat16", "exact"), "long": ((1, 32, 16384, 128), "bfloat16", "exact"),
         "f32": ((4, 32, 4096, 128), "float32", "exact"), "tf32": ((4, 32, 4096, 128), "float32", "tf32"),
         "dgrad": ((4, 32, 4096, 128), "bfloat16", "exact"),
         "dlog-f32": ((4, 32, 4096, 128), "float32", "exact"), "dlog-tf32": ((4, 32, 4096, 128), "float32", "tf32"),
         "dq-dlog": ((4, 32, 4096, 128), "bfloat16", "exact"), "dq-dlog16": ((4, 32, 4096, 128), "float16", "exact"),
         "dq-z": ((4, 32, 4096, 128), "bfloat16", "exact"),
         "dual": ((4, 32, 4096, 128), "bfloat16", "exact"), "dual-z": ((4, 32, 4096, 128), "bfloat16", "exact"),
         "tf32-long": ((1, 32, 16384, 128), "float32", "tf32")}


def run(case: str) -> None:
    import torch

    import rtkernels

    (b, h, n, d), dt, prec = CASES[case]
    dtype = getattr(torch, dt)
    torch.manual_seed(0)
    q, k = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) / d ** 0.5 for _ in range(2))
    v = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    if case.startswith("dlog"):
        from rtkernels.decay import KIND_FACTOR, LogDecay
        from rtkernels.methods.chunk.decay_grad import kernel_log_decay_grad

        log_decay = LogDecay(q.device, raw=torch.full((h,), 0.99, device="cuda"), kind=KIND_FACTOR)
        g = torch.randn_like(v)
        for _ in range(3):
            kernel_log_decay_grad(q, k, v, log_decay, 1.0, None, g, None, fp32_precision=prec)
        torch.cuda.synchronize()
        return
    if case.startswith("dq-"):
        from rtkernels.decay import KIND_FACTOR, LogDecay
        from rtkernels.methods.chunk import decay_grad, launch

        log_decay = LogDecay(q.device, raw=torch.full((h,), 0.99, device="cuda"), kind=KIND_FACTOR)
        g, dq = torch.randn_like(v), torch.empty_like(q)
        part = decay_grad.dq_pass_partials(q, v)
        for _ in range(4):
            launch.kernel_forward(g, v, k, log_decay, 1.0, dq, None, False, dlog=(q, part, None), zsplit=case == "dq-z")
        torch.cuda.synchronize()
        return
    if case.startswith("dual"):  # as gradient_passes runs it: R(k, q, g) into dv, R(v, g, q) into dk
        from rtkernels.decay import KIND_FACTOR, LogDecay
        from rtkernels.methods.chunk import launch

        log_decay = LogDecay(q.device, raw=torch.full((h,), 0.99, device="cuda"), kind=KIND_FACTOR)
        g, dv, dk = torch.randn_like(v), torch.empty_like(v), torch.empty_like(k)
        z = case == "dual-z"
        part = torch.zeros(8 * b, 1, h, device="cuda")  # [segments * B, 1, H]; mid runs one segment
        for _ in range(4):
            launch.kernel_forward(k, q, g, log_decay, 1.0, dv, None, False, reverse=True, dual=(v, dk),
                                  dlog=(v, part, None) if z else None, zsplit=z)
        torch.cuda.synchronize()
        return
    if case == "dgrad":
        leaves = [x.requires_grad_() for x in (q, k, v)]
        decay = torch.full((h,), 0.99, device="cuda", requires_grad=True)
        for _ in range(3):
            rtkernels.causal_linear_attention(*leaves, decay, method="chunk").sum().backward()
        torch.cuda.synchronize()
        return
    for _ in range(3):
        rtkernels.causal_linear_attention(q, k, v, 0.99, method="chunk", fp32_precision=prec)
    torch.cuda.synchronize()


def top(path: str, count: int = 60) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head_at = next(i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r))
    head, body = rows[head_at], [r for r in rows[head_at + 1:] if len(r) == len(rows[head_at])]
    samp = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    src = next(i for i, c in enumerate(head) if c == "Source")
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != samp]

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[samp]) for r in body) or 1.0
    print(f"{path}: {len(body)} SASS lines, {total:.0f} stall samples")
    for idx, r in sorted(enumerate(body), key=lambda x: -num(x[1][samp]))[:count]:
        why = sorted(((num(r[i]), head[i]) for i in reasons if num(r[i]) > 0), reverse=True)[:3]
        print(f"{idx:5d} {100 * num(r[samp]) / total:5.1f}% {r[src][:70]:70s} " +
              " ".join(f"{n}={v:.0f}" for v, n in why))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        top(sys.argv[2])
