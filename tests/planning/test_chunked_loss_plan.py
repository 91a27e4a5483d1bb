"""The chunked loss as a plan choice: offered where the head and loss are the common pattern (else a
one-line reason on the plan), chosen by price against the whole logits (these fit the small models here and
step faster: the tests about the chunked loss itself pin it), pinned off by ``loss=full``, recorded in the plan
file and its summary, and priced: the logits it no longer holds leave the priced peak."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from equivalence_cases import GPT_TP, gpt_tiny, hf_llama

import autopar
from autopar.choice import LossKind
from autopar.errors import PinError
from autopar.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def _solve(graph, pins=(), world=1, **kw):
    return autopar.solve(graph, world, cluster="cpu", dtype="fp32", global_batch=4, pins=list(pins), **kw)


def _chunked(graph, pins=(), world=1, **kw):
    """Solved with the chunked loss pinned: at these sizes the whole logits fit and step faster, so the planner
    would otherwise hold them (:func:`test_the_loss_is_chosen_by_price`)."""
    return _solve(graph, [*pins, "loss=chunked"], world, **kw)


def _loss_note(plan: Plan) -> str:
    return next(n for n in plan.notes if n.startswith("loss: "))


def test_the_common_pattern_is_chunked_and_says_so() -> None:
    graph = autopar.capture(*gpt_tiny())
    assert graph.loss_head is not None and graph.loss_head.module_path == "lm_head"
    plan = _chunked(graph)
    assert plan.training.loss is LossKind.CHUNKED
    assert "chunked cross-entropy on lm_head's weight" in _loss_note(plan)
    assert "\nloss          chunked: the head's GEMM and cross-entropy a chunk" in plan.summary()
    again = Plan.from_json(plan.to_json())
    assert again.training.loss is LossKind.CHUNKED and json.loads(plan.to_json())["training"]["loss"] == "chunked"
    older = json.loads(plan.to_json())
    del older["training"]["loss"]  # a plan written before the choice: the whole logits
    assert Plan.from_dict(older).training.loss is LossKind.FULL


@pytest.mark.slow
def test_a_tied_head_is_found() -> None:
    from chunked_loss_cases import hf_llama_tied

    head = autopar.capture(*hf_llama_tied()).loss_head
    assert head is not None and head.tied and head.weight == "model.embed_tokens.weight"


@pytest.mark.parametrize("on_meta", [False, True], ids=["fp32", "meta"])
@pytest.mark.slow
def test_a_hugging_face_moe_s_head_is_found(on_meta: bool) -> None:
    """HF's experts run ``aten::_grouped_mm``, whose meta kernel takes bf16 only: the head search must still run
    an fp32 MoE on fake inputs and one built on meta (DeepSeek-V3 671B held its whole logits before)."""
    from moe_cases import hf_deepseek_v3

    if on_meta:
        with torch.device("meta"):
            model, inputs = hf_deepseek_v3()
        inputs = tuple(t.to("meta") for t in inputs)
    else:
        model, inputs = hf_deepseek_v3()
    graph = autopar.capture(model, inputs)
    assert graph.loss_refusal == "" and graph.loss_head is not None
    assert graph.loss_head.module_path == "lm_head" and not graph.loss_head.tied


def test_the_loss_is_chosen_by_price() -> None:
    """Unpinned, the plan's choices are priced with both losses: the whole logits where they fit and step faster
    (no chunk's logits recomputed in backward), the chunked loss where only it fits; the note gives the other's
    price either way."""
    graph = autopar.capture(*gpt_tiny())
    free = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", global_batch=4)
    chunked = _chunked(graph)
    assert free.training.loss is LossKind.FULL and chunked.training.loss is LossKind.CHUNKED
    assert free.predicted.step_time_s < chunked.predicted.step_time_s
    assert _loss_note(free) == (f"loss: the whole logits are held: this plan steps in {free.predicted.step_time_s:.4g}"
                                f" s with them and fits, against {chunked.predicted.step_time_s:.4g} s chunked (each "
                                "chunk's logits recomputed in backward); pin loss=chunked never to hold them")
    # a budget between the two peaks: only the chunked loss fits these choices, and it is kept
    peak_full, peak_chunked = free.predicted.memory_per_rank_bytes[0], chunked.predicted.memory_per_rank_bytes[0]
    assert peak_chunked < peak_full
    tight = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", global_batch=4,
                          memory_gb=(peak_chunked + peak_full) / 2 / 2**30, pins=["recompute=none"])
    assert tight.training.loss is LossKind.CHUNKED
    assert "(the whole logits would step in " in _loss_note(tight) and "exceed the memory budget" in _loss_note(tight)


def test_pinned_off_it_holds_the_logits() -> None:
    plan = _solve(autopar.capture(*gpt_tiny()), ["loss=full"])
    assert plan.training.loss is LossKind.FULL and "pins" in plan.summary()
    assert _loss_note(plan) == "loss: the whole logits are held (not chunked: pinned loss=full)"


class _Scaled(nn.Module):
    """A head whose prediction is computed after the linear (the chunked loss cannot run it)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

    def forward(self, idx):
        return self.head(self.emb(idx)) * 0.5


@pytest.mark.slow
def test_elsewhere_it_is_not_offered_with_the_reason() -> None:
    model, (ids,) = hf_llama()
    own = autopar.capture(model, {"input_ids": ids, "labels": ids})
    assert own.loss_head is None and own.loss_refusal == "the model computes its own loss (.loss)"
    assert "not chunked: the model computes its own loss" in _loss_note(_solve(own))
    with pytest.raises(PinError, match="loss=chunked"):
        _solve(own, ["loss=chunked"])
    after = autopar.capture(_Scaled(), (torch.zeros(2, 8, dtype=torch.long),))
    assert "not the output of a plain nn.Linear" in after.loss_refusal
    custom = _solve(autopar.capture(*gpt_tiny()), custom_loss=True)
    assert custom.training.loss is LossKind.FULL and "a loss function was given" in _loss_note(custom)


def test_a_head_tp_splits_runs_the_vocabulary_parallel_loss() -> None:
    plan = _chunked(autopar.capture(*gpt_tiny()), ("pp=1", "dp=1", "tp=2", "zero=0") + GPT_TP, world=2)
    assert plan.training.loss is LossKind.VOCAB_PARALLEL
    assert "vocabulary-parallel cross-entropy on lm_head's weight split over tp=2" in _loss_note(plan)


@pytest.mark.slow
def test_the_350m_gpt_peak_drops_by_the_logits_it_no_longer_holds() -> None:
    """GPT-2 medium (350M) at 18 × 2,048 tokens a rank on an A100 40 GB: the full loss holds three fp32
    logits (18 · 2048 · 50304 · 4 B = 6.9 GiB each); the chunked one two of a 1,280-token chunk and,
    bf16, the head's gradient accumulated in fp32 (50304 · 1024 · 4 B), which a block's transient
    activations (priced beside it, the larger counting) cover."""
    import gpt

    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.cost_models.presets import load_cluster
    from autopar.mesh import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    graph = autopar.capture(*gpt.gpt2_medium(seq_len=2048))
    pins = ["microbatches=1", "recompute=full"]
    chunked, full, free = (autopar.solve(graph, 1, cluster="a100-40g", global_batch=18, pins=pins + extra)
                           for extra in (["loss=chunked"], ["loss=full"], []))
    assert chunked.training.loss is LossKind.CHUNKED and full.training.loss is LossKind.FULL
    logits = 18 * 2048 * 50304 * 4
    chunk_peak = 2 * 1280 * 50304 * 4 + 50304 * 1024 * 4
    drop = full.predicted.memory_per_rank_bytes[0] - chunked.predicted.memory_per_rank_bytes[0]
    table = PriceTable(graph, Configuration(Mesh(), 1, Schedule(ScheduleKind.NONE)),
                       load_cluster("a100-40g").for_world_size(1), TrainingSpec(18, loss=LossKind.CHUNKED))
    assert table.loss_bytes == (chunk_peak, 0)
    assert drop == 3 * logits - max(chunk_peak, table.layer_transient_bytes)  # 19.53 GiB of 29.72
    assert full.predicted.memory_per_rank_bytes[0] > 3 * logits > 2 * chunked.predicted.memory_per_rank_bytes[0]
    only = dataclasses.replace(full.predicted.ranks[0], workspace_bytes=chunked.predicted.ranks[0].workspace_bytes)
    assert only == dataclasses.replace(chunked.predicted.ranks[0])  # every other part alike
    assert chunked.predicted.step_time_s > full.predicted.step_time_s  # the head's GEMM once more in backward
    # with every layer recomputed the whole logits fit 40 GB: unpinned, the planner holds them (faster)
    assert free.training.loss is LossKind.FULL and free.predicted == full.predicted
