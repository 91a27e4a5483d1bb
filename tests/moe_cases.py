"""Expert-parallel cases for :mod:`distributed`: tiny Hugging Face MoE models trained under ep against one process.

Each case is an :func:`equivalence_cases.equivalence` case (3 SGD-with-momentum steps, 3 AdamW
steps on ep2_mixtral alone (ADAM_CASES), losses, first-step gradients and final parameters against the unsharded
model on the whole global batch) on a plan solved with dp pinned and ``ep`` set on the solved plan, or, in the pipeline
cases, pinned (the planner then offers ep with pp itself). Routing decisions cannot flip between
the two runs: the weights are seeded (seed 0), the routers score in fp32 (Mixtral's and
Qwen2-MoE's ``*TopKRouter`` take the softmax of ``logits.float()``), every rank runs the router
on the very tokens the one-process run routes (ep only moves rows after the top-k is taken), and
the fp32 forward of one step differs from the reference only by summation order (~1e-7
relative), far below any gap between two top-k scores of random Gaussian weights at these sizes
(the parity bar of 1e-5 would catch a flip: a flipped token sends its rows through another
expert).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equivalence_cases as ec
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence_cases import Spec, equivalence

import autopar

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
TOKENS = (torch.zeros(2, 16, dtype=torch.long),)


def hf_mixtral() -> tuple[nn.Module, tuple]:
    import transformers

    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg), TOKENS


def hf_qwen2_moe() -> tuple[nn.Module, tuple]:
    import transformers

    cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=32, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2)
    return transformers.Qwen2MoeForCausalLM(cfg), TOKENS


def hf_deepseek_v3() -> tuple[nn.Module, tuple]:
    """DeepSeek-V3's shape in small: a dense first layer, then 8 routed experts (sigmoid scores, grouped
    top-k: 2 groups, 1 kept) beside a shared expert, MLA attention."""
    import transformers

    cfg = transformers.DeepseekV3Config(**COMMON, intermediate_size=64, moe_intermediate_size=16,
                                        first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=16,
                                        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    return transformers.DeepseekV3ForCausalLM(cfg), TOKENS


# ------------------------------------------------------------------ a hand-written MoE (module list, own loop)
# Mixtral's sparse MoE block as transformers 4.x wrote it in plain PyTorch (experts an nn.ModuleList of
# MLPs, the block's own loop over the experts hit: torch.where, index_select by indexing, index_add_),
# in a small pre-norm decoder. ep lowers it by rerouting the block's own forward (passes/expert_list.py).

class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)

class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, hidden, ffn, num_experts, top_k):
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(hidden, ffn) for _ in range(num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hitted = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hitted:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class HandDecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, num_experts: int, top_k: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.o_proj = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.block_sparse_moe = MixtralSparseMoeBlock(hidden, ffn, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.input_layernorm(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, d))
        moe, _ = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + moe


class HandMixtral(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2, ffn: int = 48,
                 num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(HandDecoderLayer(hidden, heads, ffn, num_experts, top_k) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def hand_mixtral() -> tuple[nn.Module, tuple]:
    """A hand-written Mixtral-style MoE GPT (module-list experts, the block's own loop), 4 experts, top-2."""
    return HandMixtral(), (torch.zeros(2, 16, dtype=torch.long),)


# ------------------------------------------------------------------ a hand-written GShard/Switch MoE (one-hot einsums)
# The layer as the GShard paper (Lepikhin et al. 2020, Algorithm 1) and the Switch Transformer write it in
# plain PyTorch: experts as 3-D parameters (w1 [E, M, H], w2 [E, H, M]), a softmax router, each token's top-k
# experts as one-hot masks, its slot in an expert's buffer by a cumsum over the tokens (first choices
# first), tokens over capacity = ceil(capacity_factor · tokens · top-k / E) dropped, dispatch
# einsum("sec,sm->ecm"), the experts as einsums over e, combine einsum("sec,ecm->sm"). ep splits the
# region between dispatch and combine on e (passes/expert_capacity.py).
#
# Parity: the capacity is computed from the tokens of one call, so a split of the batch (dp, microbatches)
# changes which tokens drop unless none can: capacity_factor ≥ E / top-k makes the layer drop-free (an
# expert receives at most every token of a call), and every plan then computes one device's numbers
# (padded slots are zero rows with zero combine weights). A layer that can drop runs a capacity per split
# under a split batch, or no split under batch_coupled=exact (autopar.batch_coupling; gshard_dropping below).
# Routing ties cannot flip: the router scores each token in fp32 from the same weights on every plan (only
# the batch's size differs), and the top-k of random Gaussian scores has no two values within rounding at
# these sizes.

class GShardMoE(nn.Module):
    def __init__(self, model_dim, hidden_dim, num_experts, top_k, capacity_factor):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) * model_dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) * hidden_dim ** -0.5)

    def forward(self, x):
        b, t, m = x.shape
        x = x.reshape(b * t, m)
        s, e, k = x.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(self.capacity_factor * s * k / e)
        gates = F.softmax(self.wg(x).float(), dim=-1)  # [s, e]
        gate_k, index_k = torch.topk(gates, k, dim=-1)  # [s, k]
        if k > 1:
            gate_k = gate_k / gate_k.sum(dim=-1, keepdim=True)
        mask = F.one_hot(index_k, e).to(gates.dtype)  # [s, k, e]
        # position in the expert's buffer: every token's first choice before any second choice
        position = torch.cumsum(mask.transpose(0, 1).reshape(k * s, e), dim=0).reshape(k, s, e).transpose(0, 1) - 1
        mask = mask * (position < capacity)  # over capacity: dropped
        slot = F.one_hot((position * mask).sum(dim=-1).long(), capacity).to(gates.dtype)  # [s, k, c]
        dispatch = (mask.unsqueeze(-1) * slot.unsqueeze(2)).sum(dim=1)  # [s, e, c]
        combine = (gate_k[:, :, None, None] * mask.unsqueeze(-1) * slot.unsqueeze(2)).sum(dim=1)
        expert_inputs = torch.einsum("sec,sm->ecm", dispatch.to(x.dtype), x)
        h = F.gelu(torch.einsum("ecm,emh->ech", expert_inputs, self.w1))
        expert_outputs = torch.einsum("ech,ehm->ecm", h, self.w2)
        y = torch.einsum("sec,ecm->sm", combine.to(x.dtype), expert_outputs)
        return y.reshape(b, t, m)


class GShardDecoderLayer(nn.Module):
    def __init__(self, d, heads, moe):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.moe = moe

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.ln_2(x))


class GShardGPT(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, hidden=48, num_experts=4, top_k=2, capacity_factor=2.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(GShardDecoderLayer(d, heads, GShardMoE(d, hidden, num_experts, top_k, capacity_factor))
                               for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


GSHARD = dict(vocab=64, d=32, heads=4, layers=2, hidden=48, num_experts=4)


def gshard_top2() -> tuple[nn.Module, tuple]:
    """GShard top-2, 4 experts, capacity factor 2 = E / top-k: drop-free."""
    return GShardGPT(**GSHARD, top_k=2, capacity_factor=2.0), (torch.zeros(2, 16, dtype=torch.long),)


def gshard_top1() -> tuple[nn.Module, tuple]:
    """Switch top-1, 4 experts, capacity factor 4 = E / top-k: drop-free."""
    return GShardGPT(**GSHARD, top_k=1, capacity_factor=4.0), (torch.zeros(2, 16, dtype=torch.long),)


def gshard_dropping() -> tuple[nn.Module, tuple]:
    """Switch's training capacity factor 1.25 on top-1 over 4 experts: tokens over capacity drop."""
    return GShardGPT(**GSHARD, top_k=1, capacity_factor=1.25), (torch.zeros(2, 16, dtype=torch.long),)


PLAIN = ("pp=1", "tp=1", "recompute=none", "zero=0")
BLOCKS_TP = "model.layers.*:tp=megatron"

SPECS: dict[str, Spec] = {
    "ep2_mixtral": Spec(hf_mixtral, PLAIN + ("dp=2", "microbatches=1"), 4, ep=2, adam=True),
    "ep2_qwen2_moe": Spec(hf_qwen2_moe, PLAIN + ("dp=2", "microbatches=2"), 4, ep=2),
    # ZeRO on an MoE layer shards its dense weights over dp; its experts stay whole per edp rank
    "ep2_zero3_mixtral": Spec(hf_mixtral, ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=2", "microbatches=2"),
                              4, ep=2),
    "ep2_zero1_qwen2_moe": Spec(hf_qwen2_moe, ("pp=1", "tp=1", "recompute=none", "zero=1", "dp=2",
                                               "microbatches=2"), 4, ep=2),
    "ep2_deepseek_v3": Spec(hf_deepseek_v3, PLAIN + ("dp=2", "microbatches=2"), 4, ep=2),
    "ep2_dp4_mixtral": Spec(hf_mixtral, PLAIN + ("dp=4", "microbatches=1"), 8, ep=2),
    # ep=2 × edp=2 at ZeRO ≥ 1: the experts an FSDP2 unit of their own over edp (2-D (edp, ep) shards)
    "ep2_dp4_zero3_mixtral": Spec(hf_mixtral, ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=4",
                                               "microbatches=2"), 8, ep=2),
    "ep2_dp4_zero1_qwen2_moe": Spec(hf_qwen2_moe, ("pp=1", "tp=1", "recompute=none", "zero=1", "dp=4",
                                                   "microbatches=2"), 8, ep=2),
    # Qwen2-MoE's block takes no tensor-parallel style (its shared expert's [H → 1] gate is in no column → row
    # group): tp=2 shards what takes one (embedding, head)
    "ep2_dp2_tp2_qwen2_moe": Spec(hf_qwen2_moe, PLAIN[:1] + ("tp=2", "recompute=none", "zero=0", "dp=2",
                                                             "microbatches=1"), 4, ep=2),
    # Mixtral's and DeepSeek-V3's blocks take one: attention (and DeepSeek's shared expert) split over tp,
    # the router and the routed experts replicated over tp (split over ep beside it)
    "tp2_mixtral": Spec(hf_mixtral, PLAIN[:1] + ("tp=2", "recompute=none", "zero=0", "dp=1", "microbatches=2",
                                                 BLOCKS_TP), 4),
    "ep2_dp2_tp2_mixtral": Spec(hf_mixtral, PLAIN[:1] + ("tp=2", "recompute=none", "zero=0", "dp=2",
                                                         "microbatches=1", BLOCKS_TP), 4, ep=2),
    "ep2_dp2_tp2_deepseek_v3": Spec(hf_deepseek_v3, PLAIN[:1] + ("tp=2", "recompute=none", "zero=0", "dp=2",
                                                                 "microbatches=1", BLOCKS_TP), 4, ep=2),
}

# expert tensor parallelism: the MoE layers' routed experts split across their hidden dim over tp=2 beside
# attention (autopar/sharding/experts.py, passes/expert_tensor.py), the router replicated; Mixtral beside dp=2
# at ZeRO-3 (FSDP2 over (dp, tp))
SPECS |= {
    "etp2_dp2_zero3_mixtral": Spec(hf_mixtral, PLAIN[:1] + ("tp=2", "recompute=selective", "zero=3", "dp=2",
                                                            "microbatches=2", "model.layers.*:tp=megatron+experts"), 4),
    "etp2_deepseek_v3": Spec(hf_deepseek_v3, PLAIN[:1] + ("tp=2", "recompute=full", "zero=0", "dp=1",
                                                          "microbatches=1", "model.layers.1:tp=megatron+experts"), 4),
}

# ep inside pipeline stages (the stages call the model's own layer modules, so each stage's experts are
# rerouted as the whole model's are): ep pinned, so the planner offers it with pp; 1F1B over 2 stages
PP2_EP2 = ("pp=2", "tp=1", "recompute=none", "microbatches=2", "schedule=1f1b", "ep=2")
SPECS |= {
    # W=4: pp=2 × dp=2, ep=2 folded into each stage's dp (edp=1), dense weights at ZeRO-0 and ZeRO-3
    "pp2_ep2_mixtral": Spec(hf_mixtral, PP2_EP2 + ("dp=2", "zero=0"), 4),
    "pp2_ep2_zero3_mixtral": Spec(hf_mixtral, PP2_EP2 + ("dp=2", "zero=3"), 4),
    # W=8: pp=2 × dp=4, ep=2 × edp=2: at ZeRO-1 each stage's experts an FSDP2 unit of their own over edp
    "pp2_ep2_dp4_zero1_mixtral": Spec(hf_mixtral, PP2_EP2 + ("dp=4", "zero=1"), 8),
}

# the hand-written Mixtral-style block (module-list experts, its own loop), rerouted by passes/expert_list.py
SPECS |= {
    "ep2_hand_mixtral": Spec(hand_mixtral, PLAIN + ("dp=2", "microbatches=2"), 4, ep=2),
    "ep2_zero3_hand_mixtral": Spec(hand_mixtral, ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=2",
                                                  "microbatches=2"), 4, ep=2),
    "ep2_dp4_hand_mixtral": Spec(hand_mixtral, PLAIN + ("dp=4", "microbatches=1"), 8, ep=2),
    # ep=2 × edp=2 at ZeRO-3: the module list an FSDP2 unit over edp, called as a module
    "ep2_dp4_zero3_hand_mixtral": Spec(hand_mixtral, ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=4",
                                                      "microbatches=2"), 8, ep=2),
    "pp2_ep2_hand_mixtral": Spec(hand_mixtral, PP2_EP2 + ("dp=2", "zero=0"), 4),
    "pp2_ep2_zero3_hand_mixtral": Spec(hand_mixtral, PP2_EP2 + ("dp=2", "zero=3"), 4),
}

# the GShard/Switch layer (one-hot einsum dispatch at a drop-free capacity), split on e between dispatch and
# combine by passes/expert_capacity.py; its experts stay whole over edp at every ZeRO stage
SPECS |= {
    "ep2_gshard_top2": Spec(gshard_top2, PLAIN + ("dp=2", "microbatches=2"), 4, ep=2),
    "ep2_gshard_top1": Spec(gshard_top1, PLAIN + ("dp=2", "microbatches=1"), 4, ep=2),
    # full recompute: the recomputed forward finds its expert region and runs its two all-to-alls again
    "ep2_recompute_gshard_top2": Spec(gshard_top2, ("pp=1", "tp=1", "recompute=full", "zero=0", "dp=2",
                                                    "microbatches=2"), 4, ep=2),
    "ep2_zero3_gshard_top2": Spec(gshard_top2, ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=2",
                                                "microbatches=2"), 4, ep=2),
    "ep2_dp4_gshard_top2": Spec(gshard_top2, PLAIN + ("dp=4", "microbatches=1"), 8, ep=2),
    "ep2_dp4_zero3_gshard_top1": Spec(gshard_top1, ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=4",
                                                    "microbatches=2"), 8, ep=2),
    "pp2_ep2_gshard_top2": Spec(gshard_top2, PP2_EP2 + ("dp=2", "zero=0"), 4),
    "pp2_ep2_zero3_gshard_top2": Spec(gshard_top2, PP2_EP2 + ("dp=2", "zero=3"), 4),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}


def bf16_against_ep1(rank: int, world_size: int, spec_name: str = "ep2_zero3_mixtral") -> dict[str, Any]:
    """A bf16 plan (experts fp32, computed on bf16 copies) under ep=2 against the same plan at ep=1, both on
    dp=2: 3 SGD steps' losses and the first step's full gradients. Not an exactness bar (bf16 rounds
    differently along the two paths), a check that ep's mixed precision trains as the dp engine's does."""
    spec = SPECS[spec_name]
    torch.manual_seed(0)
    model, inputs = spec.build()
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, world_size, cluster="cpu", dtype="bf16", pins=list(spec.pins),
                         global_batch=spec.global_batch)
    batches = ec._batches(spec, inputs, model)
    runs = {}
    for ep in (1, 2):
        torch.manual_seed(0)
        model, _ = spec.build()
        at_ep = dataclasses.replace(plan, mesh=plan.mesh.replace(ep=ep))
        pm = autopar.compile(model, example_inputs=inputs, plan=at_ep, graph=graph,
                             optimizer=lambda p: torch.optim.SGD(p, **ec.SGD))
        losses = []
        for k, (x, y) in enumerate(batches):
            losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
            if k == 0:
                grads = pm.full_grads()
        runs[ep] = (losses, grads)
    (l1, g1), (l2, g2) = runs[1], runs[2]
    return {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(l2, l1)),
            "grad_rel": max(ec.rel(g2[n], g1[n]) for n in g1),
            "expert_grad_rel": max(ec.rel(g2[n], g1[n]) for n in g1 if ".experts." in n)}


CASES["ep2_bf16_mixtral"] = bf16_against_ep1
CASES["ep2_bf16_hand_mixtral"] = lambda rank, world_size: bf16_against_ep1(rank, world_size,
                                                                           "ep2_zero3_hand_mixtral")
# ZeRO-0 over dp alone: DDP with fp32 masters for the dense weights, the experts left out of both
CASES["ep2_bf16_zero0_mixtral"] = lambda rank, world_size: bf16_against_ep1(rank, world_size, "ep2_mixtral")


def resume_across_ep(rank: int, world_size: int, spec_name: str = "ep2_dp4_mixtral") -> dict[str, Any]:
    """Two SGD-with-momentum steps under ep=2 × dp=4, saved (DCP) and exported (safetensors); the
    checkpoint restored under ep=1 and ep=4 trains a third step as the ep=2 run does (weights and
    momentum both mapped: the experts are DTensors sharded over ep, or a module list's experts each
    held by one ep rank), and the exported weights load under ep=4 as they were."""
    import tempfile

    spec = SPECS[spec_name]
    torch.manual_seed(0)
    model, inputs = spec.build()
    plan, graph = ec.plan_for(spec, world_size)
    batches = ec._batches(spec, inputs, model)
    where = ec.from_rank0(lambda: tempfile.mkdtemp(prefix="autopar-ep-resume-"))

    def at(ep: int, seed: int) -> Any:
        torch.manual_seed(seed)  # another start than the saved run's: loading must set every weight
        fresh, _ = spec.build()
        return autopar.compile(fresh, example_inputs=inputs, graph=graph,
                               plan=dataclasses.replace(plan, mesh=plan.mesh.replace(ep=ep)),
                               optimizer=lambda p: torch.optim.SGD(p, **ec.SGD))

    def step(pm: Any, k: int) -> float:
        x, y = batches[k]
        return pm.train_step(pm.local_batch(x), pm.local_batch(y))

    saved = at(2, 0)
    for k in range(2):
        step(saved, k)
    saved.save(f"{where}/dcp", extra={"ep": 2})
    saved.export(f"{where}/weights.safetensors")
    weights = {n: v.clone() for n, v in saved.state_dict(full=True).items()}  # replicated ones alias the live weights
    third = step(saved, 2)
    after = saved.state_dict(full=True)
    out: dict[str, Any] = {}
    for ep in (1, 4):
        pm = at(ep, 1)
        out[f"extra_ep{ep}"] = pm.load(f"{where}/dcp")
        out[f"loaded_rel_ep{ep}"] = max(ec.rel(v, weights[n]) for n, v in pm.state_dict(full=True).items())
        out[f"loss_rel_ep{ep}"] = abs(step(pm, 2) - third) / abs(third)
        out[f"param_rel_ep{ep}"] = max(ec.rel(v, after[n]) for n, v in pm.state_dict(full=True).items())
    pm = at(4, 1)
    pm.load_weights(f"{where}/weights.safetensors")
    out["weights_rel_ep4"] = max(ec.rel(v, weights[n]) for n, v in pm.state_dict(full=True).items())
    out["local_bytes_ep4"], out["local_bytes_ep2"] = pm.local_param_bytes(), saved.local_param_bytes()
    return out


CASES["resume_across_ep"] = resume_across_ep
CASES["resume_across_ep_hand_mixtral"] = lambda rank, world_size: resume_across_ep(rank, world_size,
                                                                                   "ep2_dp4_hand_mixtral")


def resume_across_etp(rank: int, world_size: int, spec_name: str = "etp2_deepseek_v3") -> dict[str, Any]:
    """Two SGD steps with the experts split over tp, saved (DCP) and exported (safetensors): the file holds
    one device's [E, 2I, H] / [E, H, I]; the checkpoint restored with the experts split and with them
    replicated over tp (``megatron``) trains a third step as the saved run does, and the exported weights
    load into the replicated layout as they were."""
    import tempfile

    from safetensors.torch import load_file

    spec = SPECS[spec_name]
    torch.manual_seed(0)
    model, inputs = spec.build()
    plan, graph = ec.plan_for(spec, world_size)
    batches = ec._batches(spec, inputs, model)
    where = ec.from_rank0(lambda: tempfile.mkdtemp(prefix="autopar-etp-resume-"))
    whole = dataclasses.replace(plan, layers=[
        dataclasses.replace(lp, choice=dataclasses.replace(lp.choice, tp="megatron"))
        if lp.choice.tp == "megatron+experts" else lp for lp in plan.layers])

    def at(p: Any, seed: int) -> Any:
        torch.manual_seed(seed)
        fresh, _ = spec.build()
        return autopar.compile(fresh, example_inputs=inputs, graph=graph, plan=p,
                               optimizer=lambda q: torch.optim.SGD(q, **ec.SGD))

    def step(pm: Any, k: int) -> float:
        x, y = batches[k]
        return pm.train_step(pm.local_batch(x), pm.local_batch(y))

    saved = at(plan, 0)
    for k in range(2):
        step(saved, k)
    saved.save(f"{where}/dcp")
    saved.export(f"{where}/weights.safetensors")
    weights = {n: v.clone() for n, v in saved.state_dict(full=True).items()}
    third = step(saved, 2)
    after = saved.state_dict(full=True)
    out: dict[str, Any] = {"split": sum(lp.choice.tp == "megatron+experts" for lp in plan.layers)}
    exported = load_file(f"{where}/weights.safetensors")
    out["exported_rel"] = max(ec.rel(exported[n], weights[n]) for n in weights if ".experts." in n)
    for name, p in (("split", plan), ("whole", whole)):
        pm = at(p, 1)
        pm.load(f"{where}/dcp")
        out[f"loaded_rel_{name}"] = max(ec.rel(v, weights[n]) for n, v in pm.state_dict(full=True).items())
        out[f"loss_rel_{name}"] = abs(step(pm, 2) - third) / abs(third)
        out[f"param_rel_{name}"] = max(ec.rel(v, after[n]) for n, v in pm.state_dict(full=True).items())
    pm = at(whole, 1)
    pm.load_weights(f"{where}/weights.safetensors")
    out["weights_rel_whole"] = max(ec.rel(v, weights[n]) for n, v in pm.state_dict(full=True).items())
    return out


CASES["resume_across_etp"] = resume_across_etp


# ------------------------------------------------------------------ DeepSeek-V3's bias update (moe_bias_update)

GAMMA = 0.01  # the bias step: large enough that the moved biases change routing within 3 steps
BIAS_SPECS = {
    "bias_ep2_deepseek_v3": Spec(hf_deepseek_v3, PLAIN + ("dp=2", "microbatches=2"), 4, ep=2),
    "bias_ep2_dp4_deepseek_v3": Spec(hf_deepseek_v3, PLAIN + ("dp=4", "microbatches=1"), 8, ep=2),
    # tp=2 beside: the two ranks of a tp group route the same tokens, and count outside the all-reduce
    "bias_ep2_dp2_tp2_deepseek_v3": Spec(hf_deepseek_v3, PLAIN[:1] + ("tp=2", "recompute=none", "zero=0", "dp=2",
                                                                      "microbatches=1", BLOCKS_TP), 4, ep=2),
}


def bias_reference(spec: Spec, gamma: float) -> dict[str, Any]:
    """One device, written out: 3 SGD steps on the whole global batch, each router's tokens per expert
    counted from its own top-k indices (the router's third output), its bias moved by γ · sign(mean −
    count) after the optimizer step."""
    from autopar.runtime import default_loss

    torch.manual_seed(0)
    model, inputs = spec.build()
    batches = ec._batches(spec, inputs, model)
    gates = {n: m for n, m in model.named_modules() if hasattr(m, "e_score_correction_bias")}
    counts = {n: torch.zeros(m.e_score_correction_bias.numel(), dtype=torch.int64) for n, m in gates.items()}

    def counter(n: str) -> Callable[..., None]:
        def count(module: nn.Module, args: tuple, out: tuple) -> None:
            counts[n].add_(torch.bincount(out[2].reshape(-1), minlength=counts[n].numel()))
        return count

    for n, m in gates.items():
        m.register_forward_hook(counter(n))
    opt = torch.optim.SGD(model.parameters(), **ec.SGD)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = default_loss(model(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for n, m in gates.items():
                load = counts[n].double()
                m.e_score_correction_bias.add_((gamma * torch.sign(load.mean() - load)).float())
                counts[n].zero_()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "biases": {f"{n}.e_score_correction_bias": m.e_score_correction_bias.clone() for n, m in gates.items()}}


def bias_update(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    """ep over dp with ``moe_bias_update=GAMMA`` against :func:`bias_reference` on one device: the biases
    after 3 steps (exact: each moved by ±γ per step) and the parameters (1e-5 relative)."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = ec.plan_for(spec, world_size)
        torch.manual_seed(0)
        model, inputs = spec.build()
        batches = ec._batches(spec, inputs, model)
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, moe_bias_update=GAMMA,
                             optimizer=lambda p: torch.optim.SGD(p, **ec.SGD))
        losses = [pm.train_step(pm.local_batch(x), pm.local_batch(y)) for x, y in batches]
        state = pm.state_dict(full=True)
        ref, still = ec.from_rank0(lambda: (bias_reference(spec, GAMMA), bias_reference(spec, 0.0)))
        biases = {n: state[n] for n in ref["biases"]}
        return {"ep": plan.mesh.ep, "dp": plan.mesh.dp, "tp": plan.mesh.tp, "routers": len(biases),
                "bias_max_abs": max(float((biases[n] - b).abs().max()) for n, b in ref["biases"].items()),
                "bias_steps": sorted({round(float(v) / GAMMA) for b in biases.values() for v in b}),
                "param_rel": ec._max_rel({n: state[n] for n in ref["params"]}, ref["params"])[0],
                "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
                # the moved biases changed routing: the parameters differ from a run without the update
                "update_moved_params": ec._max_rel(ref["params"], still["params"])[0]}

    return case


CASES |= {k: bias_update(v) for k, v in BIAS_SPECS.items()}


def grad_norm_case(spec_name: str) -> Callable[[int, int], dict[str, Any]]:
    """The global gradient norm ``max_grad_norm`` clips by, on the first step, against one device's
    ``clip_grad_norm_`` of the same global batch (a module list's experts are each held by one ep rank:
    counted once, not ep times or 1/ep)."""
    from autopar.runtime import default_loss

    def case(rank: int, world_size: int) -> dict[str, Any]:
        spec = SPECS[spec_name]
        plan, graph = ec.plan_for(spec, world_size)
        torch.manual_seed(0)
        model, inputs = spec.build()
        x, y = ec._batches(spec, inputs, model)[0]
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, max_grad_norm=1e9,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
        pm.train_step(pm.local_batch(x), pm.local_batch(y))

        def reference() -> float:
            torch.manual_seed(0)
            ref, _ = spec.build()
            default_loss(ref(x), y).backward()
            return float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))

        want = ec.from_rank0(reference)
        from torch.distributed.tensor import DTensor

        fused = [p for n, p in pm.lowered.named_parameters() if n.endswith(("experts.gate_up_proj",
                                                                            "experts.down_proj"))]
        return {"norm_rel": abs(pm.grad_norm - want) / want, "norm": pm.grad_norm, "ep": plan.mesh.ep,
                "ddp": any(r is not None and r.ddp is not None for r in pm.lowered.data_parallel),
                "fused_dtensors": [isinstance(p, DTensor) for p in fused]}

    return case


CASES |= {f"norm_{k}": grad_norm_case(k) for k in ("ep2_dp4_hand_mixtral", "ep2_dp4_zero3_hand_mixtral",
                                                    "pp2_ep2_zero3_hand_mixtral", "ep2_dp4_mixtral")}
