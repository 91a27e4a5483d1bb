"""Mixture-of-experts layers: captured as written, priced at top-k experts per token, every expert held.

Reference counts are computed here from the configs (or by torch's own FLOP
counter on another code path), never from autopar's pricing.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import transformers
from torch.utils.flop_counter import FlopCounterMode

from autopar.capturing import capture
from autopar.capturing.op_costs import grouped_mm_flops
from autopar.experts import DEFAULT_IMBALANCE_MARGIN, Dispatch, ExpertLayout, RouterKind
from autopar.graph import LayerGraph
from autopar.planning.notes import moe_notes, unpriced_notes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _examples_moe():
    key = "autopar_examples_moe"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / "moe.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


VOCAB, B, T = 128, 2, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)


def _hf_moe(config_cls: type, model_cls: type, impl: str, **config: object) -> nn.Module:
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, intermediate_size=64, **config))
    model.config._experts_implementation = impl
    return model


def _mixtral(impl: str = "grouped_mm") -> nn.Module:
    return _hf_moe(transformers.MixtralConfig, transformers.MixtralForCausalLM, impl, num_key_value_heads=2,
                   num_local_experts=4, num_experts_per_tok=2)


def _qwen2_moe(impl: str = "grouped_mm") -> nn.Module:
    return _hf_moe(transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, impl, moe_intermediate_size=16,
                   shared_expert_intermediate_size=32, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)


def _deepseek(impl: str = "grouped_mm") -> nn.Module:
    return _hf_moe(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, impl, moe_intermediate_size=16,
                   first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
                   qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))


def _torch_count(model: nn.Module, tokens: torch.Tensor) -> float:
    """Forward FLOPs by torch's own counter on HF's eager path (a Python loop of F.linear per expert)."""
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    return float(counter.get_total_flops())


# ----------------------------------------------------------------------------- the grouped GEMM rule


def test_grouped_mm_rule_counts_every_group_once_in_each_form() -> None:
    sizes = [3, 0, 5]  # rows per group, one group empty
    m, k, n, g = sum(sizes), 8, 6, len(sizes)
    by_groups = sum(2 * rows * k * n for rows in sizes)
    assert grouped_mm_flops((m, k), (g, k, n), (g,), out_shape=(m, n)) == by_groups  # jagged M
    assert grouped_mm_flops((k, m), (m, n), (g,), out_shape=(g, k, n)) == 2 * k * m * n  # jagged K (weight grad)
    assert grouped_mm_flops((g, m, k), (g, k, n), out_shape=(g, m, n)) == g * 2 * m * k * n  # batched


# ----------------------------------------------------------------------------- Hugging Face MoEs


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe, _deepseek], ids=["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.slow
def test_hf_moe_is_priced_as_torch_counts_its_eager_loop(build) -> None:
    """Captured (grouped GEMM, static shapes) = torch's counter on HF's eager loop over real routing:
    dropless routing sends tokens × top-k rows to the experts whatever the balance."""
    tokens = _tokens()
    graph = capture(build(), (tokens,))
    assert graph.total_flops_per_sample * B == pytest.approx(_torch_count(build(), tokens), rel=1e-9)
    moe_layers = [l for l in graph if l.moe]
    assert moe_layers and all(f.dispatch is Dispatch.GROUPED for l in moe_layers for f in l.moe)
    assert not any(l.unpriced_ops for l in graph)


@pytest.mark.parametrize("build,experts,top_k,inter,shared,router", [
    (_mixtral, 4, 2, 64, 0, RouterKind.SOFTMAX_TOPK),
    (_qwen2_moe, 4, 2, 16, 3 * 32 * 32 + 32, RouterKind.SOFTMAX_TOPK),  # shared MLP + its sigmoid gate
    (_deepseek, 8, 2, 16, 3 * 32 * 16, RouterKind.SIGMOID_GROUPED),
], ids=["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.slow
def test_hf_moe_facts_and_every_expert_held(build, experts, top_k, inter, shared, router) -> None:
    model = build()
    graph = capture(model, (_tokens(),))
    layer = graph[[i for i, l in enumerate(graph) if l.moe][0]]
    (facts,) = layer.moe
    h = 32
    assert (facts.num_experts, facts.top_k, facts.router, facts.layout) == (experts, top_k, router,
                                                                            ExpertLayout.FUSED)
    assert facts.expert_params == 3 * h * inter and facts.routed_params == experts * 3 * h * inter
    assert facts.shared_params == shared and facts.router_params == experts * h
    assert facts.expert_flops_per_token == 2 * 3 * h * inter
    # memory: the layer holds every expert (and everything else of its module)
    assert layer.param_count == sum(p.numel() for p in model.get_submodule(layer.module_path).parameters())
    assert facts.routed_activation_bytes_per_sample > 0


@pytest.mark.slow
def test_hf_eager_experts_are_captured_through_grouped_mm_and_said_so() -> None:
    tokens = _tokens()
    model = _mixtral("eager")
    graph = capture(model, (tokens,))
    assert model.config._experts_implementation == "eager"  # restored: eager is what runs
    assert {f.dispatch for l in graph for f in l.moe} == {Dispatch.HF_EAGER}
    assert graph.total_flops_per_sample == pytest.approx(capture(_mixtral(), (tokens,)).total_flops_per_sample)
    (note,) = moe_notes(graph)
    assert "model.layers.0 … model.layers.1 (2)" in note and "HF's eager loop" in note


# ----------------------------------------------------------------------------- hand-written MoEs


def _gpt_moe_forward_flops(cfg: dict, moe_cfg: dict, tokens: int, seq: int, routed_rows: float) -> float:
    """Forward FLOPs of examples/moe.py's MoEGPT counted from its sizes: qkv and output projections,
    full T×T attention, the router, SwiGLU experts on ``routed_rows`` rows, the head."""
    d, layers, vocab = cfg["d"], cfg["layers"], cfg["vocab"]
    e, f = moe_cfg["num_experts"], moe_cfg["ffn"]
    per_layer = tokens * (2 * 4 * d * d + 4 * seq * d + 2 * d * e) + routed_rows * 2 * 3 * d * f
    return layers * per_layer + tokens * 2 * d * vocab


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.slow
def test_an_hf_moe_block_splits_its_attention_over_tp_and_keeps_its_experts_whole(device) -> None:
    """The proof runs the grouped GEMM one matmul per expert in float64 and by shape on meta (the kernels
    refuse both); the style's split FLOPs and weights are the attention's alone."""
    model = _mixtral()
    if device == "meta":
        model = model.to("meta")
    layer = capture(model, (_tokens().to(device),)).layer("model.layers.0")
    style = {s.name: s for s in layer.tp_styles}["megatron"]
    attention = sum(p.numel() for p in model.model.layers[0].self_attn.parameters())
    assert style.sharded_params == attention and not layer.tp_refusal
    assert all(".self_attn." in p for p in style.column + style.row)
    tokens = T  # per sample: q, o (H × H), k, v (H × H/2), QKᵀ and AV (2 · T · H each), 2 FLOPs a multiply-add
    assert style.sharded_flops_per_sample == 2 * tokens * (2 * 32 * 32 + 2 * 32 * 16) + 2 * 2 * tokens * tokens * 32
    assert style.sharded_flops_per_sample < layer.flops_per_sample / 3  # the experts' FLOPs are not split


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.slow
def test_module_list_loop_moe_priced_at_top_k_experts_per_token(device) -> None:
    ex = _examples_moe()
    model, inputs = ex.loop_moe_tiny(device)
    graph = capture(model, inputs)
    tokens = inputs[0].numel()
    expected = _gpt_moe_forward_flops(ex.TINY, ex.TINY_MOE, tokens, inputs[0].shape[1],
                                      tokens * ex.TINY_MOE["top_k"])
    assert graph.total_flops_per_sample * inputs[0].shape[0] == pytest.approx(expected, rel=1e-9)
    facts = graph.layer("blocks.0").moe[0]
    assert facts.layout is ExpertLayout.MODULE_LIST and facts.num_experts == 4 and facts.top_k == 2
    assert graph.layer("blocks.0").param_count == sum(p.numel() for p in model.blocks[0].parameters())
    if device == "meta":  # torch.where's data-dependent shapes cannot run on meta: a stand-in, said so
        assert facts.dispatch is Dispatch.STAND_IN
        assert not graph.layer("blocks.0").tp_styles
        assert "traced whole" in graph.layer("blocks.0").tp_refusal
        assert any("priced from its structure" in n for n in moe_notes(graph))
    else:
        assert facts.dispatch is Dispatch.LOOP and facts.routed_activation_bytes_per_sample > 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.slow
def test_capacity_einsum_moe_priced_as_written(device) -> None:
    """GShard/Switch dispatch: every expert runs its full capacity, and dispatch and combine are
    einsums over [tokens, E, capacity]; all of it is work the model does."""
    ex = _examples_moe()
    model, inputs = ex.capacity_moe_tiny(device)
    graph = capture(model, inputs)
    tokens, seq = inputs[0].numel(), inputs[0].shape[1]
    e, f, k, d = (ex.TINY_MOE[x] for x in ("num_experts", "ffn", "top_k", "d"))
    capacity = math.ceil(1.25 * tokens * k / e)
    per_layer = (tokens * (2 * 4 * d * d + 4 * seq * d + 2 * d * e)
                 + 2 * (2 * tokens * e * capacity * d)  # dispatch and combine einsums
                 + e * capacity * 2 * 2 * d * f)  # w_in and w_out on every slot
    expected = ex.TINY["layers"] * per_layer + tokens * 2 * d * ex.TINY["vocab"]
    assert graph.total_flops_per_sample * inputs[0].shape[0] == pytest.approx(expected, rel=1e-9)
    facts = graph.layer("blocks.0").moe[0]
    assert facts.capacity_factor == 1.25 and facts.dispatch is Dispatch.CAPACITY
    assert facts.activation_margin(ep=8) == 1.0  # the capacity buffers are the model's own, measured


@pytest.mark.slow
def test_imbalance_margin_only_where_a_rank_holds_a_share_of_dropless_experts() -> None:
    graph = capture(_mixtral(), (_tokens(),))
    facts = graph.layer("model.layers.0").moe[0]
    assert facts.activation_margin(ep=1) == 1.0 and facts.activation_margin(ep=2) == DEFAULT_IMBALANCE_MARGIN


@pytest.mark.slow
def test_moe_facts_survive_the_graph_file() -> None:
    graph = capture(_deepseek(), (_tokens(),))
    again = LayerGraph.from_dict(graph.to_dict())
    assert [l.moe for l in again] == [l.moe for l in graph]
    assert [l.cost_signature() for l in again] == [l.cost_signature() for l in graph]


# ----------------------------------------------------------------------------- ops with no FLOP rule


@torch.library.custom_op("autopar_test::mystery_mm", mutates_args=())
def _mystery_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@_mystery_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


class _Mystery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return torch.ops.autopar_test.mystery_mm(x, self.w)


def test_an_op_with_no_flop_rule_is_a_note_not_a_silent_zero() -> None:
    graph = capture(_Mystery(), (torch.randn(4, 8),))
    flagged = [l for l in graph if l.unpriced_ops]
    assert [l.unpriced_ops for l in flagged] == [("autopar_test::mystery_mm",)]
    (note,) = unpriced_notes(graph)
    assert "autopar_test::mystery_mm has no FLOP rule" in note


# ----------------------------------------------------------------------------- full-size models, on meta


def _mixtral_reference(c, seq: int) -> float:
    """Training FLOPs per token of Mixtral from its config: 6 · N_active (embedding lookups excluded,
    the head included) + attention scores 12 · layers · seq · heads · head_dim (full T×T)."""
    head_dim = c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    experts = c.num_experts_per_tok * 3 * c.hidden_size * c.intermediate_size
    router = c.num_local_experts * c.hidden_size
    active = c.num_hidden_layers * (attn + experts + router) + c.vocab_size * c.hidden_size
    return 6 * active + 12 * c.num_hidden_layers * seq * c.num_attention_heads * head_dim


def _deepseek_reference(c, seq: int) -> float:
    """The same for DeepSeek-V3: multi-head latent attention's projections, three dense layers, then
    MoE layers of top-8 routed experts + the shared expert + the router."""
    h, nh = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    attn = (h * c.q_lora_rank + c.q_lora_rank * nh * qk + h * (c.kv_lora_rank + c.qk_rope_head_dim)
            + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim) + nh * c.v_head_dim * h)
    dense = 3 * h * c.intermediate_size
    moe = (c.num_experts_per_tok + c.n_shared_experts) * 3 * h * c.moe_intermediate_size + c.n_routed_experts * h
    k = c.first_k_dense_replace
    active = c.num_hidden_layers * attn + k * dense + (c.num_hidden_layers - k) * moe + c.vocab_size * h
    return 6 * active + 6 * c.num_hidden_layers * seq * nh * (2 * qk + 2 * c.v_head_dim) / 2


@pytest.mark.parametrize("name,reference", [("mixtral_8x7b", _mixtral_reference),
                                            ("deepseek_v3", _deepseek_reference)])
@pytest.mark.slow
def test_full_size_flops_per_token_within_5_percent_of_6_n_active_plus_attention(name, reference) -> None:
    seq = 4096
    model, inputs = getattr(_examples_moe(), name)(seq)
    graph = capture(model, inputs)
    per_token = 3 * graph.total_flops_per_sample / seq  # forward + backward (2×)
    assert per_token == pytest.approx(reference(model.config, seq), rel=0.05)
