"""What the FSDP2 tests share: a small model with every awkward shape (odd dim 0, a 1-row gain, tiny
layers, biases, tied embeddings), and the tensor an NVFP4 all-gather must decode to."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def expected_unsharded(full: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    """What an NVFP4 all-gather of `full` must decode to, from fp4offload.quantize alone.

    FSDP pads dim 0 to world * ceil(d0 / world) rows. When each rank's 2-D view has a multiple of 16
    rows, the result is the 16x16 encoding of the padded whole; else each rank's padded shard is
    encoded in 1x16 blocks with the whole tensor's amax.
    """
    import fp4offload

    d0, rest = full.shape[0], tuple(full.shape[1:])
    rows0 = -(-d0 // world)
    padded = full.new_zeros((world * rows0, *rest))
    padded[:d0] = full
    cols = full.shape[-1]
    local_rows = rows0 * math.prod(rest[:-1]) if full.dim() >= 2 else 0
    if full.dim() >= 2 and local_rows % 16 == 0 and local_rows:
        q = fp4offload.quantize(padded.reshape(-1, cols), "nvfp4", block="16x16")
        out = fp4offload.dequantize(q).reshape(padded.shape)
    else:
        amax = full.abs().amax()
        parts = [fp4offload.dequantize(fp4offload.quantize(c.reshape(-1), "nvfp4", block="1x16", amax=amax))
                 for c in padded.chunk(world)]
        out = torch.cat(parts).reshape(padded.shape)
    return out[:d0].to(dtype)


class OddBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 33)  # dim 0 odd: 17 + 16 rows, 1x16 blocks; bias (33,)
        self.down = nn.Linear(33, 24)  # 12 rows per rank: 1x16 blocks
        self.wide = nn.Linear(24, 64, bias=False)  # 32 rows per rank: 16x16 tiles
        self.narrow = nn.Linear(64, 24, bias=False)
        self.tiny = nn.Linear(24, 3)  # 3 x 24 weight, (3,) bias: 2 + 1 rows
        self.back = nn.Linear(3, 24, bias=False)
        self.gain = nn.Parameter(torch.ones(1, 24))  # dim 0 of 1: rank 1 holds an empty shard

    def forward(self, x):
        h = torch.relu(self.up(x))
        x = x + self.down(h) + self.narrow(torch.relu(self.wide(x)))
        return (x + self.back(torch.tanh(self.tiny(x)))) * self.gain


class OddModel(nn.Module):
    _no_split_modules = ["OddBlock"]

    def __init__(self, vocab=37):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 24)  # 37 rows: odd
        self.blocks = nn.ModuleList([OddBlock(), OddBlock()])
        self.head = nn.Linear(24, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train_lm(model, opt, steps: int, generator: torch.Generator, batch: int = 4, seq: int = 64) -> list[float]:
    """`steps` optimizer steps of next-byte loss on random Shakespeare windows; the losses."""
    from benchmarks import harness

    train, _ = harness.byte_splits()
    losses = []
    for _ in range(steps):
        loss = harness.lm_loss(model, harness.batch(train, batch, seq, generator))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def config_errors(cases: dict) -> dict[str, str]:
    """Call each case; its ConfigError message, or "no error" when it raised none (other errors propagate)."""
    from fp4offload.errors import ConfigError

    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except ConfigError as e:
            out[name] = str(e)
    return out


def inner_name(opt) -> str:
    """Which optimizer fp4offload.fsdp built: FP4AdamW, or torch AdamW (fp32 states)."""
    import fp4offload

    return "fp4offload.FP4AdamW" if isinstance(opt, fp4offload.FP4AdamW) else "torch.optim.AdamW"
