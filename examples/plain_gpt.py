"""A plain GPT, written as a user writes one, at the sizes of the Megatron-LM paper.

Usage: ``megatron`` is one row of the Megatron-LM paper's Table 1 (``MEGATRON_SIZE``, default
1.7B); ``spec`` is GPT-3 175B unless ``PLAIN_GPT_{WIDTH,HEADS,LAYERS,SEQ,VOCAB}`` say otherwise::

    MEGATRON_SIZE=18B autopar plan examples/plain_gpt.py:megatron --world-size 256 \\
        --cluster a100-80g --batch-size 1024 --pin tp=8 --pin pp=1 --pin recompute=full --pin zero=0
    autopar plan examples/plain_gpt.py:spec --world-size 1024 --cluster a100-80g --batch-size 1536

The model is nanoGPT-like and knows nothing of autopar: no config object, no
``device`` argument (autopar builds it under ``torch.device("meta")`` to plan
it, so a trillion parameters allocate nothing), one fused ``c_attn``
projection cut in three with ``chunk``, heads from ``reshape(b, t, heads,
c // heads)``, a 4× GELU MLP, pre-LayerNorm blocks, token + learned position
embeddings and an LM head. Megatron-LM ties its output layer to the word
embeddings, but with pp > 1 the last stage keeps its own copy of them,
splits it over the vocabulary across tp and all-reduces its gradient with
the first stage's: an untied head (``tied=False``, what ``megatron`` builds)
is what runs and what it holds; ``tied=True`` shares the one weight.

Attention comes in two forms. ``"sdpa"`` calls the fused
``F.scaled_dot_product_attention`` (flash attention on a GPU: the [s, s]
scores never exist in memory). ``"materialized"`` writes attention out as a
matmul, a scale-mask-softmax and a matmul, materialising the [b, heads, s, s]
scores. The Megatron-LM runs of 2021 did the latter (flash attention was
published a year later, 2022; their fused kernel fuses scale, mask and
softmax only, §4.2 of the paper), so the ``megatron`` spec uses it.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: weak scaling on DGX A100 80 GB nodes
# (Selene), sequence 2048, vocabulary 51,200; the same table is in NVIDIA/Megatron-LM's README.
# Interleaved/1F1B schedule details and microbatch sizes are not in the table.
SEQ_LEN = 2048
VOCAB = 51200


class MegatronRow(NamedTuple):
    """One row of the paper's Table 1, as published."""

    params_b: float  # billions, as the paper gives it
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved teraFLOP/s per GPU (the paper's FLOP count, eq. 3)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


MEGATRON: dict[str, MegatronRow] = {
    "1.7B": MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    "3.6B": MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    "7.5B": MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    "18B": MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    "39B": MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    "76B": MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    "145B": MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    "310B": MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    "530B": MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    "1T": MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
}


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, attention: str = "sdpa"):
        super().__init__()
        if attention not in ("sdpa", "materialized"):
            raise ValueError(f"attention must be 'sdpa' or 'materialized', got {attention!r}")
        self.heads = heads
        self.attention = attention
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the [b, heads, t, t] scores in memory: scale, causal mask, softmax, then the values
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
            y = att @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attention: str = "sdpa"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, attention)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token ids (b, t) in, logits (b, t, vocab) out."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int,
                 attention: str = "sdpa", tied: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

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


def megatron(size: str | None = None, seq_len: int = SEQ_LEN, attention: str = "materialized",
             tied: bool = False):
    """The GPT of one row of the paper's Table 1 (``size``, else ``$MEGATRON_SIZE``, else 1.7B)
    and one sequence of token ids."""
    name = size or os.environ.get("MEGATRON_SIZE", "1.7B")
    if name not in MEGATRON:
        raise ValueError(f"unknown Megatron-LM size {name!r}; one of {', '.join(MEGATRON)}")
    row = MEGATRON[name]
    model = GPT(VOCAB, row.hidden, row.heads, row.layers, seq_len, attention, tied)
    return model, (torch.randint(0, VOCAB, (1, seq_len)),)


def tiny(attention: str = "materialized"):
    """The same GPT, small enough to build and train for real (``autopar verify``)."""
    model = GPT(256, 64, 4, 2, 32, attention)
    return model, (torch.randint(0, 256, (8, 32)),)


def tiny_sdpa():
    return tiny("sdpa")
