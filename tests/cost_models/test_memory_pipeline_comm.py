"""Cost models against public figures: ZeRO memory, pipeline bubbles, nccl-tests bus bandwidth."""

from __future__ import annotations

from fractions import Fraction

import pytest

from autopar.cost_models import (
    PRESETS,
    Collective,
    Schedule,
    ScheduleKind,
    bubble_fraction,
    collective_time_s,
    in_flight,
    model_state_bytes,
    place_group,
    precision,
    step_time_multiplier,
)
from autopar.cost_models.communication import bus_bandwidth


@pytest.mark.parametrize("zero,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figures_for_7_5b_on_64_gpus(zero, expected_gb):
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12, mixed precision.
    got = model_state_bytes(7_500_000_000, zero, 64, precision("bf16")) / 1e9
    assert got == pytest.approx(expected_gb, abs=0.05)


def test_fp32_adam_keeps_sixteen_bytes_per_parameter_unsharded():
    assert model_state_bytes(1000, 0, 8, precision("fp32")) == 16 * 1000
    assert model_state_bytes(1000, 3, 8, precision("fp32")) == 2000


def test_sharded_states_round_up_to_whole_elements():
    assert model_state_bytes(10, 3, 3, precision("bf16")) == -(-16 * 10 // 3)


@pytest.mark.parametrize("p,m,v,expected", [
    (4, 8, 1, Fraction(3, 8)), (8, 32, 1, Fraction(7, 32)), (4, 8, 2, Fraction(3, 16)), (1, 8, 1, 0),
])
def test_bubble_fractions(p, m, v, expected):
    kind = ScheduleKind.INTERLEAVED_1F1B if v > 1 else ScheduleKind.ONE_F_ONE_B
    schedule = Schedule(kind, v)
    assert bubble_fraction(schedule, p, m) == expected
    assert step_time_multiplier(schedule, p, m) == m * (1 + expected)


def test_activations_in_flight_per_schedule():
    gpipe, one_f = Schedule(ScheduleKind.GPIPE), Schedule(ScheduleKind.ONE_F_ONE_B)
    assert [in_flight(gpipe, 4, 8, s) for s in range(4)] == [8] * 4
    assert [in_flight(one_f, 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(one_f, 4, 2, s) for s in range(4)] == [2, 2, 2, 1]  # never more than m
    inter = Schedule(ScheduleKind.INTERLEAVED_1F1B, 2)
    # Megatron's warm-up: 2(p−s−1) + (v−1)p + 1 chunk-microbatches of 1/v of the rank's layers
    assert in_flight(inter, 4, 8, 0) == Fraction(2 * 3 + 4 + 1, 2)
    assert in_flight(inter, 4, 8, 3) == Fraction(0 + 4 + 1, 2)


def test_schedule_rejects_inconsistent_chunks():
    with pytest.raises(ValueError):
        Schedule(ScheduleKind.ONE_F_ONE_B, 2)
    with pytest.raises(ValueError):
        Schedule(ScheduleKind.INTERLEAVED_1F1B, 1)


def test_nccl_tests_bus_bandwidth_factors():
    from dataclasses import replace

    cluster = replace(PRESETS["a100-80g"], nccl_tuning=False, latency_per_step=False)  # plain α-β
    group = place_group(8, 1, 8)
    nbytes = 1e9
    bw = cluster.intra_node.bandwidth_bytes_s
    alpha = cluster.intra_node.latency_s
    assert collective_time_s(Collective.ALL_REDUCE, nbytes, group, cluster) == pytest.approx(
        alpha + nbytes * 2 * 7 / 8 / bw)
    assert collective_time_s(Collective.ALL_GATHER, nbytes, group, cluster) == pytest.approx(
        alpha + nbytes * 7 / 8 / bw)
    assert collective_time_s(Collective.ALL_REDUCE, nbytes, place_group(1, 1, 8), cluster) == 0.0


def test_groups_across_nodes_run_at_nic_speed():
    cluster = PRESETS["a100-80g"].for_world_size(64)
    inside = place_group(8, 1, 8)  # tp in one node
    across = place_group(8, 8, 8)  # dp with stride 8: one rank per node
    half = place_group(8, 4, 8)  # two ranks per node
    assert not inside.spans_nodes and across.spans_nodes and half.local == 2
    assert bus_bandwidth(inside, cluster) == cluster.intra_node.bandwidth_bytes_s
    assert bus_bandwidth(across, cluster) == pytest.approx(24e9)  # one HDR NIC
    assert bus_bandwidth(half, cluster) == pytest.approx(48e9)
