"""Held-out model families whose tensor-parallel styles used to fail: each is now proved (and what is
proved is what the mesh runs) or refused with the op named.

Hugging Face classes built from tiny configs (never downloaded), captured as a user would; the
verdict read from the layer's styles or its ``tp_refusal``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.sharding import check as shard_check

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB = 128


def _ids() -> tuple[torch.Tensor]:
    return (torch.zeros(2, 8, dtype=torch.long),)


def _block(model: nn.Module, name: str):
    torch.manual_seed(0)
    return autopar.capture(model, _ids()).layer(name)


def _check(module: nn.Module, x: torch.Tensor, cols, rows, degrees=(2,)):
    gen = torch.Generator().manual_seed(0)
    copy = shard_check.layer_copy(module, gen)
    widths = {c: copy.get_submodule(c).out_features for c in cols}
    inputs = shard_check.real_inputs(((x,), {}))
    return shard_check.check_style(copy, inputs, tuple(cols), tuple(rows), widths,
                                   lambda divs: [t for t in degrees if all(d % t == 0 for d in divs)])


# ------------------------------------------------------------------ pattern 6: what is proved is what runs


class _MatmulLinear(nn.Linear):
    """Falcon's linear: ``x @ weight.T + bias`` instead of ``F.linear``."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class _WeightPeek(nn.Linear):
    """A projection whose forward reads its weight some other way: no rule can shard that."""

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight) + self.bias


class _Mlp(nn.Module):
    def __init__(self, cls: type[nn.Linear]) -> None:
        super().__init__()
        self.up, self.down = cls(16, 32), cls(32, 16)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def test_a_projection_written_as_x_at_weight_t_plus_bias_is_sharded_not_run_whole() -> None:
    result = _check(_Mlp(_MatmulLinear), torch.randn(2, 6, 16), ["up"], ["down"])
    assert result.ok, result.reason
    assert result.divisors == (32,)  # the rule split ``up``: tp must divide its 32 outputs


def test_a_projection_that_reads_its_weight_outside_the_rules_is_refused_naming_it() -> None:
    """Before, such a layer ran each simulated rank whole (right numbers, nothing sharded) and was
    offered; on the mesh its weight was a shard and the step crashed."""
    result = _check(_Mlp(_WeightPeek), torch.randn(2, 6, 16), ["up"], ["down"])
    assert not result.ok
    assert result.reason.startswith("up: einsum: its forward uses its weight or bias outside")


def _falcon(multi_query: bool) -> nn.Module:
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    multi_query=multi_query, parallel_attn=True, new_decoder_architecture=False,
                                    alibi=False, use_cache=False, tie_word_embeddings=False, hidden_dropout=0.0,
                                    attention_dropout=0.0)
    return transformers.FalconForCausalLM(cfg)


@pytest.mark.slow
def test_falcon_parallel_block_with_multi_query_is_refused_with_the_op_not_offered() -> None:
    layer = _block(_falcon(True), "transformer.h.0")
    assert "megatron" not in [s.name for s in layer.tp_styles]
    named = r"tensor parallelism withdrawn: (__getitem__: advanced indexing|view: splits the sharded dimension)"
    assert re.match(named, layer.tp_refusal), layer.tp_refusal  # refused, the op named


@pytest.mark.slow
def test_falcon_parallel_block_without_multi_query_is_proved_through_its_own_linear() -> None:
    layer = _block(_falcon(False), "transformer.h.0")
    style = layer.tp_style("megatron")
    assert style.checked == (2, 4) and not layer.tp_refusal


# ------------------------------------------------------------------ pattern 3: multi-head latent attention


def _deepseek(dense: int) -> nn.Module:
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=dense, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    return transformers.DeepseekV3ForCausalLM(cfg)


@pytest.mark.slow
def test_mla_is_sharded_by_heads_after_its_low_rank_up_projections() -> None:
    layer = _block(_deepseek(1), "model.layers.0")
    style = layer.tp_style("megatron")
    attn = "model.layers.0.self_attn"
    assert style.column[:2] == (f"{attn}.q_b_proj", f"{attn}.kv_b_proj")  # the up-projections
    assert style.row[0] == f"{attn}.o_proj"
    assert not {f"{attn}.q_a_proj", f"{attn}.kv_a_proj_with_mqa"} & set(style.column + style.row)  # run whole
    assert style.checked == (2, 4)


class _Stack(nn.Module):
    """Two blocks of one class in a row: their layers are ``blocks.0`` and ``blocks.1``."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.slow
def test_deepseek_moe_block_splits_attention_and_shared_expert_and_keeps_routed_experts_whole() -> None:
    """The routed experts' grouped GEMM has no float64 kernel: the proof runs it one matmul per expert."""
    layer = _block(_deepseek(1), "model.layers.1")
    style = layer.tp_style("megatron")
    mlp = "model.layers.1.mlp"
    assert f"{mlp}.shared_experts.gate_proj" in style.column and f"{mlp}.shared_experts.down_proj" in style.row
    assert not any(".experts." in p or p.endswith(".gate") for p in style.column + style.row)
    assert style.checked == (2, 4) and not layer.tp_refusal


@pytest.mark.slow
def test_a_deepseek_moe_layer_too_large_to_simulate_is_proved_on_a_copy_of_its_own_kind() -> None:
    """Above the simulation limit the proof runs on a narrower copy built from the config. It is built at the
    layer's own index (at index 0 DeepSeek-V3's class builds a dense layer, with no shared expert to prove),
    with fewer routed experts (the style keeps them whole) and the model's experts kernel (grouped_mm)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=64, num_experts_per_tok=4,
        n_group=4, topk_group=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg)
    layer = autopar.capture(model, _ids()).layer("model.layers.1")
    assert sum(p.numel() for p in model.model.layers[1].parameters()) > shard_check.MAX_CHECK_PARAMS
    style = layer.tp_style("megatron")  # a KeyError naming the refusal if withdrawn
    mlp = "model.layers.1.mlp"
    assert f"{mlp}.shared_experts.gate_proj" in style.column and f"{mlp}.shared_experts.down_proj" in style.row
    assert not any(".experts." in p for p in style.column + style.row)
    assert style.checked == (2, 4, 8)


def test_the_narrower_copy_keeps_the_fewest_experts_its_routing_runs_with() -> None:
    from autopar.sharding.copies import _fewer_experts

    deepseek = {"n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
                "topk_group": 4}
    assert _fewer_experts(deepseek) == {"n_routed_experts": 16}  # two a group, top-8 within 4 groups
    assert _fewer_experts({"num_local_experts": 8, "num_experts_per_tok": 2}) == {"num_local_experts": 4}
    assert _fewer_experts({"num_experts": 60, "num_experts_per_tok": 4}) == {"num_experts": 10}  # a divisor
    assert _fewer_experts({"num_local_experts": 4, "num_experts_per_tok": 2}) == {}  # already the fewest
    assert _fewer_experts({"hidden_size": 64}) == {}


def test_a_layer_refused_for_an_error_in_its_own_code_names_the_op() -> None:
    """A batched (3-D × 3-D) grouped GEMM in the layer's own code: no float64 kernel, refused, the op named."""
    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
            self.mix = nn.Parameter(torch.randn(2, 16, 16) / 4)

        def forward(self, x):
            x = torch.nn.functional.grouped_mm(x, self.mix)  # one [T, 16] × [16, 16] per sample
            return self.down(torch.relu(self.up(x)))

    layer = autopar.capture(_Stack(Mixer), (torch.randn(2, 16, 16),)).layer("blocks.0")
    assert "megatron" not in [s.name for s in layer.tp_styles]
    assert layer.tp_refusal.startswith("tensor parallelism withdrawn: _grouped_mm: RuntimeError"), layer.tp_refusal


def test_a_layer_with_projections_but_no_group_says_which() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):  # two projections side by side: neither reads the other
            return self.a(x) + self.b(x)

    layer = autopar.capture(_Stack(Chain), (torch.randn(2, 6, 16),)).layer("blocks.0")
    assert not layer.tp_styles
    assert layer.tp_refusal.startswith("tensor parallelism not offered: no column → row projection group covers "
                                       "blocks.0.a, blocks.0.b")


@pytest.mark.slow
def test_a_scalar_gate_beside_a_group_runs_whole_and_keeps_tensor_parallelism() -> None:
    """Qwen2-MoE's shared expert: its output scaled by the sigmoid of a [tokens, 1] gate projection that
    reads the block's input; the gate runs whole on every rank, the expert is a column → row group."""
    class GatedShared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down, self.gate = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 1, bias=False)

        def forward(self, x):
            return x + torch.sigmoid(self.gate(x)) * self.down(torch.relu(self.up(x)))

    layer = autopar.capture(_Stack(GatedShared), (torch.randn(2, 6, 16),)).layer("blocks.0")
    style = next(s for s in layer.tp_styles if s.name == "megatron")
    assert style.column == ("blocks.0.up",) and style.row == ("blocks.0.down",), style
    assert not layer.tp_refusal


def test_blocks_of_convolutions_say_why_tensor_parallelism_leaves_them_whole_in_one_note() -> None:
    """A ResNet's blocks (convolutions, no linear projections): the plan says why tp does not split them,
    one note for the run of blocks, not one per block."""
    import zoo

    graph = autopar.capture(*zoo.build("resnet_bn"))
    why = ("tensor parallelism not offered: its convolutions (Conv2d) have no tensor-parallel rule (only linear "
           "projections in column → row groups are split)")
    assert {l.name for l in graph if l.tp_refusal == why} == {"conv1", "layer1.0", "layer1.1", "layer2.0", "layer2.1"}
    assert not graph.layer("fc").tp_refusal and not graph.layer("bn1").tp_refusal
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", pins=["tp=2", "pp=1"], global_batch=4)
    assert [n for n in plan.notes if why in n] == [f"conv1 … layer2.1 (5): {why}"]


# ------------------------------------------------------------------ pattern 1: fewer kv heads than tp


def _llama(kv_heads: int) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.slow
def test_one_kv_head_replicates_the_kv_projections_and_prices_them_whole() -> None:
    layer = _block(_llama(1), "model.layers.0")
    style = layer.tp_style("megatron")
    attn = "model.layers.0.self_attn"
    assert f"{attn}.k_proj" not in style.column and f"{attn}.v_proj" not in style.column
    assert f"{attn}.q_proj" in style.column and style.checked == (2, 4)
    sharded = layer.tp_style("megatron").sharded_params
    every = 32 * 32 * 2 + 32 * 64 * 3  # q, o and the MLP: the kv projections (2 × 32 × 8) stay whole
    assert sharded == every
    assert style.bwd_allreduce_count == 2 + 2  # the two row inputs' sums and the two kv gradients


@pytest.mark.slow
def test_as_many_kv_heads_as_tp_keeps_sharding_them() -> None:
    style = _block(_llama(2), "model.layers.0").tp_style("megatron")
    assert "model.layers.0.self_attn.k_proj" in style.column and style.checked == (2,)


# ------------------------------------------------------------------ pattern 2: a norm over the whole q/k


@pytest.mark.slow
def test_olmo2_norm_over_the_whole_query_is_computed_with_its_statistics_all_reduced() -> None:
    cfg = transformers.Olmo2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False)
    layer = _block(transformers.Olmo2ForCausalLM(cfg), "model.layers.0")
    style = layer.tp_style("megatron")
    assert style.checked == (2, 4), layer.tp_refusal
    # priced so: q_norm's and k_norm's statistics, one all-reduce each way beside the two pairs'
    assert (style.fwd_allreduce_count, style.bwd_allreduce_count) == (2 + 2, 2 + 2)
    assert style.fwd_allreduce_elems == 2 * 8 * 32 + 2 * 8  # two hidden states of 8 tokens, one value a token each


class _VarOverHeads(nn.Module):
    """A variance over the whole query width: not a plain sum, so not all-reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        return self.o(q / (q.var(-1, keepdim=True) + 1).sqrt())


def test_a_variance_over_the_sharded_dimension_is_still_refused() -> None:
    result = _check(_VarOverHeads(), torch.randn(2, 6, 16), ["q"], ["o"])
    assert not result.ok and result.reason.startswith("var: reduces over the sharded dimension")


# ------------------------------------------------------------------ pattern 4: ALiBi, per-head fused qkv


@pytest.mark.slow
def test_bloom_per_head_fused_qkv_and_alibi_scores_are_proved() -> None:
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, use_cache=False,
                                   tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
    layer = _block(transformers.BloomForCausalLM(cfg), "transformer.h.0")
    style = layer.tp_style("megatron")
    assert style.checked == (2, 4), layer.tp_refusal
    assert not style.segments  # [heads, 3, head_dim]: a contiguous share is whole heads' q, k and v


class _HeadsIntoBatch(nn.Module):
    """[batch, heads] merged into one dim and scored with a whole per-(batch, head) bias, as Bloom does."""

    def __init__(self, bias_rows: int) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)
        self.bias_rows = bias_rows

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2).reshape(b * 4, t, 4)
        bias = torch.arange(self.bias_rows * t, dtype=x.dtype).view(self.bias_rows, 1, t) / 10
        s = bias.baddbmm(q, q.transpose(1, 2)).softmax(-1)
        y = torch.bmm(s, q).view(b, 4, t, 4).transpose(1, 2).reshape(b, t, 16)
        return self.o(y)


def test_merging_batch_and_heads_keeps_every_samples_share() -> None:
    result = _check(_HeadsIntoBatch(2 * 4), torch.randn(2, 6, 16), ["q"], ["o"])
    assert result.ok and result.error < 1e-12, result.reason


def test_a_bias_shared_by_every_batch_and_head_needs_no_cut() -> None:
    result = _check(_HeadsIntoBatch(1), torch.randn(2, 6, 16), ["q"], ["o"])
    assert result.ok and result.error < 1e-12, result.reason


# ------------------------------------------------------------------ pattern 5: multi-query fused in one c_attn


@pytest.mark.slow
def test_gptbigcode_multi_query_fused_c_attn_runs_its_key_value_rows_whole() -> None:
    """q for every head and one shared k/v head in a single projection: each rank computes its share of
    the q rows and the whole k/v rows (Megatron-Core's and vLLM's answer), proved by simulation."""
    cfg = transformers.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                        multi_query=True, use_cache=False, tie_word_embeddings=False,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    layer = _block(transformers.GPTBigCodeForCausalLM(cfg), "transformer.h.0")
    style = next(s for s in layer.tp_styles if s.name == "megatron")
    c_attn = "transformer.h.0.attn.c_attn"
    assert style.segments[c_attn] == (32, 8, 8) and style.whole == {c_attn: (1, 2)}
    assert 2 in style.checked and 4 in style.checked and 48 not in style.divisors  # c_attn's width: not split
    # priced: c_attn held whole (only c_fc and the two row weights are split), three more backward sums
    # (key, value, and the query rows' weight gradient) beside the two pairs' all-reduces
    assert style.sharded_params == (32 * 128 + 128) + 128 * 32 + 32 * 32
    assert style.bwd_allreduce_count == 2 + 3
    assert style.sequence == () and "key/value rows run whole" in style.sequence_refusal


@pytest.mark.slow
def test_a_whole_segment_that_is_not_the_key_value_rows_is_refused() -> None:
    """Running the query rows whole instead would give every rank all heads while c_proj reads a share."""
    cfg = transformers.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                        multi_query=True, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0)
    block = transformers.GPTBigCodeForCausalLM(cfg).double().transformer.h[0]
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    sim = shard_check.simulate
    with pytest.raises(shard_check.NoShardRule):
        sim(block, ((x,), {}), ("attn.c_attn",), ("attn.c_proj",), {"attn.c_attn": (32, 8, 8)}, 2,
            torch.Generator().manual_seed(0), whole={"attn.c_attn": (0,)})
