"""A repeated block stack exported once per kind of block gives the capture and the plan that
exporting every block gives, and exports only a short prefix of the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.capturing import capture
from autopar.stacks import stack_kinds

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # alternating sliding-window and full attention: two kinds of block, chosen by `layer_types`
    "qwen3_mixed": ("Qwen3Config", "Qwen3ForCausalLM",
                    dict(layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"],
                         sliding_window=8, use_sliding_window=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
}


def _build(case: str, device: str = "meta"):
    config_name, cls_name, extra = CASES[case]
    config = getattr(transformers, config_name)(**SMALL, **extra)
    with torch.device(device):
        return getattr(transformers, cls_name)(config), (torch.zeros(2, 16, dtype=torch.long),)


def _exported_depths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    depths: list[int] = []
    real = torch.export.export

    def counting(model, *args, **kwargs):
        depths.append(len(model.model.layers))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    return depths


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_once_per_kind_captures_what_the_whole_export_captures(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _build(case)
    whole = capture(model, inputs, trace_once_per_kind=False)
    depths = _exported_depths(monkeypatch)
    fast = capture(model, inputs)
    assert depths and max(depths) < 5  # only a prefix of the 5 blocks was ever exported
    assert fast.to_dict() == whole.to_dict()  # layers, edges, costs, styles, tracer
    assert fast.tracer == "export-layers"
    assert [layer.name for layer in fast.layers if layer.name.startswith("model.layers.")] == \
        [f"model.layers.{i}" for i in range(5)]
    plans = [autopar.solve(g, 8, cluster="h100-80g", global_batch=16) for g in (fast, whole)]
    a, b = (dataclasses.replace(p, solver=dataclasses.replace(p.solver, wall_s=0.0)).to_dict() for p in plans)
    assert a == b


def test_blocks_of_two_kinds_are_told_apart_by_layer_types() -> None:
    model, _ = _build("qwen3_mixed")
    assert stack_kinds(model, model.model.layers) == [0, 1, 0, 1, 0]
    model, _ = _build("llama")
    assert stack_kinds(model, model.model.layers) == [0] * 5


@pytest.mark.slow
def test_on_real_tensors_too_and_the_model_is_left_whole() -> None:
    model, inputs = _build("llama", "cpu")
    assert capture(model, inputs).to_dict() == capture(model, inputs, trace_once_per_kind=False).to_dict()
    assert len(model.model.layers) == 5 and model.config.num_hidden_layers == 5


@pytest.mark.slow
def test_a_block_with_a_hook_is_exported_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _build("llama")
    handle = model.model.layers[3].register_forward_hook(lambda *a: None)
    depths = _exported_depths(monkeypatch)
    capture(model, inputs)
    handle.remove()
    assert depths[0] == 5  # the hook could make block 3 differ: no prefix


def test_renaming_moves_only_the_block_prefix() -> None:
    from autopar.capturing.stack_once import _rename

    path = "model.layers"
    assert _rename("model.layers.1", path, 1, 7) == "model.layers.7"
    assert _rename("model.layers.1.self_attn.q_proj", path, 1, 7) == "model.layers.7.self_attn.q_proj"
    assert _rename("model.layers.1@2", path, 1, 7) == "model.layers.7@2"
    for other in ("model.layers.10.mlp", "model.layers.1x", "xmodel.layers.1", "model.layers", ""):
        assert _rename(other, path, 1, 7) == other


def test_capture_exports_record_no_stack_traces_and_restore_the_setting() -> None:
    from autopar.capturing.export_layers import no_stack_traces

    before = torch.fx.config.do_not_emit_stack_traces
    with no_stack_traces():
        ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), strict=False)
    assert torch.fx.config.do_not_emit_stack_traces == before
    assert not any(n.meta.get("stack_trace") for n in ep.graph.nodes)


def test_capture_exports_on_a_torch_without_the_stack_trace_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 (a GPU machine's image) has no ``fx.config.do_not_emit_stack_traces``: export as always."""
    import types

    from autopar.capturing import export_layers

    monkeypatch.setattr(export_layers, "fx", types.SimpleNamespace(config=types.SimpleNamespace()))
    before = torch.fx.config.do_not_emit_stack_traces
    with export_layers.no_stack_traces():
        ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), strict=False)
    assert len(list(ep.graph.nodes)) > 2 and torch.fx.config.do_not_emit_stack_traces == before
