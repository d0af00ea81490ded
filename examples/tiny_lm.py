"""A byte-level language model built from ``rtkernels.nn.DecayingLinearAttention``: train, generate, check.

    python examples/tiny_lm.py [--device cpu|cuda] [--steps 300] [--seed 0] [--smoke]

The training text is the Python standard library's own source (the ``*.py`` files next to
``os.py``, in sorted order), so the example needs nothing but the interpreter. The last 5% of
the bytes are held out. The model: a byte embedding, blocks of

    x = x + Attn(RMSNorm(x));  x = x + MLP(RMSNorm(x))      (Attn: DecayingLinearAttention)

then RMSNorm and a head tied to the embedding. Training uses AdamW with warmup and a cosine
schedule; on CUDA the matmuls run in bfloat16 under autocast (fp32 weights and states).

Generation prefills the prompts with ``forward(..., return_state=True)``, stores each layer's
final states in rows of a state pool (permuted slots, as a serving engine keeps them), and then
feeds one sampled byte at a time through ``step`` (``rtkernels.decode`` on the GPU). At the end
the whole generated sequence is recomputed with one ``forward``: the logits each step produced
must equal the recomputed ones (relative error <= 1e-4 in float32, 3e-2 under bfloat16 autocast),
else the script exits with status 1.

``--smoke`` runs a tiny model for a few steps (seconds on two CPU cores); the tests run it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rtkernels.nn import DecayingLinearAttention

VOCAB = 256  # bytes


@dataclass
class Config:
    dim: int = 384
    layers: int = 4
    heads: int = 6
    seq: int = 512
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 30
    max_bytes: int = 0  # 0: every file
    prompt: int = 48
    new: int = 200
    log_every: int = 25


SMOKE = Config(dim=64, layers=2, heads=2, seq=64, batch=8, lr=3e-3, warmup=5, max_bytes=300_000, prompt=16, new=24,
               log_every=10)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (torch.nn.RMSNorm needs torch >= 2.4; the library supports 2.1)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # the statistic in fp32 under autocast too
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = DecayingLinearAttention(cfg.dim, cfg.heads)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, state: bool = False):
        a = self.attn(self.norm1(x), return_state=state)
        a, s = a if state else (a, None)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return (x, s) if state else x

    def step(self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.step(self.norm1(x), pool, slots)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) @ self.embed.weight.t()  # tied head

    def forward(self, idx: torch.Tensor, return_states: bool = False):
        """idx [B, N] bytes -> logits [B, N, 256] (and each layer's final state [B, H, Dk, Dv])."""
        x, states = self.embed(idx), []
        for block in self.blocks:
            x = block(x, state=return_states)
            if return_states:
                x, s = x
                states.append(s)
        return (self.logits(x), states) if return_states else self.logits(x)

    @torch.no_grad()
    def step(self, idx: torch.Tensor, pools: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """idx [B, T] new bytes -> logits [B, T, 256]; each layer's pool rows advance in place."""
        x = self.embed(idx)
        for block, pool in zip(self.blocks, pools):
            x = block.step(x, pool, slots)
        return self.logits(x)


def load_text(max_bytes: int) -> torch.Tensor:
    """The standard library's top-level ``*.py`` files, sorted by name, joined: uint8 [n]."""
    files = sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))
    parts, total = [], 0
    for f in files:
        data = f.read_bytes()
        parts.append(data + b"\n\n")
        total += len(data) + 2
        if max_bytes and total >= max_bytes:
            break
    blob = b"".join(parts)[:max_bytes or None]
    if len(blob) < 10_000:
        raise SystemExit(f"found only {len(blob)} bytes of Python source next to os.py")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets [B, seq] starting at ``starts``."""
    idx = starts[:, None] + torch.arange(seq + 1, device=data.device)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, cfg: Config, steps: int) -> float:
    """Linear warmup, then cosine down to 10%."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300; 60 with --smoke)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps, few generated bytes")
    args = ap.parse_args(argv)
    cfg = SMOKE if args.smoke else Config()
    steps = args.steps if args.steps is not None else (60 if args.smoke else 300)
    if steps < 2:
        raise SystemExit("--steps must be >= 2 (the loss is compared between the first and last steps)")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # bf16 matmuls on the GPU (fp32 weights, norms and states); plain fp32 on the CPU
    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    data = load_text(cfg.max_bytes).to(device)
    split = int(len(data) * 0.95)
    train, held = data[:split], data[split:]
    model = TinyLM(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"{len(data) / 1e6:.2f} MB of stdlib source, model {params / 1e6:.2f}M parameters "
          f"({cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads), {steps} steps of {cfg.batch}x{cfg.seq} bytes "
          f"on {device}")

    def held_out_loss() -> float:
        starts = torch.linspace(0, len(held) - cfg.seq - 2, cfg.batch, device=device).long()
        x, y = batch_at(held, starts, cfg.seq)
        with torch.no_grad(), autocast():
            return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()

    before = held_out_loss()
    # weight decay on the matrices only (not on norms, biases or the decay rates)
    matrices, others = ([p for p in model.parameters() if (p.dim() >= 2) == m] for m in (True, False))
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    losses = torch.zeros(steps, device=device)  # read once at the log points: no sync per step
    t0 = t_log = time.perf_counter()
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, cfg, steps)
        x, y = batch_at(train, torch.randint(0, len(train) - cfg.seq - 1, (cfg.batch,), device=device, generator=gen),
                        cfg.seq)
        with autocast():
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses[i] = loss.detach()
        if (i + 1) % cfg.log_every == 0 or i + 1 == steps:
            done = (i % cfg.log_every) + 1  # steps since the last line
            mean = losses[i + 1 - done:i + 1].mean().item()  # the sync that makes the timing honest
            now = time.perf_counter()
            # per window: the first one includes the kernels' JIT compile on a GPU
            rate = cfg.batch * cfg.seq * done / (now - t_log)
            print(f"step {i + 1:4d}  loss {mean:.3f} nats/byte  {rate:,.0f} tokens/s")
            t_log = now
    print(f"trained in {time.perf_counter() - t0:.1f} s")
    window = max(1, steps // 10)
    first, last = losses[:window].mean().item(), losses[-window:].mean().item()
    after = held_out_loss()
    print(f"training loss, mean of the first {window} steps {first:.3f} -> last {window} steps {last:.3f} "
          f"nats/byte; held-out loss {before:.3f} -> {after:.3f}")
    if not last < first - 0.5:
        raise SystemExit("the loss did not fall")

    model.eval()
    ok = generate(model, cfg, held, device, autocast, gen)
    if not ok:
        raise SystemExit(1)


def generate(model: TinyLM, cfg: Config, held: torch.Tensor, device: torch.device,
             autocast: Callable[[], contextlib.AbstractContextManager], gen: torch.Generator,
             batch: int = 2, temperature: float = 0.8) -> bool:
    """Prefill, decode ``cfg.new`` sampled bytes with ``step``, check against one ``forward``."""
    attn = model.blocks[0].attn
    # sequence b lives in row slots[b] of a pool with spare rows
    slots = torch.randperm(2 * batch, generator=torch.Generator().manual_seed(1))[:batch].to(device, torch.int32)
    pools = [attn.init_state(2 * batch, device) for _ in model.blocks]
    starts = torch.arange(batch, device=device) * (len(held) // batch)
    prompt = batch_at(held, starts, cfg.prompt)[0]
    with torch.no_grad(), autocast():
        t0 = time.perf_counter()
        logits, states = model(prompt, return_states=True)
        for pool, s in zip(pools, states):
            pool[slots.long()] = s
        step_logits = [logits[:, -1:].float()]
        tokens = [prompt]
        for i in range(cfg.new):
            probs = torch.softmax(step_logits[-1][:, -1] / temperature, dim=-1)
            tokens.append(torch.multinomial(probs, 1, generator=gen))
            if i + 1 < cfg.new:  # the last byte's logits are not needed
                step_logits.append(model.step(tokens[-1], pools, slots).float())
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        seq = torch.cat(tokens, dim=1)
        full = model(seq[:, :-1]).float()[:, cfg.prompt - 1:]  # the positions that predicted new bytes
    got = torch.cat(step_logits, dim=1)
    err = ((got.double() - full.double()).norm() / full.double().norm()).item()
    tol = 3e-2 if device.type == "cuda" else 1e-4
    for b in range(batch):
        text = bytes(seq[b].tolist())
        print(f"--- sample {b} (prompt | generated)\n{text[:cfg.prompt].decode('utf-8', 'replace')}|"
              f"{text[cfg.prompt:].decode('utf-8', 'replace')}")
    print(f"generated {batch}x{cfg.new} bytes in {dt:.2f} s ({batch * cfg.new / dt:,.0f} tokens/s, prefill included); "
          f"step logits vs one forward over the whole sequence: rel err {err:.2e} (tolerance {tol:g})")
    if not err <= tol:
        print("FAIL: the step logits differ from the recomputed ones")
        return False
    print("generation check passed")
    return True


if __name__ == "__main__":
    main()
