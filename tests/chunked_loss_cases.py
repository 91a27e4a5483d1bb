"""Chunked-loss cases for :mod:`distributed`: plans whose loss runs in chunks, against one process.

Same protocol and case factory as :mod:`equivalence_cases` (the reference trains the unsharded model
with the default loss on the whole logits). Every plan pins ``loss=chunked`` (a PinError if it were
not offered), and the chunk is made a few tokens (:data:`autopar.contract_loss.CHUNK_LOGITS_BYTES`
lowered inside the case) so that every microbatch runs several chunks, the last one short.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from equivalence_cases import Spec, equivalence, gpt_tiny, hf_llama, plan_for

import autopar.contract_loss as contract_loss

CHUNK_TOKENS = 7  # 32 tokens a microbatch of 2 × 16: chunks of 7, 7, 7, 7 and 4


def hf_llama_tied() -> tuple[torch.nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(cfg), (torch.zeros(2, 16, dtype=torch.long),)


def chunked(spec: Spec, vocab: int) -> Callable[[int, int], dict[str, Any]]:
    """``spec``'s equivalence case with chunks of :data:`CHUNK_TOKENS` tokens; records the plan's loss."""
    case = equivalence(spec)

    def run(rank: int, world_size: int) -> dict[str, Any]:
        before = contract_loss.CHUNK_LOGITS_BYTES
        contract_loss.CHUNK_LOGITS_BYTES = 4 * vocab * CHUNK_TOKENS
        try:
            metrics = case(rank, world_size)
            metrics["loss_kind"] = plan_for(spec, world_size)[0].training.loss.value
            metrics["chunk_tokens"] = contract_loss.loss_chunk_tokens(vocab)
        finally:
            contract_loss.CHUNK_LOGITS_BYTES = before
        return metrics

    return run


PP1 = ("pp=1", "recompute=none", "loss=chunked")
PP2 = ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "schedule=1f1b", "microbatches=2", "loss=chunked")

SPECS: dict[str, tuple[Spec, int]] = {
    "chunk_ddp_gpt": (Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=0", "microbatches=1"), 4, adam=True), 256),
    "chunk_zero3_gpt": (Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=2"), 8), 256),
    "chunk_zero3_llama": (Spec(hf_llama, PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4), 128),
    "chunk_zero3_llama_tied": (Spec(hf_llama_tied, PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4), 128),
    "chunk_pp2_gpt": (Spec(gpt_tiny, PP2, 4), 256),
    "chunk_pp2_llama": (Spec(hf_llama, PP2, 4), 128),
}

CASES = {name: chunked(spec, vocab) for name, (spec, vocab) in SPECS.items()}
