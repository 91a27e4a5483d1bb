"""The notes a plan carries to explain choices that look odd, with the price table's figures:
uneven interleaved stages, and recompute on a few layers but on no repeated block."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from synthetic import transformer_graph

import autopar
from autopar.plan import Plan
from autopar.units import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

INTERLEAVED = ["pp=2", "schedule=interleaved_1f1b", "chunks=2"]


def _shown(text: str, plan: Plan) -> bool:
    """``text`` in the plan's summary, which wraps long notes at 120 columns."""
    return " ".join(text.split()) in " ".join(plan.summary().split())


def _note(plan: Plan, start: str) -> str | None:
    return next((n for n in plan.notes if n.startswith(start)), None)


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(4, 1024, 1024, vocab=32768, heads=16)


@pytest.fixture(scope="module")
def tiny_gpt():
    model, inputs = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=8, device="meta")
    return autopar.capture(model, inputs)


# ---------------------------------------------------------------- uneven interleaved stages


def test_uneven_interleaved_stages_are_explained_by_rank_totals(graph):
    plan = autopar.solve(graph, 8, cluster="a100-40g", global_batch=64, pins=INTERLEAVED)
    pp, blocks = plan.mesh.pp, [lp for lp in plan.layers if lp.name.startswith("blocks.")]
    per_stage = [sum(lp.stage == s for lp in blocks) for s in range(plan.stages)]
    assert max(per_stage) - min(per_stage) > 1, "the case needs uneven stages"
    per_rank = [sum(per_stage[j::pp]) for j in range(pp)]
    note = _note(plan, "stages are uneven")
    assert note is not None
    assert f"({min(per_stage)}–{max(per_stage)} blocks each)" in note
    assert "balances ranks, not stages" in note
    held = (f"add up to {per_rank[0]} blocks" if len(set(per_rank)) == 1
            else f"hold {', '.join(map(str, per_rank))} blocks")
    assert held in note
    assert re.search(r"the slowest, rank \d, paces the step", note)
    assert _shown(f"note: {note}", plan)


def test_even_interleaved_stages_and_plain_pipelines_get_no_stage_note(graph):
    even = autopar.solve(graph, 8, cluster="a100-40g", global_batch=64, pins=INTERLEAVED + [
        "embed:stage=0", "blocks.0:stage=0", "blocks.1:stage=1", "blocks.2:stage=2", "blocks.3:stage=3"])
    assert [lp.stage for lp in even.layers if lp.name.startswith("blocks.")] == [0, 1, 2, 3]
    assert _note(even, "stages are uneven") is None
    plain = autopar.solve(graph, 8, cluster="a100-40g", global_batch=64, pins=["pp=2", "schedule=1f1b"])
    assert _note(plain, "stages are uneven") is None


# ---------------------------------------------------------------- recompute on no block


def test_a_free_recompute_of_a_norm_is_explained(tiny_gpt, monkeypatch):
    # searched, a split-backward schedule wins here (zbv at pp=2, 0.8% faster), and they recompute nothing: the
    # note is asked of the plan of the three schedules before them
    from autopar.planning import configs

    monkeypatch.setattr(configs, "SEARCH_SPLIT_BACKWARD", False)
    plan = autopar.solve(tiny_gpt, 4, cluster="cpu", dtype="fp32", global_batch=8)
    assert [lp.name for lp in plan.layers if lp.choice.recompute] == ["ln_f"]
    note = _note(plan, "ln_f recomputes")
    assert note is not None and "no block does" in note
    assert "costs the step nothing" in note and "no FLOPs" in note
    assert f"of {format_bytes(plan.predicted.memory_budget_bytes)}" in note
    off = autopar.solve(tiny_gpt, 4, cluster="cpu", dtype="fp32", global_batch=8,
                        pins=[*plan.pins, *_fixed(plan), "ln_f:recompute=off"])
    saved = off.predicted.memory_per_rank_bytes[0] - plan.predicted.memory_per_rank_bytes[0]
    assert saved > 0 and f"saves {saved} B per rank" in note
    assert off.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)


def _fixed(plan: Plan) -> list[str]:
    """Pins fixing every choice of ``plan`` but recompute."""
    m = plan.mesh
    pins = [f"pp={m.pp}", f"dp={m.dp}", f"tp={m.tp}", f"microbatches={plan.microbatches}",
            f"schedule={plan.schedule.value}"]
    for lp in plan.layers:
        pins += [f"{lp.name}:zero={lp.choice.zero}", f"{lp.name}:tp={lp.choice.tp or 'none'}",
                 f"{lp.name}:stage={lp.stage}"]
    return pins


def test_a_memory_forced_recompute_of_the_head_gives_its_saving_and_cost(graph):
    pins = ["pp=1", "tp=1", "zero=3", "microbatches=1", "blocks.*:recompute=off"]
    off = autopar.solve(graph, 8, cluster="a100-40g", global_batch=64, pins=pins + ["head:recompute=off"])
    budget = (off.predicted.memory_per_rank_bytes[0] - 2**26) / 2**30  # 64 MiB short of fitting
    on = autopar.solve(graph, 8, cluster="a100-40g", global_batch=64, pins=pins, memory_gb=budget)
    assert [lp.name for lp in on.layers if lp.choice.recompute] == ["head"]
    note = _note(on, "head recomputes")
    assert note is not None
    saved = off.predicted.memory_per_rank_bytes[0] - on.predicted.memory_per_rank_bytes[0]
    cost = on.predicted.step_time_s - off.predicted.step_time_s
    assert saved > 2**26 and cost > 0
    assert f"saves {format_bytes(saved)} per rank and adds {cost * 1e3:.3g} ms to the step" in note
    assert "no FLOPs" not in note
    assert f"peak memory {format_bytes(on.predicted.memory_per_rank_bytes[0])} of" in note


@pytest.mark.parametrize("pins", [["recompute=all"], ["recompute=none"], ["blocks.*:recompute=on"]])
@pytest.mark.slow
def test_no_recompute_note_when_blocks_recompute_or_nothing_does(tiny_gpt, pins):
    plan = autopar.solve(tiny_gpt, 4, cluster="cpu", dtype="fp32", global_batch=8, pins=pins)
    assert not any("no block does" in n for n in plan.notes)


def test_notes_travel_with_the_plan_file(tiny_gpt, tmp_path):
    plan = autopar.solve(tiny_gpt, 4, cluster="cpu", dtype="fp32", global_batch=8, pins=INTERLEAVED)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.notes == plan.notes and again.notes
    assert all(_shown(f"note: {n}", again) for n in again.notes)


# ---------------------------------------------------------------- a mesh axis no layer uses


def test_tp_no_layer_can_use_is_the_last_resort_and_noted(tiny_gpt):
    """7 ranks, batch 4: dp cannot divide the batch, the GPT has too few cuts for pp=7 and cp=7 does not divide
    its sequence, so tp=7 is the only mesh, and none of its styles runs on 7 ranks (4 heads): the 7 ranks repeat
    one rank's work, and the plan says so and what to do."""
    plan = autopar.solve(tiny_gpt, 7, cluster="a100-80g", global_batch=4)
    assert plan.mesh.tp == 7 and not any(lp.choice.tp for lp in plan.layers)
    note = _note(plan, "tp=7 is used by no layer")
    assert note is not None and "(7 ranks do the work of 1)" in note
    assert "no other mesh of 7 ranks" in note and "plan another world size" in note and "--world-size 1" in note
    assert _shown(f"note: {note}", plan)


def test_a_mesh_with_an_idle_tp_axis_is_not_chosen_when_another_runs(tiny_gpt):
    """3 ranks, batch 3: tp=3 would replicate every layer (no style divides 4 heads by 3) and price one
    rank's step; dp=3 splits the batch, and the solver takes it."""
    plan = autopar.solve(tiny_gpt, 3, cluster="a100-80g", global_batch=3)
    assert plan.mesh.tp == 1
    assert not [n for n in plan.notes if "is used by no layer" in n]


def test_a_pinned_tp_no_layer_uses_is_noted_as_pinned(tiny_gpt):
    plan = autopar.solve(tiny_gpt, 2, cluster="a100-80g", global_batch=2, pins=["tp=2", "*:tp=none", "loss=full"])
    note = _note(plan, "tp=2 is used by no layer")
    assert note is not None and "tp=2 is pinned: unpin it" in note and "--world-size 1" in note
    megatron = autopar.solve(tiny_gpt, 2, cluster="a100-80g", global_batch=2, pins=["tp=2", "blocks.*:tp=megatron"])
    assert any(lp.choice.tp for lp in megatron.layers) and _note(megatron, "tp=2 is used") is None
