"""Issue 23, items 2–3 in one process: any inputs a model takes, a default loss that fits its output.

The models are Hugging Face's (Qwen3, ViT from small configs) and the zoo's
ResNet as torchvision writes it; the parallel runs of the same are in
test_zoo_inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from zoo import build

import autopar
from autopar import contract
from autopar.choice import Recompute
from autopar.errors import InputsError, LossError, PinError
from autopar.runtime.loss import default_loss, pick_loss
from autopar.tools.batches import synthetic_batch


def test_the_default_loss_fits_logits_classes_a_models_own_loss_and_a_tuple() -> None:
    from transformers.modeling_outputs import CausalLMOutput

    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    assert "at every position" in pick_loss(logits, tokens).name
    expected = nn.functional.cross_entropy(logits.reshape(-1, 7), tokens.reshape(-1))
    assert torch.equal(default_loss(CausalLMOutput(logits=logits), tokens), expected)
    classes = torch.randn(2, 10)
    assert pick_loss(classes, torch.tensor([3, 4])).name.startswith("cross-entropy over 10 classes")
    own = CausalLMOutput(loss=torch.tensor(1.25), logits=logits)
    assert "model's own loss" in pick_loss(own, None).name and default_loss(own, None).item() == 1.25
    hidden = (torch.zeros(1), torch.zeros(1))
    assert torch.equal(default_loss((logits, hidden), tokens), expected)  # a tuple: its first tensor
    assert pick_loss(classes, torch.randn(2, 10)).name.startswith("mean squared error")


@pytest.mark.parametrize("output, targets", [
    (torch.randn(2, 10), torch.randint(0, 10, (2, 16))),  # classes against per-token targets
    ({"a": 3}, torch.zeros(2)),  # nothing to compare
    (torch.randn(2, 10), None),  # no targets and no .loss
])
def test_an_output_no_default_loss_fits_is_one_line_asking_for_a_loss_function(output, targets) -> None:
    with pytest.raises(LossError) as err:
        default_loss(output, targets)
    assert "pass a loss function" in str(err.value) and "\n" not in str(err.value)


def test_a_routers_auxiliary_loss_is_never_dropped_in_silence() -> None:
    """An HF MoE model with output_router_logits returns aux_loss beside its logits; only its own loss (given
    labels) adds the term with the config's coefficient."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    with pytest.raises(LossError, match=r"auxiliary loss \(\.aux_loss.*give the model its labels.*pass a loss "
                                        r"function") as err:
        default_loss(MoeCausalLMOutputWithPast(logits=logits, aux_loss=torch.tensor(0.3)), tokens)
    assert "\n" not in str(err.value)
    own = MoeCausalLMOutputWithPast(loss=torch.tensor(2.0), logits=logits, aux_loss=torch.tensor(0.3))
    assert default_loss(own, None).item() == 2.0  # the model's own loss, the term inside
    assert "at every position" in pick_loss(MoeCausalLMOutputWithPast(logits=logits), tokens).name  # no router term


def test_keyword_inputs_that_fit_no_argument_name_it() -> None:
    model, inputs = build("hf_qwen3_padded")
    with pytest.raises(InputsError, match="input 'input_idz' matches no argument of Qwen3ForCausalLM.forward"):
        autopar.capture(model, {"input_idz": inputs["input_ids"]})
    with pytest.raises(InputsError, match="too many positional arguments"):
        autopar.capture(nn.Linear(4, 4), (torch.zeros(2, 4), torch.zeros(2, 4)))


@pytest.mark.slow
def test_a_model_fed_a_padding_mask_and_its_labels_trains_on_its_own_loss_with_microbatches() -> None:
    """Qwen3 with a padding mask and labels, 2 microbatches of keyword inputs: the step's loss is the
    model's own loss on the whole batch (equal microbatches: the mean of their means)."""
    model, inputs = build("hf_qwen3_padded")
    x, y = synthetic_batch(model, inputs, 4, seed=1)
    assert y is None and torch.equal(x["attention_mask"][:2], inputs["attention_mask"])  # the mask's pattern kept
    with torch.no_grad():
        whole = model(**x).loss.item()
    pm = autopar.compile(model, 1, example_inputs=inputs, cluster="cpu", dtype="fp32", global_batch=4,
                         pins=["microbatches=2"], optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    halves = [model(**{k: v[i:i + 2] for k, v in x.items()}).loss.item() for i in (0, 2)]
    assert pm.train_step(pm.local_batch(x)) == pytest.approx(sum(halves) / 2, rel=1e-6)
    assert whole == pytest.approx(sum(halves) / 2, rel=0.2)  # (not equal: padding differs per half)


@pytest.mark.slow
def test_no_recompute_is_offered_on_layers_holding_a_batchnorm() -> None:
    model, inputs = build("resnet_bn")
    graph = autopar.capture(model, inputs)
    refused = {l.name: l.recompute_refusal for l in graph.layers if l.recompute_refusal}
    assert "layer1.0" in refused and "updates its running statistics" in refused["layer1.0"]
    assert "fc" not in refused
    for layer in graph.layers:
        kinds = contract.offered_recomputes(graph, layer.index, 1)
        assert (kinds == (Recompute.NONE,)) if layer.name in refused else Recompute.FULL in kinds


@pytest.mark.slow
def test_batchnorm_statistics_all_reduces_are_priced_under_dp_only() -> None:
    from autopar.choice import BatchCoupling, LayerChoice
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.cost_models.presets import PRESETS
    from autopar.mesh import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    model, inputs = build("resnet_bn")
    graph = autopar.capture(model, inputs)
    block = next(l for l in graph.layers if l.name == "layer1.0")
    assert block.sync_norm_channels == (8, 8)

    def forward_s(dp: int, layer=block, coupled: BatchCoupling = BatchCoupling.AUTO) -> float:
        config = Configuration(Mesh(dp=dp), 1, Schedule(ScheduleKind.NONE))
        table = PriceTable(graph, config, PRESETS["a100-80g"].for_world_size(dp),
                           TrainingSpec(4, batch_coupled=coupled))
        return table._price(layer, LayerChoice()).forward_mb_s

    fc = next(l for l in graph.layers if l.name == "fc")
    assert forward_s(2) > forward_s(1) and forward_s(2, fc) == forward_s(1, fc)
    # batch_coupled=split: each rank normalises its own share, no collective to price
    assert forward_s(2, coupled=BatchCoupling.SPLIT) == forward_s(1) < forward_s(2, coupled=BatchCoupling.EXACT)


def test_batchnorm_over_microbatches_is_named_in_the_plan_and_verify_runs_the_same_splits() -> None:
    from autopar.tools.verify import plan_warnings, setup_lines

    model, inputs = build("resnet_bn")
    graph = autopar.capture(model, inputs)
    plans = {m: autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4,
                              pins=["pp=1", "dp=2", f"microbatches={m}"]) for m in (1, 2)}
    assert plan_warnings(plans[2], model) == [] and plan_warnings(plans[1], model) == []
    split = next(n for n in plans[2].notes if n.startswith("batch-coupled layers"))
    assert "each microbatch of the whole dp group, 2 splits of 2 samples" in split, split
    assert "one process: each step as the same 2 splits of 2 samples" in "\n".join(
        setup_lines(plans[2], [], [], graph=graph))
    exact = next(n for n in plans[1].notes if n.startswith("batch-coupled layers"))
    assert "exact" in exact and "all-reduced over the dp group of 2" in exact
    with pytest.raises(PinError, match="BatchNorm.*microbatches run one after another"):
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4,
                      pins=["pp=1", "dp=2", "microbatches=2", "batch_coupled=exact"])
