"""Zero-bubble schedules' cost model: torch's actions simulated against the papers' figures, and where the
stages sit (Qi et al., ICLR 2024; DeepSeek-V3 technical report, Table 2)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from autopar.cost_models import schedule_sim as sim
from autopar.cost_models.pipeline import Schedule, ScheduleKind, in_flight, rank_stages, schedule_refusal, stage_rank

ZB1 = Schedule(ScheduleKind.INTERLEAVED_ZB)
ZB2 = Schedule(ScheduleKind.INTERLEAVED_ZB, 2)
ZBV = Schedule(ScheduleKind.ZBV, 2)
DPV = Schedule(ScheduleKind.DUALPIPE_V, 2)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_stage_placement_is_torchs(pp: int) -> None:
    for v_shape, style in [(False, "loop"), (True, "v")]:
        torch_map = generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
        assert {s: stage_rank(s, pp, v_shape) for s in range(2 * pp)} == torch_map
    assert rank_stages(0, pp, 2 * pp, v_shape=True) == [0, 2 * pp - 1]  # the V: first and last on rank 0
    assert rank_stages(pp - 1, pp, 2 * pp, v_shape=True) == [pp - 1, pp]
    assert ZBV.rank_of_stage(2 * pp - 1, pp) == 0 and ZB2.rank_of_stage(2 * pp - 1, pp) == pp - 1


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1.2, 0.8), (1, 2, 0.5), (2, 1, 1)])
def test_one_chunk_zero_bubble_is_zb_h1(pp: int, m: int, f: float, b: float, w: float) -> None:
    # Qi et al. §3.1: ZB-H1's bubble (p − 1)(T_F + T_B − T_W) for T_W ≤ T_F, against 1F1B's (p − 1)(T_F + T_B + T_W)
    step = sim.simulate(ZB1, pp, m, [(f, b, w)] * pp)
    assert step - m * (f + b + w) == pytest.approx(sim.zb_h1_bubble(pp, f, b, w))


def test_without_weight_gradients_zero_bubble_is_1f1b() -> None:
    assert sim.simulate(ZB1, 4, 8, [(1.0, 2.0, 0.0)] * 4) == pytest.approx((8 + 4 - 1) * 3.0)


def test_equal_f_b_w_weights() -> None:
    # a third of 1F1B's bubble (w = 1/3 against 1), interleaving and the V halve it again
    assert sim.bubble_weight(ZB1, 4, 8, 1.0, 1.0, 1.0) == Fraction(1, 3)
    assert sim.bubble_weight(ZB2, 4, 8, 1.0, 1.0, 1.0) == Fraction(1, 6)
    assert sim.bubble_weight(ZBV, 4, 8, 1.0, 1.0, 1.0) == Fraction(1, 6)
    assert sim.bubble_weight(DPV, 4, 8, 1.0, 1.0, 1.0) == Fraction(1, 6)


def test_zbv_two_rank_timeline_by_hand() -> None:
    # p = 2, m = 4, every chunk's F = B = W = 1: rank 1 waits one F for rank 0's first forward and then never
    # idles, so the step is its 24 units of work plus that 1 (the ZB-V paper's warm-up), where 1F1B on the same
    # ranks takes (m + p − 1)·(3 + 3) = 30
    assert sim.simulate(ZBV, 2, 4, [(1.0, 1.0, 1.0)] * 4) == pytest.approx(25.0)


def test_torch_runs_dualpipev_pairs_one_after_the_other() -> None:
    # DeepSeek-V3 Table 2 prices an overlapped F&B pair as one; torch's DualPipeV runs F then B on one stream,
    # so the bubble it leaves is not (PP/2 − 1)(F&B + B − 3W) but what its actions give
    a = sim.actions("dualpipev", 2, 4, 2)
    assert any(x is not None and x.sub_actions for x in a[0])
    assert sim.simulate(DPV, 2, 4, [(1.0, 1.0, 1.0)] * 4) >= 24.0


def test_in_flight_counts_until_the_weight_gradient() -> None:
    # torch's input backward keeps the graph for the weight backward: ZB-H1 holds p on every rank (1F1B: p − r)
    assert [in_flight(ZB1, 4, 8, r) for r in range(4)] == [4, 4, 4, 4]
    assert [in_flight(ZBV, 4, 8, r) for r in range(4)] == [4, 4, 4, 4]  # 2·p chunk-microbatches of half a rank
    assert [in_flight(DPV, 4, 8, r) for r in range(4)] == [Fraction(9, 2)] * 4  # DeepSeek: PP + 1 chunks
    assert in_flight(ZBV, 2, 1, 0) == 1


def test_torch_microbatch_rules() -> None:
    assert schedule_refusal(ScheduleKind.DUALPIPE_V, 4, 7, 2) and not schedule_refusal(ScheduleKind.DUALPIPE_V, 4, 8, 2)
    assert schedule_refusal(ScheduleKind.INTERLEAVED_ZB, 4, 6, 1) and not schedule_refusal(ScheduleKind.ZBV, 4, 3, 2)
    with pytest.raises(ValueError, match="exactly 2"):
        Schedule(ScheduleKind.ZBV, 4)
