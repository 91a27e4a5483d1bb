"""A GPT as a user writes one: no config object, no ``device`` argument.

Attention splits one fused projection with ``qkv.chunk(3)`` and its heads with
``reshape(b, t, heads, c // heads)``; a 4x GELU MLP; pre-LayerNorm blocks.
``spec()`` is GPT-3 175B by default; the environment changes its size::

    autopar plan examples/plain_gpt.py:spec --world-size 1024 --cluster a100-80g --batch-size 1536
    PLAIN_GPT_WIDTH=2048 PLAIN_GPT_HEADS=16 PLAIN_GPT_LAYERS=24 autopar plan examples/plain_gpt.py:spec ...

autopar builds the model under ``torch.device("meta")`` to plan it, so nothing is allocated.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def spec():
    """GPT-3 175B (12288 wide, 96 heads, 96 layers, sequence 2048, vocabulary 51200) unless
    ``PLAIN_GPT_{WIDTH,HEADS,LAYERS,SEQ,VOCAB}`` say otherwise."""
    env = {k: int(os.environ.get(f"PLAIN_GPT_{k}", d)) for k, d in
           (("WIDTH", 12288), ("HEADS", 96), ("LAYERS", 96), ("SEQ", 2048), ("VOCAB", 51200))}
    model = GPT(env["VOCAB"], env["WIDTH"], env["HEADS"], env["LAYERS"], env["SEQ"])
    return model, (torch.randint(0, env["VOCAB"], (1, env["SEQ"])),)
