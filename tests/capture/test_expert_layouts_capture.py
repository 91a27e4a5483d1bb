"""Routed experts recognised by what they compute and how their block calls them (``autopar.experts``),
whatever a library names their weights; the call proved splittable by expert before ep is offered."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_layouts  # noqa: E402

import autopar  # noqa: E402
from autopar.capturing.moe import find_blocks  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.experts import Call  # noqa: E402
from autopar.experts.layouts import hidden_split_refusal, identify  # noqa: E402


def test_each_layout_is_named_and_its_call_recorded() -> None:
    for name, (weights, call, stacked, shared) in {
        "titan_moe": ("torchtitan", Call.GROUPED, ("w1", "w2", "w3"), True),
        "gpt_oss": ("gpt-oss", Call.INDEXED, ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
                    False),
        "llama4": ("llama4", Call.BLOCKED, ("gate_up_proj", "down_proj"), True),
    }.items():
        torch.manual_seed(0)
        model, _ = moe_layouts.LAYOUT_MODELS[name]()
        blocks = find_blocks(model)
        assert len(blocks) == 2, name
        for b in blocks:
            assert (b.weights, b.call, b.per_expert, bool(b.shared_paths), b.reroute_refusal) == \
                (weights, call, stacked, shared, ""), (name, b)
            experts = model.get_submodule(b.experts_path)
            layout = identify(experts, str(b.call))
            assert layout.name == weights and layout.call is call
            # only Hugging Face's fused layout is split across its hidden dim, the others say which they are
            assert layout.library in hidden_split_refusal(experts)


def test_a_hybrid_mamba_family_takes_no_conv1d_for_experts() -> None:
    """Jamba (Mamba mixers, attention, MoE): a mixer's conv1d [C, 1, K] beside its dt_proj [C, R] once read
    as C experts and their router; a single 3-D weight is no per-expert GEMM chain."""
    import transformers

    cfg = transformers.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                   expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                                   attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                                   mamba_dt_rank=4, use_cache=False)
    blocks = find_blocks(transformers.JambaForCausalLM(cfg))
    assert [b.experts_path for b in blocks] == [f"model.layers.{i}.feed_forward.experts" for i in range(2)]
    assert all(b.call is Call.INDEXED and b.weights == "hf-fused" and not b.reroute_refusal for b in blocks)


class _MixingExperts(moe_layouts.GroupedExperts):
    """torchtitan's experts with a forward that centres the rows it is called with: a row's output depends on
    the other rows of the call, so no split of the experts over ranks computes it."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out = super().forward(x, num_tokens_per_expert)
        return out - out.mean(dim=0, keepdim=True)


def test_experts_whose_split_changes_their_numbers_are_refused_ep_at_plan_time_and_still_run_data_parallel() -> None:
    torch.manual_seed(0)
    model, inputs = moe_layouts.titan_moe()
    for layer in model.layers:
        old = layer.moe.experts
        layer.moe.experts = _MixingExperts(32, 16, 4, use_grouped_mm=False)
        layer.moe.experts.load_state_dict(old.state_dict())
    graph = autopar.capture(model, inputs)
    facts = [m for layer in graph for m in layer.moe]
    assert len(facts) == 2 and all("other outputs than its own forward" in m.ep_refusal for m in facts)
    assert all("torchtitan" in m.ep_refusal and m.call is Call.GROUPED for m in facts), facts
    with pytest.raises(AutoparError) as refused:
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4, pins=["dp=2", "ep=2"])
    assert "\n" not in str(refused.value) and "torchtitan" in str(refused.value), refused.value
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4, pins=["dp=2", "zero=3"])
    assert plan.mesh.dp == 2 and plan.mesh.ep == 1


def test_splitting_experts_of_another_layout_across_tp_is_refused_at_plan_time_naming_it() -> None:
    torch.manual_seed(0)
    model, inputs = moe_layouts.titan_moe()
    graph = autopar.capture(model, inputs)
    with pytest.raises(AutoparError) as refused:
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4,
                      pins=["tp=2", "dp=1", "layers.*:tp=megatron+experts"])
    assert "\n" not in str(refused.value) and "torchtitan" in str(refused.value), refused.value


@pytest.mark.slow
def test_a_torchtitan_moe_built_on_meta_is_captured_and_offered_ep() -> None:
    """torchtitan's router counts its tokens with ``bincount`` (no meta kernel) and its experts' loop takes
    the counts to Python: on meta the block runs as a balanced stand-in (the router's projection, the
    experts called as torchtitan calls them with real CPU counts), priced as the CPU capture prices it."""
    graphs = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model, inputs = moe_layouts.titan_moe()
        graphs[device] = autopar.capture(model, inputs)
    cpu, meta = graphs["cpu"], graphs["meta"]
    assert [l.name for l in meta] == [l.name for l in cpu]
    for a, b in zip(cpu, meta):
        assert a.param_count == b.param_count and a.can_cut_after == b.can_cut_after
        assert b.flops_per_sample == pytest.approx(a.flops_per_sample, rel=0.05), a.name  # balanced vs routed
    assert [(m.weights, m.call, m.ep_refusal) for l in meta for m in l.moe] == [("torchtitan", Call.GROUPED, "")] * 2
    plan = autopar.solve(meta, 2, cluster="cpu", dtype="fp32", global_batch=4,
                         pins=["pp=1", "tp=1", "zero=3", "dp=2", "microbatches=2", "ep=2", "recompute=none"])
    assert plan.mesh.ep == 2
