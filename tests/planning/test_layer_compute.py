"""Per-layer compute from the captured ops: what capture records, what a TP style divides, what
pricing charges, the fallback to FLOPs, and the calibration set the efficiencies are fitted on."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from synthetic import transformer_graph

import autopar
from autopar.cost_models.compute import BACKWARD_FLOPS_FACTOR, compute_time_s, gemm_time_s
from autopar.cost_models.presets import PRESETS
from autopar.graph import LayerGraph, OpKind, OpRecord
from autopar.mesh import Mesh
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.layer_compute import layer_compute, op_flops_per_sample, style_flops_per_sample
from autopar.planning.pricing import PriceTable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

A100 = PRESETS["a100-80g"]


@pytest.fixture(scope="module")
def gpt_graph() -> LayerGraph:
    import gpt

    net, inputs = gpt.gpt(n_layer=2, d_model=256, n_head=8, vocab_size=4096, seq_len=128)
    return autopar.capture(net, inputs)


def _block(graph: LayerGraph):
    return next(l for l in graph if l.name.startswith("blocks."))


@pytest.mark.slow
def test_capture_records_each_gemm_attention_and_memory_bound_op(gpt_graph):
    block = _block(gpt_graph)
    gemms = sorted((o.n, o.k) for o in block.ops if o.kind is OpKind.GEMM)
    h = 256
    assert gemms == sorted([(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)])  # qkv, proj, fc, proj
    assert all(o.m == 128 and o.per_sample == "m" for o in block.ops if o.kind is OpKind.GEMM)
    (attn,) = [o for o in block.ops if o.kind is OpKind.ATTENTION]
    assert attn.causal and attn.flops_per_sample == pytest.approx(4 * 128 * 128 * h)
    memory = [o for o in block.ops if o.kind is OpKind.MEMORY]
    assert memory and all(o.bytes_per_sample > 0 and o.count > 0 for o in memory)
    embedding = gpt_graph[0]
    (gather,) = [o for o in embedding.ops if o.kind is OpKind.MEMORY]
    assert gather.bytes_per_sample < embedding.param_bytes / 10  # the rows gathered, not the table


def test_a_megatron_style_splits_columns_rows_and_what_lies_between(gpt_graph):
    block = _block(gpt_graph)
    shards = {(o.kind, o.n, o.k): o.shard.get("megatron") for o in block.ops}
    assert shards[(OpKind.GEMM, 768.0, 256.0)] == "n" and shards[(OpKind.GEMM, 256.0, 1024.0)] == "k"
    assert shards[(OpKind.ATTENTION, 0.0, 0.0)] == "all"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_ops_under_a_style_sum_to_the_layers_flops_under_it(gpt_graph, tp):
    for layer in gpt_graph:
        for style in [None, *(s.name for s in layer.tp_styles)]:
            assert op_flops_per_sample(layer, style, tp) == pytest.approx(style_flops_per_sample(layer, style, tp))


def test_op_records_round_trip_through_the_graphs_json(gpt_graph):
    again = LayerGraph.from_dict(json.loads(json.dumps(gpt_graph.to_dict())))
    assert [l.ops for l in again] == [l.ops for l in gpt_graph]
    assert again.cost_classes == gpt_graph.cost_classes
    old = gpt_graph.to_dict()
    for layer in old["layers"]:
        del layer["ops"]  # a graph written before op records
    assert all(not l.ops for l in LayerGraph.from_dict(old))


def test_a_layer_costs_its_gemms_plus_its_memory_bound_work(gpt_graph):
    block, device = _block(gpt_graph), A100.device
    times = layer_compute(block, None, 1, 4, device, "bf16")
    gemms = sum(o.count * gemm_time_s(*o.gemm_shape(4, None, 1), device, "bf16")
                for o in block.ops if o.kind is OpKind.GEMM)
    assert times.device_fwd_s > gemms and times.device_bwd_s > 2 * gemms * 0.9


def test_sharding_a_thin_layer_speeds_it_up_less_than_tp_fold(gpt_graph):
    block, device = _block(gpt_graph), A100.device
    whole = layer_compute(block, None, 1, 1, device, "bf16")
    split = layer_compute(block, "megatron", 8, 1, device, "bf16")
    assert whole.device_fwd_s / 8 < split.device_fwd_s < whole.device_fwd_s


def test_layers_without_op_records_or_devices_without_an_op_model_price_by_flops(gpt_graph):
    graph = transformer_graph()
    block, device = graph[1], A100.device
    times = layer_compute(block, "megatron", 4, 2, device, "bf16")
    flops = 2 * style_flops_per_sample(block, "megatron", 4)
    assert times.device_fwd_s == compute_time_s(flops, device, "bf16")
    assert times.device_bwd_s == compute_time_s(BACKWARD_FLOPS_FACTOR * flops, device, "bf16")
    flat = replace(device, op_model=None)
    captured = _block(gpt_graph)
    assert layer_compute(captured, None, 1, 2, flat, "bf16").device_fwd_s == compute_time_s(
        2 * captured.flops_per_sample, flat, "bf16")
    table = PriceTable(graph, Configuration(Mesh(tp=4), 1, _schedule()), A100, TrainingSpec(8))
    assert all(p.compute_mb_s > 0 for row in table.prices[1:-1] for p in row)


def test_memory_bound_backward_moves_twice_the_forwards_bytes():
    from autopar.cost_models.compute import MEMORY_BOUND_BACKWARD_FACTOR

    norm = replace(transformer_graph()[1], flops_per_sample=0.0, tp_styles=(),
                   ops=(OpRecord(OpKind.MEMORY, count=4, per_sample="", bytes_per_sample=1e6),))
    times = layer_compute(norm, None, 1, 8, A100.device, "bf16", act_scale=0.5)
    o = A100.device.op_model
    fwd = 8 * 1e6 * 0.5 / (A100.device.memory_bandwidth_bytes_s * o.bandwidth_fraction)
    assert times.device_fwd_s == pytest.approx(fwd + 4 * o.kernel_overhead_s)
    assert times.device_bwd_s == pytest.approx(MEMORY_BOUND_BACKWARD_FACTOR * (fwd + 4 * o.kernel_overhead_s))


def test_records_count_identical_kernels_once():
    rec = OpRecord(OpKind.GEMM, count=3, m=128, n=64, k=32)
    assert rec.gemm_flops_per_sample() == 3 * 2 * 128 * 64 * 32
    assert OpRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec


@pytest.mark.slow
def test_the_calibration_set_is_reproduced_within_ten_percent():
    from calibration_set import calibration_rows

    rows = calibration_rows()
    assert len(rows) == 4
    for row in rows:
        assert abs(row.tokens_error) < 0.10, (row.run.name, row.tokens_error)


def _schedule():
    from autopar.cost_models.pipeline import Schedule, ScheduleKind

    return Schedule(ScheduleKind.NONE)


def test_a_bf16_plans_master_weights_cost_the_host_one_op_a_parameter_where_no_fsdp2_unit_holds_them(
        gpt_graph, monkeypatch):
    """The fp32 masters' post-accumulate hook (runtime/precision.py) is one eager op a parameter a microbatch:
    priced where the host paces a layer's backward, on a bf16 plan outside FSDP2 (dp = 1 or DDP); not at fp32,
    not under FSDP2 (its own mixed precision), not on a CPU (no host term)."""
    from autopar.choice import LayerChoice
    from autopar.planning.layer_compute import master_hooks_s

    h200 = PRESETS["h200"]
    block = _block(gpt_graph)
    host_op = h200.device.op_model.host_op_s
    times = layer_compute(block, None, 1, 1, h200.device, "bf16")
    assert times.host_bwd_s > times.device_bwd_s  # a small block at one sample: the host paces it
    assert master_hooks_s(block, times, h200.device) == pytest.approx(len(block.param_names) * host_op)
    assert master_hooks_s(block, times, PRESETS["cpu"].device) == 0.0

    def backward_s(mesh: Mesh, dtype: str, zero: int) -> float:
        from autopar.contract import DataParallelism

        config = Configuration(mesh, 1, _schedule(), DataParallelism(sharded=zero > 0))
        table = PriceTable(gpt_graph, config, h200.for_world_size(mesh.world_size), TrainingSpec(mesh.dp, dtype=dtype))
        return table._price(block, LayerChoice(zero=zero)).compute_mb_s

    one_op = len(block.param_names) * host_op
    bf16, fp32 = backward_s(Mesh(), "bf16", 0), backward_s(Mesh(), "fp32", 0)
    assert bf16 - layer_compute(block, None, 1, 1, h200.device, "bf16").fwd_s == pytest.approx(times.bwd_s + one_op)
    assert fp32 == pytest.approx(layer_compute(block, None, 1, 1, h200.device, "fp32").fwd_s
                                 + layer_compute(block, None, 1, 1, h200.device, "fp32").bwd_s)
    assert backward_s(Mesh(dp=2), "bf16", 0) == pytest.approx(bf16)  # DDP: the masters' hook is there too
    import autopar.planning.pricing as pricing

    called = []
    monkeypatch.setattr(pricing, "master_hooks_s", lambda *a: called.append(a) or 0.0)
    backward_s(Mesh(dp=2), "bf16", 3)
    assert not called  # FSDP2 holds the weights (its own mixed precision): no masters
    backward_s(Mesh(), "bf16", 0)
    assert called
