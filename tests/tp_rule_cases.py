"""Cases for :mod:`distributed`: code people write whose tensor parallelism needed a sharding rule
(issue 41 item 3), trained at tp=2 against one process (see :mod:`equivalence_cases`).

Meta's reference Llama (complex rotary embeddings through ``view_as_complex``) with grouped key/value
heads, gpt-oss (a per-head attention sink concatenated to the scores), Llama 4 (an MoE router outside
every column → row group, run whole), Qwen2-MoE (its shared expert's scalar sigmoid gate, run whole) and
a plain GPT as long as it is wide (a size with two roles), built small, their blocks
pinned to the Megatron style the simulation proved; the numbers must match one device within 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import outside_matrix_cases as outside
import torch
import torch.nn as nn
import zoo
from batch_coupling_cases import switch_dropping8
from equivalence_cases import PP1, Spec, equivalence
from meta_models import meta_llama
from moe_cases import hf_qwen2_moe
from moe_layouts import titan_moe


def gpt_oss() -> tuple[nn.Module, tuple]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, use_cache=False, tie_word_embeddings=False,
                                    max_position_embeddings=64, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    return transformers.GptOssForCausalLM(cfg), (torch.zeros(2, 16, dtype=torch.long),)


def llama4() -> tuple[nn.Module, tuple]:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.Llama4TextConfig(vocab_size=128, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        num_local_experts=4, num_experts_per_tok=1, use_cache=False,
                                        max_position_embeddings=64, interleave_moe_layer_step=1, no_rope_layers=[1, 1],
                                        attention_chunk_size=64)
    return transformers.Llama4ForCausalLM(cfg), (torch.zeros(2, 16, dtype=torch.long),)


def plain_gpt_64() -> tuple[nn.Module, tuple]:
    import plain_gpt  # examples/, on the path equivalence_cases sets

    return plain_gpt.GPT(vocab=256, width=64, heads=4, layers=2, seq=64), (torch.zeros(2, 64, dtype=torch.long),)


def narrowed(case: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    """``case`` with the simulation's size limit below its blocks', so their proof is a narrower copy's."""
    def run(rank: int, world_size: int) -> dict[str, Any]:
        from autopar.sharding import check

        limit = check.MAX_CHECK_PARAMS
        check.MAX_CHECK_PARAMS = 10_000
        try:
            return case(rank, world_size)
        finally:
            check.MAX_CHECK_PARAMS = limit
    return run


MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], str]] = {
    "meta_llama_gqa": (lambda: meta_llama(n_kv_heads=2), "layers.*"),
    "gpt_oss_sinks": (gpt_oss, "model.layers.*"),
    # an MoE layer's router (Llama 4's, which picks its experts itself) beside its shared expert's group:
    # the router and the routed experts run whole on every rank
    "llama4_router": (llama4, "model.layers.*"),
    # Qwen2-MoE's shared expert scaled by a sigmoid of a [tokens, 1] gate projection, run whole as the router
    "qwen2_moe_gate": (hf_qwen2_moe, "model.layers.*"),
    # Mamba mixers (issue 41): in_proj column, the depthwise conv1d, dt_proj, A_log and D split on the
    # channels, x_proj a row inside the group (its partial sums all-reduced), out_proj row; Jamba's beside
    # its attention layer and an MoE in each, Hugging Face's MambaForCausalLM alone
    "jamba_mamba": (outside.jamba, "model.layers.*"),
    "hf_mamba": (lambda: zoo.build("hf_mamba"), "backbone.layers.*"),
    # a Switch block (issue 41): its fused QKV viewed [3, heads, head_dim] with no split before (retried as
    # three segments), its capacity router beside the attention's group, the routed experts whole
    "switch_fused_qkv": (switch_dropping8, "h.*"),
    # torchtitan's MoE, its block traced with the MoE as a stand-in (a routing loop that takes counts to
    # Python): the attention split, proved on the block itself, the MoE whole on every rank
    "titan_moe_block": (titan_moe, "layers.*"),
}
SPECS: dict[str, Spec] = {
    name: Spec(build, PP1 + ("dp=1", "tp=2", "zero=0", f"{blocks}:tp=megatron"), 4)
    for name, (build, blocks) in MODELS.items()
}
# a size with two roles: 64 wide at 64 positions; proved on a narrower copy (the path of a layer too
# large to simulate, taken here by lowering the limit while rank 0 captures) told apart at a second length
# Mamba under sequence parallelism: each rank's share of the sequence gathered before in_proj, out_proj's
# partial sums reduce-scattered back onto it (the per-channel parameters and x_proj's sum as without it)
SPECS["hf_mamba_sp"] = Spec(MODELS["hf_mamba"][0], PP1 + ("dp=1", "tp=2", "zero=0", "backbone.layers.*:tp=megatron",
                                                       "backbone.layers.*:sp=on"), 4)
# PyTorch's nn.TransformerDecoder: each decoder layer one layer (self-attention, cross-attention over the
# encoder's memory, MLP), its MLP column → row; batches as verify makes them (source and target ids)
SPECS["torch_decoder_layers"] = Spec(outside.torch_seq2seq, PP1 + ("dp=1", "tp=2", "zero=0",
                                     "decoder.layers.*:tp=megatron"), 4, synthetic=True)
SPECS["plain_gpt_seq_is_width"] = Spec(plain_gpt_64, PP1 + ("dp=1", "tp=2", "zero=0", "blocks.*:tp=megatron"), 4)
CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}
CASES["plain_gpt_seq_is_width"] = narrowed(CASES["plain_gpt_seq_is_width"])
