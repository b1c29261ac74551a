"""Reference for BENCHMARKS.md: the same GPT training step in PyTorch eager (CPU; f32, or with
`--bf16` the forward and loss under `torch.autocast("cpu", dtype=torch.bfloat16)`: bf16 products
with f32 master weights, what megatron-rs's `--bf16` runs).

The model matches megatron-rs's `Gpt`: pre-LayerNorm blocks, learned positions, GeLU (tanh) MLP
of 4h, fused QKV, causal attention, tied input/output embedding, dropout 0.1, AdamW
(0.9, 0.95, eps 1e-8, wd 0.01) and clipping at 1.0. Prints tokens/s and model GFLOP/s with the
same FLOP count as `megatron train` (6·N per token plus 12·layers·seq·hidden).

    pip install torch==2.15.0
    python3 benches/pytorch_gpt.py --model gpt-tiny --threads 2
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    "gpt-tiny": dict(layers=4, hidden=128, heads=4, vocab=256, positions=256),
    "gpt2-small": dict(layers=12, hidden=768, heads=12, vocab=50257, positions=1024),
    # gpt2-small cut to 4 layers of hidden 512 (8 heads): `megatron bench --model gpt2-small
    # --num-layers 4 --hidden-size 512 --num-attention-heads 8`.
    "l4-h512-v50k": dict(layers=4, hidden=512, heads=8, vocab=50257, positions=1024),
}


def padded(vocab, multiple=128):
    return (vocab + multiple - 1) // multiple * multiple


class Block(nn.Module):
    def __init__(self, h, heads, p):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(p)
        self.p = p

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, self.heads, 3 * (h // self.heads)).split(h // self.heads, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        probs = F.dropout(scores.masked_fill(~mask, float("-inf")).softmax(-1), self.p, self.training)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + self.drop(self.attention(self.ln1(x)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


class Gpt(nn.Module):
    def __init__(self, layers, hidden, heads, vocab, positions, p=0.1):
        super().__init__()
        self.wte = nn.Embedding(padded(vocab), hidden)
        self.wpe = nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(p)

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1])
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-tiny", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bf16", action="store_true", help="autocast the forward and loss to bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = PRESETS[args.model]
    model = Gpt(**cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    b, s = args.micro_batch_size, args.seq_length
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * n_params + 12 * cfg["layers"] * s * cfg["hidden"]
    times = []
    for step in range(args.steps + 2):
        tokens = torch.randint(0, cfg["vocab"], (b, s))
        targets = torch.randint(0, cfg["vocab"], (b, s))
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    tps = b * s / median
    precision = "bf16 autocast" if args.bf16 else "f32"
    print(f"pytorch {torch.__version__} {args.model} ({precision}): {n_params / 1e6:.2f}M "
          f"parameters, {args.threads} threads, batch {b}×{s}: {median * 1e3:.1f} ms/step, "
          f"{tps:.0f} tokens/s, {tps * flops_per_token / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
