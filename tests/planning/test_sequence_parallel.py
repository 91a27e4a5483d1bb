"""Sequence parallelism: proved on shares of the sequence before it is offered, priced as it runs, searched
and pinned. (Parity with one device on the zoo's models, in processes: tests/runtime/test_zoo.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import zoo
from synthetic import transformer_graph

import autopar
from autopar.capturing import capture
from autopar.choice import LayerChoice
from autopar.cost_models.hardware import GiB
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.errors import LoweringError, PinError
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.plan import Plan
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.pricing import PriceTable
from autopar.planning.solver import solve
from autopar.sharding import check as shard_check
from autopar.sharding.rules import SimulatedRank

NANO_COLS, NANO_ROWS = ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")


def _nano_block() -> tuple[nn.Module, tuple, dict]:
    block = zoo.NanoBlock(zoo.NanoConfig(n_embd=16, n_head=4, block_size=8))
    copy = shard_check.layer_copy(block, torch.Generator().manual_seed(0))
    recorded = ((torch.empty(2, 8, 16, device="meta", dtype=torch.float64),), {})
    segments = {"attn.c_attn": (16, 16, 16), "mlp.c_fc": (64,)}
    return copy, recorded, segments


def test_a_nanogpt_block_runs_exact_on_shares_of_the_sequence():
    copy, recorded, segments = _nano_block()
    degrees, stats, why = shard_check.check_sequence(copy, recorded, NANO_COLS, NANO_ROWS, segments, (2, 4))
    assert degrees == (2, 4) and why == ""
    # one all-gather per column input (c_attn reads ln_1's output, c_fc ln_2's); two LayerNorms'
    # weights and biases and the two row biases have their gradients summed over the tp group
    assert stats.gathers == (("attn.c_attn",), ("mlp.c_fc",))
    assert stats.grad_sums == (16,) * 6


def test_a_degree_that_does_not_divide_the_sequence_is_simulated_at_a_length_it_divides():
    copy, recorded, segments = _nano_block()
    segments = {"attn.c_attn": (24, 24, 24), "mlp.c_fc": (96,)}
    block = zoo.NanoBlock(zoo.NanoConfig(n_embd=24, n_head=3, block_size=8))
    copy = shard_check.layer_copy(block, torch.Generator().manual_seed(0))
    recorded = ((torch.empty(2, 8, 24, device="meta", dtype=torch.float64),), {})
    degrees, _, why = shard_check.check_sequence(copy, recorded, NANO_COLS, NANO_ROWS, segments, (3,))
    assert degrees == (3,), why  # 8 positions: simulated at 6


def test_a_wrong_reduce_scatter_is_caught_by_the_numbers(monkeypatch: pytest.MonkeyPatch):
    """Every rank keeping rank 0's share of the row outputs keeps every shape right."""
    def wrong(self, partial, dim):
        return self.reducer.sum(self.rank, partial).chunk(self.tp, dim=dim)[0]

    monkeypatch.setattr(SimulatedRank, "reduce_scatter_sequence", wrong)
    copy, recorded, segments = _nano_block()
    degrees, _, why = shard_check.check_sequence(copy, recorded, NANO_COLS, NANO_ROWS, segments, (2,))
    assert degrees == () and "differs from one device" in why


@pytest.fixture(scope="module")
def zoo_styles() -> dict[str, list]:
    out = {}
    for name in ("hf_llama", "hf_gpt2", "hf_opt", "hf_vit"):
        model, inputs = zoo.build(name)
        graph = capture(model, inputs)
        pattern = zoo.MODELS[name][1].removesuffix(".*")
        out[name] = [s for l in graph if l.name.startswith(pattern + ".") for s in l.tp_styles
                     if s.name == "megatron"]
    return out


@pytest.mark.slow
def test_models_as_upstream_writes_them_are_offered_sequence_parallelism(zoo_styles):
    for name in ("hf_llama", "hf_gpt2"):  # GPT-2's Conv1D flattens batch and sequence inside the projection
        styles = zoo_styles[name]
        assert styles and all(s.sequence and s.sequence_gathers == 2 for s in styles), name
        # each block hands its hidden state to the next untouched: shares pass without gathering
        assert all(s.sequence_linked for s in styles[1:]), name
        assert styles[0].sequence_stream_elems == 16 * 32  # the example's 16 positions × width 32


@pytest.mark.slow
def test_models_whose_code_mixes_the_sequence_are_refused_with_the_op(zoo_styles):
    opt = zoo_styles["hf_opt"]  # OPT's decoder layer flattens [batch, sequence] before its MLP
    assert opt and all(not s.sequence for s in opt)
    assert "merges the sharded dimension" in opt[0].sequence_refusal
    vit = zoo_styles["hf_vit"]  # 16 patches and a class token
    assert vit and "divides the sequence (17)" in vit[0].sequence_refusal


# ---------------------------------------------------------------------------------------------- pricing

def _table(tp: int = 4, pp: int = 1, budget_gib: float | None = None) -> PriceTable:
    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    cluster = PRESETS["a100-80g"].for_world_size(tp * pp)
    sched = Schedule(ScheduleKind.ONE_F_ONE_B if pp > 1 else ScheduleKind.NONE)
    return PriceTable(graph, Configuration(Mesh(pp=pp, tp=tp), 1, sched), cluster, TrainingSpec(4))


def test_sequence_parallel_activations_follow_korthikanti_with_the_gathered_inputs_kept():
    table = _table(tp=4)
    block = next(l for l in table.graph if l.name == "blocks.0")
    s, h, a, t, b = 512, 1024, 16, 4, 4
    plain = table._price(block, LayerChoice("megatron")).activation_mb_bytes
    sp = table._price(block, LayerChoice("megatron", sp=True)).activation_mb_bytes
    # Korthikanti et al. 2022: sbh(10 + 24/t + 5as/ht) with TP; with SP everything over t, but the
    # runtime keeps the QKV and FC1 inputs (2 × 2sbh) whole for the projections' backward
    assert plain == pytest.approx(b * (10 * s * h + (24 * s * h + 5 * a * s * s) / t), rel=1e-9)
    assert sp == pytest.approx(b * ((30 * s * h + 5 * a * s * s) / t + 4 * s * h), rel=1e-9)


def test_sequence_parallel_moves_the_all_reduces_bytes_as_gathers_and_scatters():
    base = PRESETS["a100-80g"]
    free = replace(base, intra_node=replace(base.intra_node, latency_s=0.0, collectives={}), nccl_tuning=False,
                   collective_sync_s=0.0, tp_overhead_s=0.0).for_world_size(4)  # bandwidth only
    table = PriceTable(transformer_graph(4, 1024, 512, vocab=8192, heads=16),
                       Configuration(Mesh(tp=4), 1, Schedule(ScheduleKind.NONE)), free, TrainingSpec(4))
    block = next(l for l in table.graph if l.name == "blocks.0")
    plain, sp = (table._style_part(block, "megatron", flag) for flag in (False, True))
    # forward: 2 all-reduces of b·s·h (bf16), against 2 all-gathers + 2 reduce-scatters of the same
    size, bw = 4 * 512 * 1024 * 2, free.intra_node.bandwidth_bytes_s
    assert plain[2] == pytest.approx(2 * size * 2 * 3 / 4 / bw, rel=1e-9)
    assert sp[2] == pytest.approx(plain[2], rel=1e-9)
    assert sp[3] > plain[3]  # backward also sums six small gradients


def test_a_region_is_entered_and_left_once_per_rank_whatever_its_length():
    table = _table(tp=4)
    names = [l.name for l in table.graph]
    plain = tuple(LayerChoice("megatron") if n.startswith("blocks.") else LayerChoice() for n in names)
    one = tuple(replace(s, sp=n == "blocks.0") for s, n in zip(plain, names))
    every = tuple(replace(s, sp=n.startswith("blocks.")) for s, n in zip(plain, names))
    stages = (0,) * len(names)
    t_plain, t_one, t_every = (evaluate(table, stages, s).breakdown.tp_comm_s for s in (plain, one, every))
    region = table.sequence_region_s(names.index("blocks.0"), table.index_of(names.index("blocks.0"), one[1]))
    assert region > 0
    per_layer = (evaluate(table, stages, one).rank_time_mb_s[0] - evaluate(table, stages, plain).rank_time_mb_s[0])
    per_layer -= region
    assert t_every - t_plain == pytest.approx(4 * per_layer + region, rel=1e-6)


def test_the_solver_turns_sequence_parallelism_on_when_memory_needs_it():
    graph = transformer_graph(8, 4096, 2048, vocab=32768, heads=32)
    cluster = PRESETS["a100-80g"].for_world_size(8)
    pins = Pins.parse(["pp=1", "dp=1", "tp=8", "microbatches=1", "recompute=none", "blocks.*:tp=megatron"])
    free = solve(graph, 8, cluster, TrainingSpec(8), pins=pins)
    blocks = [s for l, s in zip(graph, free.choices) if l.name.startswith("blocks.")]
    tight = min(free.prediction.memory_per_rank_bytes) - 1
    if not any(s.sp for s in blocks):  # memory was no object: make it one
        pinned = solve(graph, 8, cluster, TrainingSpec(8), pins=Pins.parse([*pins.to_strings(), "sp=on"]))
        assert pinned.prediction.peak_memory_bytes < free.prediction.peak_memory_bytes
        tight = pinned.prediction.peak_memory_bytes
    squeezed = solve(graph, 8, cluster, TrainingSpec(8), pins=pins, memory_budget_bytes=tight)
    assert any(s.sp for l, s in zip(graph, squeezed.choices) if l.name.startswith("blocks."))
    assert evaluate(squeezed.table, squeezed.stages, squeezed.choices) == squeezed.prediction


# ---------------------------------------------------------------------------------------------- pins, plans

def test_sp_pins_are_parsed_and_contradictions_named():
    pins = Pins.parse(["sp=on", "blocks.0:sp=on"])
    assert pins.sp is True and pins.layers[0].sp is True
    assert "sp=on" in pins.to_strings()
    with pytest.raises(PinError, match="sp must be on or off"):
        Pins.parse(["sp=maybe"])
    with pytest.raises(PinError, match="contradict"):
        Pins.parse(["sp=off", "blocks.0:sp=on"]).check_form()


@pytest.mark.parametrize("pins,message", [
    (["head:sp=on"], "layer 'head' cannot run sequence parallel"),
    (["tp=2", "blocks.*:sp=on", "embed:sp=on"], "layer 'embed' cannot run sequence parallel"),
])
def test_sp_on_a_layer_that_cannot_take_it_names_the_layer(pins, message):
    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    with pytest.raises(PinError, match=message):
        solve(graph, 8, PRESETS["a100-80g"].for_world_size(8), TrainingSpec(16), pins=Pins.parse(pins))


def test_sp_on_at_a_degree_the_sequence_does_not_divide_names_the_layer():
    graph = transformer_graph(4, 1024, 500, vocab=8192, heads=16)  # 500 positions: tp=8 does not divide
    with pytest.raises(PinError, match=r"layer 'blocks.0' runs sequence parallel only at tp=\[2, 4\]"):
        solve(graph, 8, PRESETS["a100-80g"].for_world_size(8), TrainingSpec(16),
              pins=Pins.parse(["tp=8", "blocks.*:sp=on"]))


def test_a_global_sp_on_applies_where_it_can_and_the_plan_says_so(tmp_path):
    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    plan = autopar.solve(graph, 8, cluster="a100-80g", global_batch=16,
                         pins=["pp=1", "dp=2", "tp=4", "blocks.*:tp=megatron", "sp=on"])
    sp = {l.name: l.choice.sp for l in plan.layers}
    assert all(sp[n] for n in sp if n.startswith("blocks.")) and not sp["head"]
    assert "megatron+sp" in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path, fingerprint=plan.fingerprint) == plan
    old = json.loads(path.read_text())  # a plan written before sequence parallelism
    for layer in old["layers"]:
        del layer["sp"]
    path.write_text(json.dumps(old))
    assert not any(l.choice.sp for l in Plan.load(path, fingerprint=plan.fingerprint).layers)


@pytest.mark.slow
def test_lowering_refuses_sequence_parallelism_the_style_does_not_run_at_that_degree():
    from autopar.passes.tensor_parallel import check_tensor_parallel

    model, inputs = zoo.build("hf_llama")
    graph = capture(model, inputs)
    plan = autopar.solve(graph, 2, cluster="cpu", global_batch=4,
                         pins=["pp=1", "dp=1", "tp=2", "model.layers.*:tp=megatron", "model.layers.*:sp=on"])
    assert any(l.choice.sp for l in plan.layers)
    check_tensor_parallel(model, graph, plan, 2)
    layers = [replace(l, tp_styles=tuple(replace(s, sequence=()) for s in l.tp_styles)) for l in graph]
    bare = type(graph)(layers, model_name=graph.model_name, example_batch=graph.example_batch,
                       dtype_bytes=graph.dtype_bytes, seq_len=graph.seq_len)
    with pytest.raises(LoweringError, match="sequence parallelism does not run at tp=2"):
        check_tensor_parallel(model, bare, plan, 2)


@pytest.mark.slow
def test_memory_budget_shrinks_with_sequence_parallelism_on_a_real_capture():
    model, inputs = zoo.build("nanogpt")
    graph = capture(model, inputs)
    cluster = replace(PRESETS["cpu"], device=replace(PRESETS["cpu"].device, memory_bytes=4 * GiB))
    base = ["pp=1", "dp=1", "tp=2", "recompute=none", "transformer.h.*:tp=megatron"]
    off = autopar.solve(graph, 2, cluster=cluster, global_batch=4, pins=[*base, "sp=off"])
    on = autopar.solve(graph, 2, cluster=cluster, global_batch=4, pins=[*base, "sp=on"])
    assert max(on.predicted.memory_per_rank_bytes) < max(off.predicted.memory_per_rank_bytes)


def test_a_diff_names_the_layers_that_turn_sequence_parallelism_on():
    from autopar.tools.diff import layer_changes

    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    base = ["pp=1", "dp=2", "tp=4", "zero=0", "recompute=none", "microbatches=1", "blocks.*:tp=megatron"]
    off = autopar.solve(graph, 8, cluster="a100-80g", global_batch=16, pins=[*base, "sp=off"])
    on = autopar.solve(graph, 8, cluster="a100-80g", global_batch=16, pins=[*base, "sp=on"])
    changes = layer_changes(off, on)
    assert [(c.count, c.a, c.b) for c in changes] == [
        (4, "stage 0, tp megatron, zero 0, recompute none", "stage 0, tp megatron+sp, zero 0, recompute none")]
