"""Context-parallel cases for :mod:`distributed`: the project's GPT and a tiny Hugging Face Llama trained
under cp against one process.

Each case is an :func:`equivalence_cases.equivalence` case (3 SGD-with-momentum steps and 3 AdamW steps:
losses, first-step gradients and final parameters against the unsharded model on the whole global batch,
fp32 on gloo) on a plan with cp pinned. Every rank holds its head and tail chunk of each sequence
(``passes/context_parallel.py``), attention all-gathers K and V over the cp group, and the GPT's
``pos_emb`` / Llama's ``rotary_emb`` get the global positions of the rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from equivalence_cases import Spec, equivalence, gpt_tiny, plan_for

import autopar
from autopar.errors import BatchError

TOKENS = (torch.zeros(2, 16, dtype=torch.long),)


def hf_llama() -> tuple[nn.Module, tuple]:
    """A two-layer Llama (SDPA attention, grouped-query: 4 heads over 2 key/value heads, rotary positions)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg), TOKENS


def _pins(cp: int, dp: int = 1, zero: int = 0, recompute: str = "none") -> tuple[str, ...]:
    return ("pp=1", "tp=1", f"dp={dp}", f"cp={cp}", f"zero={zero}", f"recompute={recompute}", "microbatches=1")


SPECS: dict[str, Spec] = {
    "cp2_gpt": Spec(gpt_tiny, _pins(2), 2),
    "cp2_llama": Spec(hf_llama, _pins(2), 2),
    # recompute re-runs the forward in backward: the attention mode must hold there too
    "cp2_recompute_gpt": Spec(gpt_tiny, _pins(2, recompute="full"), 2),
    "cp4_gpt": Spec(gpt_tiny, _pins(4), 2),
    "cp4_llama": Spec(hf_llama, _pins(4), 2),
    # dp × cp: gradients average over the 4 ranks; ZeRO-3 shards every weight over them (dp_shard_cp)
    "cp2_dp2_zero3_gpt": Spec(gpt_tiny, _pins(2, dp=2, zero=3), 4),
    "cp2_dp2_llama": Spec(hf_llama, _pins(2, dp=2), 4),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}


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
