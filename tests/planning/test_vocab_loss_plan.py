"""The vocabulary-parallel loss as a plan choice: the contract runs the chunked loss so wherever tp splits
the head; it fixes the head's style (and a tied embedding's), is priced by its own peak, kernels and
collectives, shows in the plan file, summary and notes, and is refused in one line where it cannot run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from chunked_loss_cases import hf_llama_tied
from equivalence_cases import gpt_tiny

import autopar
from autopar.choice import LossKind
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import load_cluster
from autopar.errors import PinError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.planning import loss_price
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

TP2 = ["pp=1", "dp=1", "tp=2", "zero=0"]


@pytest.fixture(scope="module")
def gpt_graph():
    return autopar.capture(*gpt_tiny())


@pytest.fixture(scope="module")
def tied_graph():
    return autopar.capture(*hf_llama_tied())


def _solve(graph, pins, world=2):
    """Solved with the chunked loss (vocabulary-parallel where tp splits the head) unless a pin names the loss:
    at these sizes the whole logits fit and step faster, so the planner would otherwise hold them."""
    pins = list(pins) if any(p.startswith("loss=") for p in pins) else [*pins, "loss=chunked"]
    return autopar.solve(graph, world, cluster="cpu", dtype="fp32", global_batch=4, pins=pins)


def _styles(plan: Plan) -> dict:
    return {l.name: l.choice.tp for l in plan.layers}


def test_tp_splitting_the_head_runs_it_and_the_plan_says_so(gpt_graph) -> None:
    plan = _solve(gpt_graph, TP2)
    assert plan.training.loss is LossKind.VOCAB_PARALLEL and _styles(plan)["lm_head"] == "vocab"
    assert json.loads(plan.to_json())["training"]["loss"] == "vocab_parallel"
    assert Plan.from_json(plan.to_json()).training.loss is LossKind.VOCAB_PARALLEL
    assert "\nloss          vocabulary-parallel: the head's GEMM and cross-entropy" in plan.summary()
    note = next(n for n in plan.notes if n.startswith("loss: "))
    assert "split over tp=2 (128 of 256 classes a rank)" in note and "never gathered" in note
    full = _solve(gpt_graph, TP2 + ["loss=full"])
    assert full.training.loss is LossKind.FULL
    one = _solve(gpt_graph, ["pp=1", "dp=2", "tp=1", "zero=0"])
    assert one.training.loss is LossKind.CHUNKED  # no tp: the whole head, chunked


@pytest.mark.slow
def test_pins_against_it_are_refused_in_one_line(gpt_graph, tied_graph) -> None:
    with pytest.raises(PinError, match=r"lm_head' pinned tp=None: the vocabulary-parallel loss splits it .*loss=full"):
        _solve(gpt_graph, TP2 + ["lm_head:tp=none"])
    with pytest.raises(PinError, match="pin loss=chunked; it runs vocabulary-parallel"):
        _solve(gpt_graph, TP2 + ["loss=vocab_parallel"])
    with pytest.raises(PinError, match="an end of tied embeddings in one stage"):
        _solve(tied_graph, TP2 + ["loss=full", "model.embed_tokens:tp=vocab"])


@pytest.mark.slow
def test_tied_ends_split_together_or_not_at_all(tied_graph) -> None:
    split = _solve(tied_graph, TP2)
    assert split.training.loss is LossKind.VOCAB_PARALLEL
    assert _styles(split)["model.embed_tokens"] == _styles(split)["lm_head"] == "vocab"
    whole = _solve(tied_graph, TP2 + ["loss=full"])
    assert _styles(whole)["model.embed_tokens"] is None and _styles(whole)["lm_head"] is None
    piped = _solve(tied_graph, ["pp=2", "dp=1", "tp=2", "zero=0", "microbatches=2"], world=4)
    assert piped.training.loss is LossKind.CHUNKED and _styles(piped)["lm_head"] is None  # replicated ends
    note = next(n for n in piped.notes if n.startswith("loss: "))  # and the plan says why
    assert "not vocabulary-parallel over tp=2: the head's weight is tied to" in note and "not offered" in note
    assert not any("not vocabulary-parallel" in n for n in split.notes + _solve(tied_graph, ["pp=2", "dp=2"],
                                                                                   world=4).notes)


def test_under_cp_it_runs_on_each_ranks_tokens(gpt_graph) -> None:
    assert _solve(gpt_graph, ["pp=1", "dp=1", "cp=2", "tp=1", "zero=0"]).training.loss is LossKind.CHUNKED
    both = _solve(gpt_graph, ["pp=1", "dp=1", "cp=2", "tp=2", "zero=0", "blocks.*:tp=megatron"], world=4)
    assert both.training.loss is LossKind.VOCAB_PARALLEL


def _table(graph, tp: int, loss: LossKind, batch: int = 4, cluster: str = "cpu", dtype: str = "fp32") -> PriceTable:
    return PriceTable(graph, Configuration(Mesh(tp=tp), 1, Schedule(ScheduleKind.NONE)),
                      load_cluster(cluster).for_world_size(tp), TrainingSpec(batch, dtype=dtype, loss=loss))


def test_priced_by_its_own_peak_kernels_and_collectives(gpt_graph) -> None:
    vp, chunked = _table(gpt_graph, 2, LossKind.CHUNKED), _table(gpt_graph, 1, LossKind.CHUNKED)
    assert vp.loss is LossKind.VOCAB_PARALLEL and chunked.loss is LossKind.CHUNKED
    assert vp.loss_bytes == (2 * 64 * 128 * 4, 0)  # two fp32 chunks of 64 tokens × 128 classes
    assert chunked.loss_bytes == (2 * 64 * 256 * 4, 0)
    assert vp.loss_time_s[0] < chunked.loss_time_s[0]  # a half of the vocabulary's kernels
    head = gpt_graph.layer("lm_head")
    gather = _table(gpt_graph, 2, LossKind.FULL)
    style = head.tp_style("vocab")
    assert loss_price.output_gather_s(vp, head, style, 4 * 4) == loss_price.vocab_comm_s(vp) > 0
    # the logits' all-gather (64 tokens × 256 classes) against two numbers a token
    assert loss_price.output_gather_s(gather, head, style, 4 * 4) > loss_price.vocab_comm_s(vp)


@pytest.mark.slow
def test_the_350m_gpt_at_tp2_drops_the_logits_it_no_longer_holds() -> None:
    """GPT-2 medium (350M) at 18 × 2,048 tokens a rank on A100 40 GB, tp=2: the full loss holds three fp32
    logits of the whole vocabulary (gathered by the head's style: 6.9 GiB each); the vocabulary-parallel
    one two chunks of 2,624 tokens × 25,152 classes and, bf16, its shard's gradient in fp32."""
    import gpt

    graph = autopar.capture(*gpt.gpt2_medium(seq_len=2048))
    pins = ["pp=1", "dp=1", "tp=2", "microbatches=1", "recompute=full", "blocks.*:tp=megatron"]
    vp, full = (autopar.solve(graph, 2, cluster="a100-40g", global_batch=18, pins=pins + extra)
                for extra in ([], ["loss=full"]))
    assert vp.training.loss is LossKind.VOCAB_PARALLEL and full.training.loss is LossKind.FULL
    logits = 18 * 2048 * 50304 * 4
    chunk_peak = 2 * 2624 * 25152 * 4 + 25152 * 1024 * 4
    table = _table(graph, 2, LossKind.CHUNKED, batch=18, cluster="a100-40g", dtype="bf16")
    assert table.loss_bytes == (chunk_peak, 0)
    drop = full.predicted.memory_per_rank_bytes[0] - vp.predicted.memory_per_rank_bytes[0]
    assert drop == 3 * logits - max(chunk_peak, table.layer_transient_bytes)  # 19.53 GiB
    assert full.predicted.memory_per_rank_bytes[0] > 3 * logits > 2 * vp.predicted.memory_per_rank_bytes[0]


def test_explain_sets_the_whole_logits_beside_it(gpt_graph) -> None:
    import dataclasses

    from autopar.tools.diff import diff_plans
    from autopar.tools.explain import explain

    plan = _solve(gpt_graph, TP2)
    plan = dataclasses.replace(plan, pins=tuple(p for p in plan.pins if p != "loss=chunked"))  # as if priced so
    e = explain(plan, gpt_graph, ["loss=full"])
    cf = e.counterfactuals[0]
    assert not cf.same_plan and "already" not in e.sentence(cf)  # the loss tells the two plans apart
    full = _solve(gpt_graph, TP2 + ["loss=full"])
    row = next(r for r in diff_plans(plan, full).rows if r.label == "loss")
    assert (row.a, row.b, row.differs) == ("vocab_parallel", "full", True)


def test_a_plan_whose_head_and_loss_disagree_is_refused_before_it_runs(gpt_graph) -> None:
    import dataclasses

    from autopar.errors import LossError
    from autopar.runtime.chunked_loss import plan_loss

    plan = _solve(gpt_graph, TP2)
    head = dataclasses.replace(plan.layers[-1], choice=dataclasses.replace(plan.layers[-1].choice, tp=None))
    edited = dataclasses.replace(plan, layers=(*plan.layers[:-1], head))
    with pytest.raises(LossError, match="vocab_parallel loss but tp does not split the head's layer lm_head"):
        plan_loss(gpt_tiny()[0], gpt_graph, edited, None)
    assert plan_loss(gpt_tiny()[0], gpt_graph, plan, None)[0].vocab_parallel
