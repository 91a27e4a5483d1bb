"""MoE models in the expert layouts autopar had never seen, each as its authors write it (issue 41).

- ``titan_moe``: a decoder with torchtitan's MoE (``torchtitan/models/moe/moe.py``): a
  ``TokenChoiceTopKRouter`` (softmax scores in fp32, top-k), a ``TokenReorderer`` (rows sorted by
  expert), ``GroupedExperts`` holding ``w1``, ``w2``, ``w3`` as ``[E, ·, ·]`` parameters called with the
  rows per expert, and a shared expert. ``torch._grouped_mm`` runs on CPU in torch 2.13 only on
  16-byte-aligned bf16/fp32 groups and torchtitan casts it to bf16, so the tests use torchtitan's own
  fallback, ``_run_experts_for_loop`` (``use_grouped_mm=False``), for fp32 parity. torchtitan counts
  rows per expert with ``torch.histc``, which has no CPU kernel for int64: ``bincount`` here.
- ``gpt_oss``: Hugging Face ``GptOssForCausalLM`` (experts with biases, interleaved gate/up, clamped
  SwiGLU, ``[E, H, 2I]`` orientation; attention sinks).
- ``llama4``: Hugging Face ``Llama4ForCausalLM`` (a shared expert beside the routed ones, every expert
  run by ``bmm`` on every token's scored copy).
- ``jamba``: Hugging Face ``JambaForCausalLM`` (a Mamba layer and an attention layer, an MoE in each;
  the mixer's ``conv1d`` is not taken for experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 64, 16


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    num_tokens_per_expert = num_tokens_per_expert.tolist()
    num_padding = x.shape[0] - sum(num_tokens_per_expert)
    x = torch.split(x[: sum(num_tokens_per_expert)], split_size_or_sections=num_tokens_per_expert, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    out = torch.cat(out_experts_splits, dim=0)
    return torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))


def _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert):
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) * hidden_dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim ** -0.5)
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.use_grouped_mm:
            return _run_experts_grouped_mm(self.w1, self.w2, self.w3, x, num_tokens_per_expert)
        return _run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x: torch.Tensor):
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        num_tokens_per_expert = torch.bincount(selected_experts_indices.view(-1), minlength=self.num_experts)
        return top_scores, selected_experts_indices, num_tokens_per_expert


class TokenReorderer(nn.Module):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        num_tokens_per_expert = torch.bincount(selected_experts_indices.view(-1), minlength=self.num_experts)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, shared: bool = True,
                 use_grouped_mm: bool = False):
        super().__init__()
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm)
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.reorderer = TokenReorderer(num_experts, top_k)
        self.shared_experts = FeedForward(dim, hidden_dim) if shared else None
        self.score_before_experts = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, _ = self.router(x)
        top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, selected_experts_indices)
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
        if self.score_before_experts:
            routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.reshape(bs, slen, dim)


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, moe: MoE):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.ffn_norm(x))


class TitanMoEModel(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2, hidden: int = 16,
                 num_experts: int = 4, top_k: int = 2, shared: bool = True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, heads, MoE(dim, hidden, num_experts, top_k, shared))
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def titan_moe() -> tuple[nn.Module, tuple]:
    """torchtitan's MoE (GroupedExperts w1/w2/w3, token-choice top-2 of 4, a shared expert), 2 blocks."""
    return TitanMoEModel(), (torch.zeros(2, SEQ, dtype=torch.long),)


def gpt_oss() -> tuple[nn.Module, tuple]:
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
                                    tie_word_embeddings=False, layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # HF initialises gpt-oss's routers at zero: every score ties, and routing is arbitrary
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0.0, 0.5)
    return model, (torch.zeros(2, SEQ, dtype=torch.long),)


def llama4() -> tuple[nn.Module, tuple]:
    import transformers

    cfg = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                                        intermediate_size_mlp=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                                        max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
                                        interleave_moe_layer_step=1, no_rope_layers=[1, 1], attention_chunk_size=64)
    model = transformers.Llama4ForCausalLM(cfg)
    with torch.no_grad():  # HF initialises Llama 4's experts' gate_up at zero: no gradient would reach the router
        for layer in model.model.layers:
            layer.feed_forward.experts.gate_up_proj.normal_(0.0, 0.2)
    return model, (torch.zeros(2, SEQ, dtype=torch.long),)


def jamba() -> tuple[nn.Module, tuple]:
    """Hugging Face's Jamba: a Mamba decoder layer then an attention one, each with an MoE (fused experts)."""
    import transformers

    cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                   expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                                   attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                                   mamba_dt_rank=4, use_cache=False, use_mamba_kernels=False,
                                   tie_word_embeddings=False)
    return transformers.JambaForCausalLM(cfg), (torch.zeros(2, SEQ, dtype=torch.long),)


LAYOUT_MODELS = {"titan_moe": titan_moe, "gpt_oss": gpt_oss, "llama4": llama4, "jamba": jamba}
