"""A straightforward PyTorch GPT-2 training loop: the reference `scripts/bench_train.py` compares against.

Same shape and hyper-parameters as `microbench-train --model=gpt2`: pre-norm blocks, GELU (tanh) MLP,
learned positions, tied embeddings, vocabulary 50304, biases; gradients clipped to global norm 1.0, then
AdamW(lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter); float32; the same synthetic arithmetic-progression
batches. Attention is `F.scaled_dot_product_attention(is_causal=True)`. `--compile` wraps the model in `torch.compile`
(TorchInductor: forward and backward compiled into fused C++ kernels; the first step pays the compile, so
keep it in the warm-up). Prints one JSON line.

  python scripts/torch_gpt2.py --layers=2 --batch=8 --seq_len=256 --steps=10 --warmup_steps=3 --threads=2
  python scripts/torch_gpt2.py --compile ...
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"tiny": (64, 2, 4, 256, 128), "124m": (768, 12, 12, 50304, 1024), "350m": (1024, 24, 16, 50304, 1024),
         "1.3b": (2048, 24, 16, 50304, 1024)}  # d_model, layers, heads, vocab, context


class Block(nn.Module):
  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
    x = x + self.proj(a)
    return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  def __init__(self, d: int, layers: int, heads: int, vocab: int, context: int):
    super().__init__()
    self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
    self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
    self.ln_f = nn.LayerNorm(d)
    for name, p in self.named_parameters():
      if p.dim() >= 2:
        std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
        nn.init.normal_(p, 0.0, std)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.ln_f(x) @ self.wte.weight.T  # tied head


def batch(gen: torch.Generator, b: int, t: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
  start = torch.randint(0, vocab, (b, 1), generator=gen)
  stride = torch.randint(1, 8, (b, 1), generator=gen)
  seq = (start + stride * torch.arange(t + 1)[None, :]) % vocab
  return seq[:, :-1], seq[:, 1:]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--size", default="124m", choices=SIZES)
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup_steps", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--compile", action="store_true", help="torch.compile the model (TorchInductor)")
  args = ap.parse_args()
  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  d, layers, heads, vocab, context = SIZES[args.size]
  layers = args.layers or layers
  model = GPT(d, layers, heads, vocab, context)
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
  forward = torch.compile(model) if args.compile else model
  gen = torch.Generator().manual_seed(1)
  times, losses = [], []
  for _ in range(args.steps):
    x, y = batch(gen, args.batch, args.seq_len, vocab)
    t0 = time.perf_counter()
    loss = F.cross_entropy(forward(x).view(-1, vocab), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
    times.append(time.perf_counter() - t0)
  med = statistics.median(times[args.warmup_steps:])
  tokens = args.batch * args.seq_len
  print(json.dumps({"impl": "torch.compile" if args.compile else "pytorch", "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                    "size": args.size, "layers": layers, "batch": args.batch, "seq_len": args.seq_len,
                    "params": sum(p.numel() for p in model.parameters()), "median_step_time_s": med,
                    "tokens_per_s": tokens / med, "step_times_s": times, "losses": losses}))


if __name__ == "__main__":
  main()
