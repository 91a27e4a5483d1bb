"""The split-backward schedules' activations in flight in closed form (pipeline.split_backward_in_flight), held to
the peak along torch's own action lists (schedule_sim.peak_in_flight) over a grid of (pp, m, chunks): the search
screens memory with the closed form and never generates torch's actions to do so."""

from __future__ import annotations

from autopar.cost_models import schedule_sim
from autopar.cost_models.pipeline import Schedule, ScheduleKind, in_flight, schedule_refusal

GRID_M = (*range(1, 25), 32, 48, 64)


def test_the_closed_form_is_the_peak_along_torchs_actions():
    checked = set()
    for kind, counts in [(ScheduleKind.INTERLEAVED_ZB, (1, 2, 4)), (ScheduleKind.ZBV, (2,)),
                         (ScheduleKind.DUALPIPE_V, (2,))]:
        for v in counts:
            for p in (2, 3, 4, 5, 6, 8, 16):
                for m in GRID_M:
                    if schedule_refusal(kind, p, m, v) or (p == 16 and m > 32):
                        continue
                    walked = schedule_sim.peak_in_flight(Schedule(kind, v), p, m)
                    closed = [in_flight(Schedule(kind, v), p, m, r) for r in range(p)]
                    assert closed == list(walked), (kind, v, p, m)
                    checked.add(kind)
    assert checked == {ScheduleKind.INTERLEAVED_ZB, ScheduleKind.ZBV, ScheduleKind.DUALPIPE_V}


def test_the_search_screens_without_torchs_actions(monkeypatch):
    """in_flight of a split-backward schedule at a large m generates no action list."""
    def refuse(*_a, **_k):
        raise AssertionError("torch's actions generated to count activations in flight")

    monkeypatch.setattr(schedule_sim, "flat_actions", refuse)
    monkeypatch.setattr(schedule_sim, "actions", refuse)
    assert in_flight(Schedule(ScheduleKind.INTERLEAVED_ZB, 4), 8, 512, 3) == 8
    assert in_flight(Schedule(ScheduleKind.ZBV, 2), 8, 512, 0) == 8


def test_w_from_2p_microbatches_on_is_w_at_2p():
    """schedule_sim.bubble_weight simulates at steady_microbatches (2p at most): held against the simulation
    at m itself over pipeline depths, microbatch counts up to 16p and F : B : W."""
    compared = 0
    for kind, counts in [(ScheduleKind.INTERLEAVED_ZB, (1, 2, 4)), (ScheduleKind.ZBV, (2,)),
                         (ScheduleKind.DUALPIPE_V, (2,))]:
        for v in counts:
            for p in (2, 3, 4, 8):
                for m in (2 * p, 2 * p + 1, 3 * p, 4 * p, 5 * p + 2, 8 * p, 16 * p):
                    if schedule_refusal(kind, p, m, v):
                        continue
                    for fbw in [(1, 1, 1), (1, 1.4, 0.6), (1, 2, 0.3), (0.2, 1, 1.8), (2, 1, 0.5), (1, 2, 0)]:
                        whole = schedule_sim.simulated_bubble_weight(Schedule(kind, v), p, m, *fbw)
                        assert schedule_sim.bubble_weight(Schedule(kind, v), p, m, *fbw) == whole, (kind, v, p, m)
                        compared += m > 2 * p
    assert compared > 300
