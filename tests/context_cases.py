"""Context-parallel cases for :mod:`distributed`: the project's GPT and a tiny Hugging Face Llama trained
under cp against one process.

Each case is an :func:`equivalence_cases.equivalence` case (3 SGD-with-momentum steps, and 3 AdamW
steps on the one case an engine marks (ADAM_CASES): losses, first-step gradients and final parameters against the
unsharded model on the whole global batch, fp32 on gloo) on a plan with cp pinned. Every rank holds its head and tail
chunk of each sequence (``passes/context_parallel.py``), attention all-gathers K and V over the cp group, and the GPT's
``pos_emb`` / Llama's ``rotary_emb`` get the global positions of the rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from equivalence_cases import GPT_TP, Spec, equivalence, gpt_tiny, plan_for
from moe_cases import hf_mixtral, hf_qwen2_moe

import autopar
from autopar.errors import BatchError

TOKENS = (torch.zeros(2, 16, dtype=torch.long),)


def hf_llama(layers: int = 2) -> tuple[nn.Module, tuple]:
    """A Llama of ``layers`` decoder layers (SDPA attention, grouped-query: 4 heads over 2 key/value heads,
    rotary positions)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg), TOKENS


def nanogpt() -> tuple[nn.Module, tuple]:
    """nanoGPT as its author writes it, attention by hand: softmax over q · kᵀ masked by its ``bias`` buffer."""
    import zoo

    return zoo.NanoGPT(zoo.NanoConfig()), zoo._ids()


def nanogpt_moe() -> tuple[nn.Module, tuple]:
    """nanoGPT as its author writes it (attention by hand), each block's MLP a Hugging Face Mixtral sparse MoE
    block (4 experts, top-2, from a tiny config), its weights drawn as Hugging Face draws Mixtral's (normal,
    std ``initializer_range``; built alone the block's parameters are left uninitialised)."""
    import transformers
    import zoo
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = zoo.NanoConfig()
    cfg = transformers.MixtralConfig(hidden_size=config.n_embd, intermediate_size=64, num_local_experts=4,
                                     num_experts_per_tok=2)
    cfg._experts_implementation = "eager"  # HF's loop over experts, which a block built alone falls back to (warning)
    model = zoo.NanoGPT(config)
    for block in model.transformer.h:
        block.mlp = MixtralSparseMoeBlock(cfg)
        for p in block.mlp.parameters():
            nn.init.normal_(p, std=cfg.initializer_range)
    return model, zoo._ids()


def _pins(cp: int, dp: int = 1, zero: int = 0, recompute: str = "none", m: int = 1, tp: int = 1) -> tuple[str, ...]:
    return ("pp=1", f"tp={tp}", f"dp={dp}", f"cp={cp}", f"zero={zero}", f"recompute={recompute}", f"microbatches={m}")


ULYSSES = ("cp_attention=ulysses",)  # the head all-to-all instead of the K/V all-gather
RING = ("cp_attention=ring",)  # K/V passed round the cp ring instead of all-gathered


def hf_llama_kv4() -> tuple[nn.Module, tuple]:
    """A Llama with 8 query heads over 4 key/value heads (head size 4): cp=2 × tp=2 divides its key/value
    heads, so Ulysses runs beside tp on it."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg), TOKENS


PP = ("pp=2", "tp=1", "dp=1", "cp=2", "zero=0", "recompute=none", "microbatches=2")
LLAMA_TP = ("model.layers.*:tp=megatron", "model.embed_tokens:tp=vocab")
NANO_TP = ("transformer.h.*:tp=megatron",)


def hf_llama_four() -> tuple[nn.Module, tuple]:
    """The Llama with four decoder layers: the middle two price alike and own FSDP units (the first
    keeps more activations and the last hands the norm less than its neighbours, so both sit in the
    root unit)."""
    return hf_llama(4)


def gpt_four() -> tuple[nn.Module, tuple]:
    """examples/gpt.py's GPT with four blocks: one per recompute kind in a mixed plan."""
    import gpt

    return gpt.gpt(n_layer=4, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="cpu")


def _layers(**choices: str) -> tuple[str, ...]:
    """Per-layer pins from ``name="key=value key=value"`` (``__`` for ``.``, as in ``blocks__0``)."""
    return tuple(f"{name.replace('__', '.')}:{item}" for name, items in choices.items() for item in items.split())


# Every block a different recompute kind and ZeRO stage in one plan, over 2 microbatches: a ZeRO-0
# block is an FSDP2 replicate unit beside fully_shard units, the root unit runs at ZeRO-1 (its
# gradient sync deferred to the last microbatch), and the head is checkpointed selectively.
MIXED_GPT = ("pp=1", "tp=1", "dp=2", "cp=2", "microbatches=2") + _layers(
    tok_emb="zero=1 recompute=none", pos_emb="zero=1 recompute=none", drop="zero=1 recompute=none",
    blocks__0="zero=3 recompute=full", blocks__1="zero=0 recompute=selective", blocks__2="zero=2 recompute=none",
    blocks__3="zero=1 recompute=alternate_mm", ln_f="zero=1 recompute=full", lm_head="zero=1 recompute=selective")
MIXED_LLAMA = ("pp=1", "tp=1", "dp=2", "cp=2", "microbatches=2") + _layers(
    model__embed_tokens="zero=1 recompute=none", model__rotary_emb="recompute=none",
    model__layers__0="zero=1 recompute=full", model__layers__1="zero=0 recompute=selective",
    model__layers__2="zero=3 recompute=none", model__layers__3="zero=1 recompute=alternate_mm",
    model__norm="zero=1 recompute=none", lm_head="zero=1 recompute=none")

SPECS: dict[str, Spec] = {
    "cp2_gpt": Spec(gpt_tiny, _pins(2), 2, adam=True),
    "cp2_llama": Spec(hf_llama, _pins(2), 2),
    # recompute re-runs the forward in backward: the attention mode must hold there too
    "cp2_recompute_gpt": Spec(gpt_tiny, _pins(2, recompute="full"), 2),
    "cp4_gpt": Spec(gpt_tiny, _pins(4), 2),
    "cp4_llama": Spec(hf_llama, _pins(4), 2),
    # dp × cp: gradients average over the 4 ranks; ZeRO-3 shards every weight over them (dp_shard_cp)
    "cp2_dp2_zero3_gpt": Spec(gpt_tiny, _pins(2, dp=2, zero=3), 4),
    "cp2_dp2_llama": Spec(hf_llama, _pins(2, dp=2), 4),
    # selective recompute replays its decoder layers' position pre-hooks inside its replay mode; the
    # replicate unit defers its all-reduce over dp × cp to the second microbatch
    "cp2_selective_accum_llama": Spec(hf_llama, _pins(2, recompute="selective", m=2), 2),
    # ZeRO-3 over the cp ranks alone (dp = 1), selective recompute, gradients reduce-scattered each microbatch
    "cp2_zero3_selective_accum_gpt": Spec(gpt_tiny, _pins(2, zero=3, recompute="selective", m=2), 2),
    # ZeRO-1 (sync and resharding deferred to the last microbatch) and ZeRO-2 over dp × cp
    "cp2_dp2_zero1_accum_gpt": Spec(gpt_tiny, _pins(2, dp=2, zero=1, m=2), 4),
    "cp2_dp2_zero2_accum_llama": Spec(hf_llama, _pins(2, dp=2, zero=2, m=2), 4),
    "cp2_dp2_mixed_gpt": Spec(gpt_four, MIXED_GPT, 4),
    # cp × tp: each cp rank's tp pair splits heads and MLP of its chunks; K/V gathered over cp, tp-local heads
    "cp2_tp2_gpt": Spec(gpt_tiny, _pins(2, tp=2) + GPT_TP, 2),
    "cp2_tp2_llama": Spec(hf_llama, _pins(2, tp=2) + LLAMA_TP, 2),
    "cp2_tp2_sp_gpt": Spec(gpt_tiny, _pins(2, tp=2) + GPT_TP + ("blocks.*:sp=on",), 2),
    "cp2_tp2_sp_llama": Spec(hf_llama, _pins(2, tp=2) + LLAMA_TP + ("model.layers.*:sp=on",), 2),
    # beside cp × tp, what the planner offers with it: ZeRO-3 over the cp ranks, selective and full
    # recompute (the TP rules' and cp's modes entered again in the recomputation), 2 microbatches
    "cp2_tp2_zero3_selective_accum_gpt": Spec(gpt_tiny, _pins(2, tp=2, zero=3, recompute="selective", m=2)
                                              + GPT_TP, 2),
    # dp × cp × tp (W=8): ZeRO-3 over the dp × cp ranks, each with its tp pair
    "cp2_dp2_tp2_zero3_gpt": Spec(gpt_tiny, _pins(2, dp=2, tp=2, zero=3) + GPT_TP, 4),
    "cp2_tp2_sp_recompute_accum_llama": Spec(hf_llama, _pins(2, tp=2, zero=1, recompute="full", m=2) + LLAMA_TP
                                             + ("model.layers.*:sp=on",), 2),
    "cp2_dp2_mixed_llama": Spec(hf_llama_four, MIXED_LLAMA, 4),
    # Ulysses: q, k, v all-to-all'd to heads/cp over the whole sequence, causal SDPA, the output back
    "uly_cp2_gpt": Spec(gpt_tiny, _pins(2) + ULYSSES, 2, adam=True),
    "uly_cp2_llama": Spec(hf_llama, _pins(2) + ULYSSES, 2),  # grouped-query: 4 heads over 2 kv heads
    "uly_cp2_recompute_llama": Spec(hf_llama, _pins(2, recompute="full") + ULYSSES, 2),
    "uly_cp4_gpt": Spec(gpt_tiny, _pins(4) + ULYSSES, 2),  # 4 heads, one a rank
    "uly_cp2_dp2_gpt": Spec(gpt_tiny, _pins(2, dp=2, zero=3) + ULYSSES, 4),
    "uly_cp2_dp2_llama": Spec(hf_llama, _pins(2, dp=2) + ULYSSES, 4),
    # beside tp: each tp rank's heads split again over cp (cp × tp divides the key/value heads)
    "uly_cp2_tp2_gpt": Spec(gpt_tiny, _pins(2, tp=2) + GPT_TP + ULYSSES, 2),
    "uly_cp2_tp2_llama": Spec(hf_llama_kv4, _pins(2, tp=2) + LLAMA_TP + ULYSSES, 2),
    # what the planner offers beside it, as with the all-gather: selective recompute (its replay issues the
    # all-to-alls again), gradient accumulation at ZeRO-1 over dp × cp, sequence parallelism beside tp
    "uly_cp2_selective_accum_llama": Spec(hf_llama, _pins(2, recompute="selective", m=2) + ULYSSES, 2),
    "uly_cp2_dp2_zero1_accum_gpt": Spec(gpt_tiny, _pins(2, dp=2, zero=1, m=2) + ULYSSES, 4),
    "uly_cp2_tp2_sp_gpt": Spec(gpt_tiny, _pins(2, tp=2) + GPT_TP + ("blocks.*:sp=on",) + ULYSSES, 2),
    # attention written by hand (passes/manual_attention.py): kᵀ and v gathered, the rank's rows of the mask
    "cp2_nanogpt": Spec(nanogpt, _pins(2), 2),
    "cp2_recompute_nanogpt": Spec(nanogpt, _pins(2, recompute="full"), 2),
    "cp2_selective_accum_nanogpt": Spec(nanogpt, _pins(2, recompute="selective", m=2), 2),
    "cp4_nanogpt": Spec(nanogpt, _pins(4), 2),
    "cp2_dp2_zero3_nanogpt": Spec(nanogpt, _pins(2, dp=2, zero=3), 4),
    "cp2_pp2_1f1b_nanogpt": Spec(nanogpt, PP + ("schedule=1f1b",), 4),
    # beside tp (W=4): Megatron blocks, the products' gathers on the tp rank's heads; sp off and on
    "cp2_tp2_nanogpt": Spec(nanogpt, _pins(2, tp=2) + NANO_TP, 2),
    "cp2_tp2_sp_nanogpt": Spec(nanogpt, _pins(2, tp=2) + NANO_TP + ("transformer.h.*:sp=on",), 2),
    # Ulysses on attention written by hand: q, kᵀ, v all-to-all'd to heads/cp over all S, the S × S causal mask
    "uly_cp2_nanogpt": Spec(nanogpt, _pins(2) + ULYSSES, 2),
    "uly_cp4_nanogpt": Spec(nanogpt, _pins(4) + ULYSSES, 2),  # 4 heads, one a rank
    "uly_cp2_selective_accum_nanogpt": Spec(nanogpt, _pins(2, recompute="selective", m=2) + ULYSSES, 2),
    "uly_cp2_dp2_zero3_nanogpt": Spec(nanogpt, _pins(2, dp=2, zero=3) + ULYSSES, 4),
    # cp × pp (W=4): each stage's attention gathers K/V over its cp pair; the stages send S/cp tokens
    "cp2_pp2_1f1b_gpt": Spec(gpt_tiny, PP + ("schedule=1f1b",), 4),
    "cp2_pp2_1f1b_llama": Spec(hf_llama, PP + ("schedule=1f1b",), 4),
    "cp2_pp2_gpipe_zero3_recompute_llama": Spec(hf_llama, ("pp=2", "tp=1", "dp=1", "cp=2", "zero=3", "recompute=full",
                                                           "microbatches=2", "schedule=gpipe"), 4),
    "cp2_pp2_interleaved_gpt": Spec(gpt_four, PP + ("schedule=interleaved_1f1b", "chunks=2"), 4),
    # W=8: cp inside stages beside tp (Megatron blocks, the tp rank's heads gathered over cp) and beside dp
    "cp2_pp2_tp2_gpt": Spec(gpt_four, ("pp=2", "tp=2", "dp=1", "cp=2", "zero=0", "recompute=none", "microbatches=2",
                                       "schedule=1f1b", "blocks.*:tp=megatron"), 4),
    "cp2_dp2_pp2_zero3_llama": Spec(hf_llama, ("pp=2", "tp=1", "dp=2", "cp=2", "zero=3", "recompute=none",
                                               "microbatches=2", "schedule=1f1b"), 8),
    # Ulysses inside pipeline stages (W=4): each stage's attention modules all-to-all their heads over the cp pair
    "uly_cp2_pp2_1f1b_gpt": Spec(gpt_tiny, PP + ("schedule=1f1b",) + ULYSSES, 4),
    "uly_cp2_pp2_1f1b_llama": Spec(hf_llama, PP + ("schedule=1f1b",) + ULYSSES, 4),
    "uly_cp2_pp2_gpipe_zero3_recompute_llama": Spec(hf_llama, ("pp=2", "tp=1", "dp=1", "cp=2", "zero=3",
                                                               "recompute=full", "microbatches=2", "schedule=gpipe")
                                                    + ULYSSES, 4),
    "uly_cp2_pp2_interleaved_gpt": Spec(gpt_four, PP + ("schedule=interleaved_1f1b", "chunks=2") + ULYSSES, 4),
    # Ulysses on attention written by hand beside tp and inside pipeline stages (W=4)
    "uly_cp2_pp2_1f1b_nanogpt": Spec(nanogpt, PP + ("schedule=1f1b",) + ULYSSES, 4),
    "uly_cp2_tp2_nanogpt": Spec(nanogpt, _pins(2, tp=2) + NANO_TP + ULYSSES, 2),
    "uly_cp2_tp2_sp_nanogpt": Spec(nanogpt, _pins(2, tp=2) + NANO_TP + ("transformer.h.*:sp=on",) + ULYSSES, 2),
}

# cp beside ep (ep borrows its ranks from dp × cp, the cp ranks of a sample first): an MoE block dispatches
# the rank's S/cp tokens over its ep group. W=2: the ep group is the cp pair (dp=1); W=4: dp=2 × cp=2, the ep
# group the cp pair and the experts averaged over the dp pair (edp=2), or ep=4 over all four (edp=1)
EP2 = ("ep=2",)
SPECS |= {
    "cp2_ep2_mixtral": Spec(hf_mixtral, _pins(2) + EP2, 2),
    "cp2_ep2_qwen2_moe": Spec(hf_qwen2_moe, _pins(2, m=2) + EP2, 2),
    "uly_cp2_ep2_mixtral": Spec(hf_mixtral, _pins(2) + EP2 + ULYSSES, 2),
    "cp2_ep2_zero3_recompute_mixtral": Spec(hf_mixtral, _pins(2, zero=3, recompute="full") + EP2, 2),
    "cp2_dp2_ep2_mixtral": Spec(hf_mixtral, _pins(2, dp=2) + EP2, 4),
    "cp2_dp2_ep2_zero3_qwen2_moe": Spec(hf_qwen2_moe, _pins(2, dp=2, zero=3, m=2) + EP2, 4),
    "cp2_dp2_ep2_zero1_mixtral": Spec(hf_mixtral, _pins(2, dp=2, zero=1, m=2) + EP2, 4),
    "cp2_dp2_ep4_mixtral": Spec(hf_mixtral, _pins(2, dp=2) + ("ep=4",), 4),
    "uly_cp2_dp2_ep2_qwen2_moe": Spec(hf_qwen2_moe, _pins(2, dp=2) + EP2 + ULYSSES, 4),
    # ring attention beside ep: K/V passed round the cp pair, which (dp=1) is also the ep group; beside dp=2
    # the ep group is each dp rank's cp pair, the experts averaged over the dp pair
    "ring_cp2_ep2_mixtral": Spec(hf_mixtral, _pins(2) + EP2 + RING, 2),
    "ring_cp2_ep2_zero3_recompute_mixtral": Spec(hf_mixtral, _pins(2, zero=3, recompute="full") + EP2 + RING, 2),
    "ring_cp2_dp2_ep2_mixtral": Spec(hf_mixtral, _pins(2, dp=2) + EP2 + RING, 4),
    "ring_cp2_pp2_ep2_mixtral": Spec(hf_mixtral, PP + ("schedule=1f1b",) + EP2 + RING, 4),
    "ring_cp2_tp2_ep2_mixtral": Spec(hf_mixtral, _pins(2, tp=2) + EP2 + RING + ("model.layers.*:tp=megatron",), 2),
    # Ulysses on attention written by hand beside ep: nanoGPT's masked softmax, its MLPs Mixtral's MoE blocks
    "uly_cp2_ep2_nanogpt_moe": Spec(nanogpt_moe, _pins(2) + EP2 + ULYSSES, 2),
    "cp2_ep2_nanogpt_moe": Spec(nanogpt_moe, _pins(2) + EP2, 2),  # kᵀ and v gathered, the rank's mask rows
    # W=4 beside tp (Megatron attention, the experts whole per tp rank) and inside pipeline stages
    "cp2_tp2_ep2_mixtral": Spec(hf_mixtral, _pins(2, tp=2) + EP2 + ("model.layers.*:tp=megatron",), 2),
    "cp2_pp2_ep2_mixtral": Spec(hf_mixtral, PP + ("schedule=1f1b",) + EP2, 4),
    "cp2_pp2_tp2_ep2_mixtral": Spec(hf_mixtral, ("pp=2", "tp=2", "dp=1", "cp=2", "zero=0", "recompute=none",
                                                 "microbatches=2", "schedule=1f1b", "model.layers.*:tp=megatron")
                                    + EP2, 8),
    "uly_cp2_pp2_tp2_nanogpt": Spec(nanogpt, ("pp=2", "tp=2", "dp=1", "cp=2", "zero=0", "recompute=none",
                                              "microbatches=2", "schedule=1f1b") + NANO_TP + ULYSSES, 8),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}


def expert_groups(spec_name: str) -> Callable[[int, int], dict[str, Any]]:
    """The global ranks of this rank's ep, edp and cp groups, its expert parameter bytes, and whether its cp
    group is its ep group itself, as lowered."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = plan_for(SPECS[spec_name], world_size)
        torch.manual_seed(0)
        model, inputs = SPECS[spec_name].build()
        total = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
        experts = pm.lowered.experts[0]
        ranks = [dist.get_process_group_ranks(g) if g is not None else [rank]
                 for g in (experts.ep_group, experts.edp_group)]
        local = sum(p.to_local().numel() for p in experts.params)
        context = pm.lowered.context  # the group the ring and Ulysses run on (None: kept by pipeline stages)
        cp_group = context.group if context is not None else None
        dist.barrier()
        return {"ep_ranks": ranks[0], "edp_ranks": ranks[1], "experts_frac": local / total, "dp": experts.dp,
                "cp_ranks": dist.get_process_group_ranks(cp_group) if cp_group is not None else None,
                "cp_is_ep": cp_group is experts.ep_group}

    return case


CASES |= {f"groups_{k}": expert_groups(k) for k in ("cp2_ep2_mixtral", "cp2_dp2_ep2_mixtral", "cp2_dp2_ep4_mixtral",
                                                    "cp2_tp2_ep2_mixtral", "cp2_pp2_ep2_mixtral")}


def cp2_refuses_labels(rank: int, world_size: int) -> dict[str, Any]:
    """A Hugging Face model given ``labels`` under cp (its loss would shift them inside each rank's
    chunks) is refused with a BatchError on every rank, before any forward."""
    plan, graph = plan_for(SPECS["cp2_llama"], world_size)
    torch.manual_seed(0)
    model, inputs = hf_llama()
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
    ids = torch.randint(0, 128, (2, 16))
    try:
        pm.train_step(pm.local_batch({"input_ids": ids, "labels": ids}))
    except BatchError as exc:
        message = str(exc)
    else:
        message = ""
    dist.barrier()
    return {"message": message, "local_shape": list(pm.local_batch(ids).shape)}


CASES["cp2_refuses_labels"] = cp2_refuses_labels


def cp2_warns_nothing(rank: int, world_size: int) -> dict[str, Any]:
    """Lowering cp (the data-parallel mesh flattened over dp × cp, asked for twice: at lowering and by the
    data-parallel pass) and one step (K/V all-gathered with autograd) warn nothing: no deprecated torch API."""
    import warnings

    plan, graph = plan_for(SPECS["cp2_gpt"], world_size)
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        pm.train_step(pm.local_batch(ids), pm.local_batch(ids.roll(-1, 1)))
    return {"warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


CASES["cp2_warns_nothing"] = cp2_warns_nothing


def uly_cp2_runs_all_to_alls(rank: int, world_size: int, spec: str = "uly_cp2_gpt") -> dict[str, Any]:
    """The Ulysses plan lowers to the head all-to-all, not the all-gather: one training step of the GPT
    (2 blocks, one SDPA each; or nanoGPT's 2 blocks, attention by hand) calls ``all_to_all_single_autograd``
    4 times a block in forward (q, k (kᵀ), v, the output; backward runs autograd's reverse all-to-alls; beside
    ep, ep's dispatch 2 more a block: the rows out to their experts' ranks and back) and
    ``all_gather_single_autograd`` never."""
    import torch.distributed._functional_collectives as fc

    plan, graph = plan_for(SPECS[spec], world_size)
    torch.manual_seed(0)
    model, inputs = SPECS[spec].build()
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
    calls = {"all_to_all": 0, "all_gather": 0}
    real_a2a, real_ag = fc.all_to_all_single_autograd, fc.all_gather_single_autograd

    def a2a(*a: Any, **k: Any) -> Any:
        calls["all_to_all"] += 1
        return real_a2a(*a, **k)

    def ag(*a: Any, **k: Any) -> Any:
        calls["all_gather"] += 1
        return real_ag(*a, **k)

    fc.all_to_all_single_autograd, fc.all_gather_single_autograd = a2a, ag
    try:
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        pm.train_step(pm.local_batch(ids), pm.local_batch(ids.roll(-1, 1)))
    finally:
        fc.all_to_all_single_autograd, fc.all_gather_single_autograd = real_a2a, real_ag
    return {"calls": calls, "method": str(plan.cp_attention), "ulysses": pm.lowered.context.ulysses}


CASES["uly_cp2_runs_all_to_alls"] = uly_cp2_runs_all_to_alls
CASES["uly_cp2_nanogpt_runs_all_to_alls"] = lambda rank, world_size: uly_cp2_runs_all_to_alls(rank, world_size,
                                                                                             "uly_cp2_nanogpt")
CASES["uly_cp2_ep2_nanogpt_moe_runs_all_to_alls"] = lambda rank, world_size: uly_cp2_runs_all_to_alls(
    rank, world_size, "uly_cp2_ep2_nanogpt_moe")
