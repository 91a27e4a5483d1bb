"""Cases for :mod:`distributed`: Hugging Face families whose tensor-parallel styles used to fail
(issue 20's six patterns), trained at tp=2 against one process (see :mod:`equivalence_cases`).

Each model is built from a tiny config (never downloaded), its blocks pinned to the Megatron style
the simulation proved; the numbers must match one device within 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from equivalence_cases import PP1, Spec, equivalence

VOCAB = 128


def _hf(cls_name: str, config_name: str, **cfg: Any) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import transformers

        transformers.logging.set_verbosity_error()
        config = getattr(transformers, config_name)(**cfg)
        return getattr(transformers, cls_name)(config), (torch.zeros(2, 8, dtype=torch.long),)
    return build


COMMON = dict(vocab_size=VOCAB, use_cache=False, tie_word_embeddings=False)
MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], str]] = {
    # pattern 1: one key/value head (multi-query) at tp=2: the key/value projections run whole
    "llama_mqa": (_hf("LlamaForCausalLM", "LlamaConfig", **COMMON, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=64), "model.layers.*"),
    "qwen2_mqa": (_hf("Qwen2ForCausalLM", "Qwen2Config", **COMMON, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=64), "model.layers.*"),
    # pattern 2: RMSNorm over the whole query and key projections, its statistics all-reduced
    "olmo2_qk_norm": (_hf("Olmo2ForCausalLM", "Olmo2Config", **COMMON, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=64), "model.layers.*"),
    # pattern 3: multi-head latent attention (DeepSeek-V3's dense layers), sharded by heads after
    # the low-rank up-projections
    "deepseek_mla": (_hf("DeepseekV3ForCausalLM", "DeepseekV3Config", **COMMON, hidden_size=32,
                         intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                         first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                         kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         max_position_embeddings=64), "model.layers.*"),
    # pattern 4: ALiBi with a fused query_key_value laid out [heads, 3, head_dim]: each rank's rows are
    # its heads' q, k, v; the scores' [batch × heads] dim holds every sample's share of the heads
    "bloom_alibi": (_hf("BloomForCausalLM", "BloomConfig", **COMMON, hidden_size=32, n_layer=2, n_head=4,
                        hidden_dropout=0.0, attention_dropout=0.0), "transformer.h.*"),
    # pattern 5: multi-query attention fused in one c_attn: each rank its share of the query rows, the
    # key/value rows whole
    "gptbigcode_mqa": (_hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", **COMMON, n_embd=32, n_layer=2, n_head=4,
                           n_positions=64, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                       "transformer.h.*"),
    # pattern 6: Falcon's parallel attention/MLP block, its linears written as x @ W.T + b
    "falcon_parallel": (_hf("FalconForCausalLM", "FalconConfig", **COMMON, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, multi_query=False, parallel_attn=True, bias=True,
                            new_decoder_architecture=False, alibi=False, hidden_dropout=0.0,
                            attention_dropout=0.0), "transformer.h.*"),
}

SPECS: dict[str, Spec] = {
    name: Spec(build, PP1 + ("dp=1", "tp=2", "zero=0", f"{blocks}:tp=megatron"), 4)
    for name, (build, blocks) in MODELS.items()
}
# sequence parallelism where the simulation offers it: the norm's statistics all-reduced on head shares
SPECS["olmo2_qk_norm/sp"] = Spec(MODELS["olmo2_qk_norm"][0], PP1 + (
    "dp=1", "tp=2", "zero=0", "model.layers.*:tp=megatron", "model.layers.*:sp=on"), 4)
CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}
