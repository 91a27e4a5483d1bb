"""Zero-bubble schedules in the search: pinned and found, placed in a V where the schedule says so, refused
in one line where they cannot run, and written to and read from a plan's JSON."""

from __future__ import annotations

import pytest
import torch
from equivalence_cases import gpt_tiny

import autopar
from autopar.contract import plan_layout
from autopar.cost_models.pipeline import SPLIT_BACKWARD, ScheduleKind
from autopar.errors import PinError, PlanError
from autopar.plan import Plan

BASE = ["pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=4"]


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    return autopar.capture(model, inputs)


def _solve(graph, pins: list[str], world: int = 2, batch: int = 8) -> Plan:
    return autopar.solve(graph, world, cluster="cpu", dtype="fp32", global_batch=batch, pins=pins)


def test_zbv_places_its_stages_in_a_v(graph) -> None:
    plan = _solve(graph, BASE + ["schedule=zbv"])
    assert (plan.schedule, plan.chunks) == (ScheduleKind.ZBV, 2)
    assert [plan.rank_stages(r) for r in range(2)] == [[0, 3], [1, 2]]
    layout = plan_layout(graph, plan)
    last = next(r for r in reversed(layout.layers))
    assert last.stage == 3 and last.rank == 0  # the head's stage runs beside the embedding's, on rank 0
    looped = _solve(graph, BASE + ["schedule=interleaved_zb", "chunks=2"])
    assert [looped.rank_stages(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert next(r for r in reversed(plan_layout(graph, looped).layers)).rank == 1


def test_memory_follows_the_placement(graph) -> None:
    # the same stages, placed in a V and looped: each rank's weights are its own stages' layers'
    stages = [0, 0, 0, 1, 2, 3, 3]
    pins = BASE + [f"{layer.name}:stage={s}" for layer, s in zip(graph, stages)]
    for schedule, v_shape in [(["schedule=zbv"], True), (["schedule=interleaved_zb", "chunks=2"], False)]:
        plan = _solve(graph, pins + schedule)
        assert [l.stage for l in plan.layers] == stages
        ranks = {0: [0, 3], 1: [1, 2]} if v_shape else {0: [0, 2], 1: [1, 3]}
        for r, held in ranks.items():
            want = sum(4 * layer.param_count for layer, s in zip(graph, stages) if s in held)  # fp32 weights
            assert plan.predicted.ranks[r].params_bytes == want, (schedule, r)


def test_zero_bubble_prices_a_smaller_bubble_than_1f1b(graph) -> None:
    one = _solve(graph, BASE + ["schedule=1f1b"]).predicted.breakdown.bubble_s
    zb = _solve(graph, BASE + ["schedule=interleaved_zb", "chunks=1"]).predicted.breakdown.bubble_s
    assert 0 < zb < one


def test_the_free_search_takes_them_where_they_are_cheapest(graph, monkeypatch) -> None:
    # searched with GPipe, 1F1B and interleaved 1F1B (configs.SEARCH_SPLIT_BACKWARD): memory is ample, so a
    # split-backward schedule's smaller bubble wins, and the plan is what pinning that schedule gives; with the
    # search left to the three, only a pin takes them
    from autopar.planning import configs

    free = _solve(graph, ["pp=2", "microbatches=4"])
    assert free.schedule in SPLIT_BACKWARD
    assert all(not l.choice.recompute for l in free.layers)
    pinned = _solve(graph, ["pp=2", "microbatches=4", f"schedule={free.schedule.value}", f"chunks={free.chunks}"])
    assert pinned.predicted.step_time_s == pytest.approx(free.predicted.step_time_s, rel=1e-9)
    one = _solve(graph, ["pp=2", "microbatches=4", "schedule=1f1b"])
    assert free.predicted.step_time_s < one.predicted.step_time_s
    monkeypatch.setattr(configs, "SEARCH_SPLIT_BACKWARD", False)
    assert _solve(graph, ["pp=2", "microbatches=4"]).schedule not in SPLIT_BACKWARD


@pytest.mark.parametrize("pins,why", [
    (["recompute=full", "schedule=zbv"], "recompute=none"),
    (["zero=3", "dp=2", "pp=2", "schedule=interleaved_zb"], "zero ≤ 2"),
])
def test_refused_in_one_line(graph, pins: list[str], why: str) -> None:
    base = [p for p in BASE if not p.startswith(tuple(k.split("=")[0] + "=" for k in pins))]
    with pytest.raises(PinError, match=why):
        _solve(graph, base + pins, world=4 if "dp=2" in pins else 2)


def test_free_zero_under_split_backward_never_takes_zero3(graph) -> None:
    plan = _solve(graph, ["pp=2", "dp=2", "tp=1", "microbatches=2", "schedule=zbv", "recompute=none"], world=4)
    assert all(l.choice.zero <= 2 for l in plan.layers)


@pytest.mark.slow
def test_tied_embeddings_refuse_the_v() -> None:
    import zoo

    model, inputs = zoo.NanoGPT(zoo.NanoConfig(), tie=True), zoo._ids()
    g = autopar.capture(model, inputs)
    with pytest.raises(PinError, match="interleaved_zb"):
        _solve(g, BASE + ["schedule=zbv"])
    assert _solve(g, BASE + ["schedule=interleaved_zb"]).schedule is ScheduleKind.INTERLEAVED_ZB


def test_compiled_plans_refuse_split_backward(graph) -> None:
    with pytest.raises(PinError, match="torch.compile"):
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=8, pins=BASE + ["schedule=zbv"],
                      compiled=True)


def test_pins_and_plan_json(graph) -> None:
    with pytest.raises(PinError, match="2 chunks"):
        _solve(graph, BASE + ["schedule=zbv", "chunks=4"])
    plan = _solve(graph, BASE + ["schedule=dualpipev"])
    back = Plan.from_json(plan.to_json())
    assert (back.schedule, back.chunks, back.rank_stages(0)) == (ScheduleKind.DUALPIPE_V, 2, [0, 3])
    assert "dualpipev" in plan.summary()
    bad = plan.to_json().replace('"chunks": 2', '"chunks": 3')
    with pytest.raises(PlanError, match="exactly 2"):
        Plan.from_json(bad)
    with pytest.raises(PinError, match="2 × pp"):
        _solve(graph, ["pp=2", "dp=1", "microbatches=2", "schedule=dualpipev"], batch=2)
