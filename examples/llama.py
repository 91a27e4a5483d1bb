"""Llama 3 shapes in plain PyTorch: RMSNorm, rotary embeddings, GQA, SwiGLU.

Usage: autopar plan examples/llama.py:llama3_70b --world-size 512 --cluster h100-80g

Spec functions return ``(model, (tokens,))`` built on the meta device by
default. The rotary cos/sin tables are buffers computed at init, so each
block takes only ``x``; token sequences must be exactly ``seq_len`` long.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int
    seq_len: int
    n_layer: int
    d_model: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


CONFIGS: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(128256, 8192, 32, 4096, 14336, 32, 8),
    "llama3-70b": LlamaConfig(128256, 8192, 80, 8192, 28672, 64, 8),
    "llama3-405b": LlamaConfig(128256, 8192, 126, 16384, 53248, 128, 8),
    "llama-7b": LlamaConfig(32000, 2048, 32, 4096, 11008, 32, 32, rope_theta=10000.0, norm_eps=1e-6),  # LLaMA 1
    "llama-tiny": LlamaConfig(128, 32, 2, 64, 128, 4, 2),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        # rotary tables (seq_len, head_dim); recomputable, so not saved in checkpoints
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos, self.sin  # sequences are always seq_len long here
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only Llama 3; ``forward`` returns logits (B, T, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(cfg: LlamaConfig, *, batch: int = 1, device: str | torch.device = "meta"):
    """Build the model and a batch of token ids on ``device``."""
    with torch.device(device):
        model = Llama(cfg)
        tokens = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
    return model, (tokens,)


def _named(key: str, seq_len: int | None, device: str | torch.device):
    cfg = CONFIGS[key]
    if seq_len is not None:
        cfg = LlamaConfig(**{**cfg.__dict__, "seq_len": seq_len})
    return build(cfg, device=device)


def llama3_8b(seq_len: int | None = None, device: str | torch.device = "meta"):
    return _named("llama3-8b", seq_len, device)


def llama3_70b(seq_len: int | None = None, device: str | torch.device = "meta"):
    return _named("llama3-70b", seq_len, device)


def llama3_405b(seq_len: int | None = None, device: str | torch.device = "meta"):
    return _named("llama3-405b", seq_len, device)


def llama_7b(seq_len: int | None = None, device: str | torch.device = "meta"):
    """LLaMA 7B (Touvron et al. 2023, table 2): 32 layers, width 4096, SwiGLU 11008, 32 heads, 2,048 tokens."""
    return _named("llama-7b", seq_len, device)


def llama_tiny(seq_len: int | None = None, device: str | torch.device = "meta"):
    return _named("llama-tiny", seq_len, device)
