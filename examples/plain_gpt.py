"""A plain GPT, written as a user writes one, at the sizes of the Megatron-LM paper.

Usage (a size name from ``MEGATRON``, given by the environment):

    MEGATRON_SIZE=18B autopar plan examples/plain_gpt.py:megatron --world-size 256 \\
        --cluster a100-80g --batch-size 1024 --pin tp=8 --pin pp=1 --pin recompute=full --pin zero=0

The model is nanoGPT-like and knows nothing of autopar: no config object, no
``device`` argument (autopar builds it under ``torch.device("meta")`` to plan
it, so a trillion parameters allocate nothing), one fused ``c_attn``
projection cut in three with ``chunk``, heads from ``reshape(b, t, heads,
c // heads)``, a 4× GELU MLP, pre-LayerNorm blocks, token + learned position
embeddings and a tied LM head (Megatron-LM ties the output layer to the word
embeddings).

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


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, attention: str = "materialized"):
        super().__init__()
        if attention not in ("sdpa", "materialized"):
            raise ValueError(f"attention must be 'sdpa' or 'materialized', got {attention!r}")
        self.n_head = n_head
        self.attention = attention
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        if attention == "materialized":
            mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q = q.reshape(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.reshape(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.reshape(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, attention: str = "materialized"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, attention)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Token ids (b, t) in, logits (b, t, vocab) out."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 attention: str = "materialized", tied: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size, attention) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def megatron(size: str | None = None, seq_len: int = SEQ_LEN, attention: str = "materialized"):
    """The GPT of one row of the paper's Table 1 (``size``, else ``$MEGATRON_SIZE``, else 1.7B)
    and one sequence of token ids."""
    name = size or os.environ.get("MEGATRON_SIZE", "1.7B")
    if name not in MEGATRON:
        raise ValueError(f"unknown Megatron-LM size {name!r}; one of {', '.join(MEGATRON)}")
    row = MEGATRON[name]
    model = GPT(VOCAB, seq_len, row.layers, row.heads, row.hidden, attention)
    return model, (torch.randint(0, VOCAB, (1, seq_len)),)


def tiny(attention: str = "materialized"):
    """The same GPT, small enough to build and train for real (``autopar verify``)."""
    model = GPT(256, 32, 2, 4, 64, attention)
    return model, (torch.randint(0, 256, (8, 32)),)


def tiny_sdpa():
    return tiny("sdpa")
