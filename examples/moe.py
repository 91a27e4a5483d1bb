"""Mixture-of-experts models: two written by hand, and Hugging Face's Mixtral and DeepSeek-V3.

Usage: autopar plan examples/moe.py:mixtral_8x7b --world-size 64 --cluster h100-80g --batch-size 256

The hand-written ones are the two ways MoE layers are usually written outside
a library, each in a small pre-norm transformer (:class:`MoEGPT`):

- :class:`LoopMoE` — experts as an ``nn.ModuleList`` of SwiGLU MLPs, a
  softmax top-k router, and a Python loop over the experts that gathers each
  expert's tokens with ``torch.where`` (data-dependent shapes);
- :class:`CapacityMoE` — experts as 3-D parameters, GShard/Switch dispatch:
  one-hot dispatch and combine tensors [tokens, E, capacity] and einsums,
  capacity = ⌈capacity_factor · tokens · top-k / E⌉ (static shapes; tokens
  beyond an expert's capacity are dropped, as in GShard). Which tokens drop
  depends on the tokens of one call, so at its capacity factor of 1.25 (top-2
  of 4 experts: it can drop) autopar plans no split of its batch; at
  capacity_factor ≥ E / top-k nothing drops and ep splits its experts
  (``passes/expert_capacity.py``).

The router runs in fp32 and the weights are seeded, so routing decisions do
not flip between runs of the same inputs (a near-tie would need two scores
equal to rounding; random Gaussian weights give none at these sizes).

Hugging Face specs build on the meta device from the library's config
defaults (never downloaded): ``mixtral_8x7b`` and ``deepseek_v3`` (671B).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Softmax top-k router, experts as a module list, one gather/scatter per expert."""

    def __init__(self, d: int, ffn: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, ffn) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)  # fp32 router: stable decisions
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


class CapacityMoE(nn.Module):
    """GShard/Switch: 3-D expert weights, one-hot dispatch and combine at a fixed capacity."""

    def __init__(self, d: int, ffn: int, num_experts: int, top_k: int, capacity_factor: float = 1.25):
        super().__init__()
        self.top_k, self.capacity_factor, self.num_experts = top_k, capacity_factor, num_experts
        self.router = nn.Linear(d, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, d, ffn) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn, d) / math.sqrt(ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens, e = flat.shape[0], self.num_experts
        capacity = math.ceil(self.capacity_factor * tokens * self.top_k / e)
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        onehot = torch.zeros(self.top_k, tokens, e, dtype=probs.dtype, device=flat.device)
        onehot.scatter_(-1, chosen.t().unsqueeze(-1), 1.0)  # [k, T, E], first choices first
        position = (torch.cumsum(onehot.reshape(-1, e), dim=0).reshape(self.top_k, tokens, e) - 1) * onehot
        kept = onehot * (position < capacity)
        slot = torch.zeros(self.top_k, tokens, e, capacity, dtype=probs.dtype, device=flat.device)
        slot.scatter_(-1, position.clamp(0, capacity - 1).long().unsqueeze(-1), kept.unsqueeze(-1))
        dispatch = slot.sum(dim=0).to(flat.dtype)  # [T, E, C]
        combine = (slot * weights.t()[:, :, None, None]).sum(dim=0).to(flat.dtype)
        routed = torch.einsum("tec,th->ech", dispatch, flat)
        hidden = F.gelu(torch.einsum("ech,ehf->ecf", routed, self.w_in))
        out = torch.einsum("ecf,efh->ech", hidden, self.w_out)
        return torch.einsum("tec,ech->th", combine, out).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, moe: nn.Module):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.norm2(x))


class MoEGPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, make_moe):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, make_moe()) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TINY = dict(vocab=64, d=32, heads=4, layers=2)
TINY_MOE = dict(d=32, ffn=48, num_experts=4, top_k=2)


def loop_moe_tiny(device: str = "cpu", batch: int = 2, seq: int = 16):
    """A two-block GPT whose MoE loops over a module list of experts (seeded)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = MoEGPT(**TINY, make_moe=lambda: LoopMoE(**TINY_MOE))
    return model, (torch.randint(0, TINY["vocab"], (batch, seq), device=device),)


def capacity_moe_tiny(device: str = "cpu", batch: int = 2, seq: int = 16):
    """A two-block GPT whose MoE dispatches by one-hot einsums at capacity factor 1.25 (seeded)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = MoEGPT(**TINY, make_moe=lambda: CapacityMoE(**TINY_MOE))
    return model, (torch.randint(0, TINY["vocab"], (batch, seq), device=device),)


def _hf(model_class: str, config_class: str, seq_len: int, **fields):
    import transformers

    transformers.logging.set_verbosity_error()  # a config built by hand names no attention kernel: HF says so
    config = getattr(transformers, config_class)(use_cache=False, **fields)
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config)
    return model, (torch.zeros(1, seq_len, dtype=torch.long, device="meta"),)


def mixtral_8x7b(seq_len: int = 4096):
    """Hugging Face Mixtral 8x7B from ``MixtralConfig()``'s defaults, on meta."""
    return _hf("MixtralForCausalLM", "MixtralConfig", seq_len)


def deepseek_v3(seq_len: int = 4096):
    """Hugging Face DeepSeek-V3 (671B) from ``DeepseekV3Config()``'s defaults, on meta."""
    return _hf("DeepseekV3ForCausalLM", "DeepseekV3Config", seq_len)
