"""The per-op compute model: GEMM shapes, memory-bound bytes, fused attention, and the FLOPs fallback."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopar.cost_models.compute import (
    ATTENTION_BACKWARD_FLOPS_FACTOR,
    CAUSAL_ATTENTION_RATE,
    CAUSAL_ATTENTION_WORK,
    attention_time_s,
    compute_time_s,
    gemm_efficiency,
    gemm_time_s,
    memory_bound_time_s,
)
from autopar.cost_models.gpu_figures import GEMM_K_HALF, GPU_BANDWIDTH_FRACTION, SM_COUNT
from autopar.cost_models.hardware import ClusterError, ClusterSpec
from autopar.cost_models.presets import PRESETS

A100 = PRESETS["a100-80g"].device


def test_a_large_gemm_reaches_nearly_the_fitted_efficiency():
    eta = gemm_efficiency(16384, 16384, 16384, 1, A100)
    assert 0.95 * A100.matmul_efficiency < eta <= A100.matmul_efficiency


def test_a_thin_or_sharded_gemm_runs_below_peak_efficiency():
    big = gemm_efficiency(8192, 8192, 8192, 1, A100)
    assert gemm_efficiency(16, 8192, 8192, 1, A100) < 0.1 * big  # 16 rows fill 1/16 of a 256-row tile
    # a 1T block's column projection split 8 ways on one 2048-token sequence: 600 tiles, 5.6 waves
    sharded = gemm_efficiency(2048, 3 * 25600 // 8, 25600, 1, A100)
    assert sharded < big and sharded == pytest.approx(
        A100.matmul_efficiency * 25600 / (25600 + A100.op_model.gemm_k_half) * 600 / (6 * SM_COUNT["A100"]))


def test_one_tile_more_than_a_wave_costs_a_whole_wave():
    ops = A100.op_model
    full = ops.sm_count * ops.tile_m  # m × one tile column: exactly one wave of tiles
    one_wave = gemm_time_s(full, ops.tile_n, 4096, 1, A100, "bf16")
    two_waves = gemm_time_s(full + 1, ops.tile_n, 4096, 1, A100, "bf16")
    assert two_waves - ops.kernel_overhead_s == pytest.approx(2 * (one_wave - ops.kernel_overhead_s), rel=1e-3)


def test_a_shallow_reduction_runs_at_half_rate_at_k_half():
    deep = gemm_efficiency(8192, 8192, 1e9, 1, A100)
    assert gemm_efficiency(8192, 8192, A100.op_model.gemm_k_half, 1, A100) == pytest.approx(deep / 2, rel=1e-6)


def test_the_half_rate_depth_is_the_chips_ridge_point_scaled_from_the_hopper_measurement():
    # measured 256 on Hopper (989 TFLOP/s, 3.35 TB/s); an A100 (312, 2.039) has a lower ridge
    h100 = PRESETS["h100-80g"].device.op_model.gemm_k_half
    assert h100 == pytest.approx(GEMM_K_HALF)
    assert A100.op_model.gemm_k_half == pytest.approx(256 * (312 / 2.039) / (989 / 3.35), rel=1e-9)
    # so attention's score GEMM (k = head dim 96) runs faster on an A100 than a Hopper constant said
    hopper_ramp = replace(A100, op_model=replace(A100.op_model, gemm_k_half=h100))
    assert gemm_efficiency(2048, 2048, 96, 96, A100) > 1.5 * gemm_efficiency(2048, 2048, 96, 96, hopper_ramp)


def test_memory_bound_ops_are_priced_by_their_bytes():
    one = memory_bound_time_s(1e9, A100, kernels=10)
    assert one == pytest.approx(1e9 / (A100.memory_bandwidth_bytes_s * GPU_BANDWIDTH_FRACTION)
                                + 10 * A100.op_model.kernel_overhead_s)
    assert memory_bound_time_s(2e9, A100, 10) - one == pytest.approx(one - memory_bound_time_s(0, A100, 10))
    cpu = PRESETS["cpu"].device  # no op model: the bandwidth alone
    assert memory_bound_time_s(1e9, cpu, kernels=10) == pytest.approx(1e9 / cpu.memory_bandwidth_bytes_s)


def test_fused_attention_backward_and_causal_follow_flash_attentions_conventions():
    o = A100.op_model.kernel_overhead_s
    fwd = attention_time_s(1e12, A100, "bf16") - o
    assert fwd == pytest.approx(1e12 / (A100.peak_flops_bf16 * A100.matmul_efficiency * A100.op_model.attention_fwd))
    bwd = attention_time_s(1e12, A100, "bf16", backward=True) - o
    assert bwd == pytest.approx(fwd * ATTENTION_BACKWARD_FLOPS_FACTOR * A100.op_model.attention_fwd
                                / A100.op_model.attention_bwd)
    causal = attention_time_s(1e12, A100, "bf16", causal=True) - o
    assert causal == pytest.approx(fwd * CAUSAL_ATTENTION_WORK / CAUSAL_ATTENTION_RATE)


def test_without_an_op_model_gemms_take_the_flat_efficiency():
    flat = replace(A100, op_model=None)
    assert gemm_efficiency(16, 16, 16, 1, flat) == flat.matmul_efficiency
    assert compute_time_s(1e12, flat, "bf16") == pytest.approx(
        (1e12 + flat.half_efficiency_flops) / (flat.peak_flops_bf16 * flat.matmul_efficiency))


@pytest.mark.parametrize("name", ["a100-80g", "h100-96g", "h200", "v100-16g"])
def test_gpu_presets_carry_cited_op_terms_and_the_cpu_preset_none(name):
    ops = PRESETS[name].device.op_model
    assert ops is not None and ops.sm_count == SM_COUNT[PRESETS[name].device.name.split("-")[0]]
    assert 0 < ops.bandwidth_fraction <= 1 and 0 < ops.attention_bwd < ops.attention_fwd < 1
    assert PRESETS["cpu"].device.op_model is None


def test_op_model_round_trips_through_a_cluster_file_and_bad_terms_are_named():
    c = PRESETS["h100-80g"]
    data = json.loads(json.dumps(c.to_dict()))
    assert ClusterSpec.from_dict(data, source="x.json") == c
    assert "op_model" not in PRESETS["cpu"].to_dict()["device"]
    data["device"]["op_model"]["kernel_overhead_s"] = -1.0
    with pytest.raises(ClusterError, match="op_model.kernel_overhead_s"):
        ClusterSpec.from_dict(data, source="x.json")
    data["device"]["op_model"] = {"sm_count": 4}
    with pytest.raises(ClusterError, match="op_model is missing"):
        ClusterSpec.from_dict(data, source="x.json")
