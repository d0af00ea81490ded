"""Scratch (device): what the final states' gradient costs a training step on packed sequences
(cu_seqlens), bf16, H = 32, D = 128. The scale picks the route of the G terms: 1.0 rides on the
reversed passes, 1e-7 (below STATE_GRAD_MIN_SCALE) keeps the torch products over the tokens (the
route every scale took before); the kernels' work is the same for both.

    python bench/profiling/time_packed_state_grad.py [TOTAL ...]     (default 65536 262144)
"""
import math
import sys

import torch

import rtkernels
from rtkernels.cli.bench.timing import back_to_back_ms

h, d, seqs = 32, 128, 16
gam = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), h))).cuda()
for total in [int(x) for x in sys.argv[1:]] or [65536, 262144]:
    g = torch.Generator().manual_seed(0)
    cut = torch.sort(torch.randperm(total - 1, generator=g)[:seqs - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cut, torch.tensor([total])]).to("cuda", torch.int32)
    leaves = [(torch.randn(1, h, total, d, device="cuda") / d ** 0.25).bfloat16().requires_grad_() for _ in range(3)]
    go = torch.randn(1, h, total, d, device="cuda", dtype=torch.bfloat16)
    gs = torch.randn(seqs, h, d, d, device="cuda")

    def step(scale: float, state_loss: bool) -> None:
        out, state = rtkernels.causal_linear_attention(*leaves, gam, scale=scale, return_state=True, cu_seqlens=cu)
        ((out * go).sum() + ((state * gs).sum() if state_loss else 0)).backward()

    row = [f"{back_to_back_ms(lambda: step(1.0, False), 5, 2):.3f}",
           f"{back_to_back_ms(lambda: step(1.0, True), 5, 2):.3f}",
           f"{back_to_back_ms(lambda: step(1e-7, True), 3, 1):.3f}"]
    print(f"{seqs} sequences, {total} tokens: fwd+bwd ms, loss on the output {row[0]}; on the output and the "
          f"final states {row[1]} (scale 1.0: reversed passes), {row[2]} (scale 1e-7: torch products)", flush=True)
    del leaves, go
    torch.cuda.empty_cache()
