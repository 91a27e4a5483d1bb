"""The zero-bubble schedules in the free search (issue 42): searched with GPipe, 1F1B and interleaved 1F1B, the
plan is never worse than without them, the search's bounds hold for them, and their floor of w, which keys a
configuration before anything is simulated, is never above the simulated w."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from brute_force import brute_force, tiny_cluster
from synthetic import transformer_graph

import autopar
from autopar.cost_models import schedule_sim
from autopar.cost_models.pipeline import Schedule, ScheduleKind, schedule_refusal
from autopar.cost_models.presets import PRESETS
from autopar.errors import PinError
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.planning import configs
from autopar.planning.bounds import balanced_step_s
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pipeline_price import bubble_weight_floor
from autopar.planning.pricing import PriceTable
from autopar.planning.solver import SolverOptions, enumerate_configs, solve


def _without_split_backward(monkeypatch) -> None:
    """The search as it was before: GPipe, 1F1B and interleaved 1F1B only."""
    real = configs._schedules
    monkeypatch.setattr(configs, "_schedules",
                        lambda *a, **k: [s for s in real(*a, **k) if not s.split_backward])


@pytest.mark.parametrize("blocks,hidden,seq,world,gpus,batch,mem", [
    (2, 1024, 512, 2, 2, 4, 80),  # ample memory
    (2, 2048, 1024, 4, 4, 8, 6),  # tight: they recompute nothing and run ZeRO ≤ 2
])
def test_the_free_plan_with_them_is_never_worse_than_without(blocks, hidden, seq, world, gpus, batch, mem,
                                                             monkeypatch):
    monkeypatch.setattr(configs, "SEARCH_SPLIT_BACKWARD", True)  # the default; held so here
    graph = transformer_graph(blocks, hidden, seq, vocab=8192, heads=16)
    cluster = tiny_cluster(mem, gpus).for_world_size(world)
    training = TrainingSpec(batch, "bf16")
    budget, options = cluster.memory_budget_bytes, SolverOptions(time_limit_s=60)
    searched = enumerate_configs(graph, world, cluster, training, Pins())
    assert {ScheduleKind.INTERLEAVED_ZB, ScheduleKind.ZBV} <= {c.schedule.kind for c in searched}
    with_them = solve(graph, world, cluster, training, options=options, runners_up=0)
    assert with_them.status == "OPTIMAL"
    assert with_them.prediction.step_time_s == pytest.approx(brute_force(graph, world, cluster, training, budget),
                                                             rel=1e-5)
    _without_split_backward(monkeypatch)
    without = solve(graph, world, cluster, training, options=options, runners_up=0)
    assert without.prediction.step_time_s == pytest.approx(brute_force(graph, world, cluster, training, budget),
                                                           rel=1e-5)
    assert with_them.prediction.step_time_s <= without.prediction.step_time_s * (1 + 1e-9)


def test_the_floor_of_w_is_at_most_the_simulated_w(monkeypatch):
    """bubble_weight_floor (no simulation) against torch's actions simulated, over schedules, pipeline depths,
    microbatch counts and F : B : W; and on every configuration of a search, against the table's own w."""
    for kind, chunks in [(ScheduleKind.INTERLEAVED_ZB, (1, 2, 4)), (ScheduleKind.ZBV, (2,)),
                         (ScheduleKind.DUALPIPE_V, (2,))]:
        for v in chunks:
            for p in (2, 3, 4):
                for m in (1, 2, 4, 6, 8, 16):
                    if schedule_refusal(kind, p, m, v):
                        continue
                    for f, b, w in [(1, 1, 1), (1, 2, 0), (1, 0.2, 1.8), (0.1, 1, 1), (2, 1, 0.5)]:
                        simulated = schedule_sim.bubble_weight(Schedule(kind, v), p, m, f, b, w)
                        assert f / (v * (f + b + w)) - 1 / schedule_sim.DENOMINATOR <= simulated, (kind, v, p, m)
    monkeypatch.setattr(configs, "SEARCH_SPLIT_BACKWARD", True)  # a search's configurations with them
    graph = transformer_graph(2, 1024, 512, vocab=8192, heads=16)
    cluster, training = tiny_cluster(80, 4).for_world_size(8), TrainingSpec(8, "bf16")
    split = 0
    for config in enumerate_configs(graph, 8, cluster, training, Pins()):
        table = PriceTable(graph, config, cluster, training)
        assert bubble_weight_floor(table) <= table.bubble_weight, config
        split += config.schedule.split_backward and bubble_weight_floor(table) > 0
    assert split


def test_a_bound_with_nothing_that_fits_is_inf_not_nan():
    """GPipe at m = 1 has w = m: a rank bound of inf (no rank holds its layers) gave 0·inf = nan, which broke
    the search's heap (configurations popped out of order, the search stopped before better ones)."""
    graph = transformer_graph(2, 512, 256, vocab=8192, heads=16)
    cluster = tiny_cluster(80, 2).for_world_size(2)
    table = PriceTable(graph, Configuration(Mesh(pp=2), 1, Schedule(ScheduleKind.GPIPE)), cluster, TrainingSpec(1))
    assert table.bubble_weight == 1
    assert balanced_step_s(table, 1.0, math.inf) == math.inf
    assert balanced_step_s(table, 1.0, 0.25) == pytest.approx(1.0)


@pytest.mark.slow
def test_the_tiny_llama_that_found_a_slower_plan(monkeypatch):
    monkeypatch.setattr(configs, "SEARCH_SPLIT_BACKWARD", True)
    """The instance that kept these schedules out of the free search: a tiny Llama at 6 MiB on 8 ranks, pp=2,
    planned an interleaved 1F1B plan 0.4% slower with them than without (the nan above)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256,
                                   use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    graph = autopar.capture(model, (torch.zeros(1, 256, dtype=torch.long, device="meta"),))
    preset = PRESETS["h100-80g"]  # as tests/planning/test_memory_floor.py: no host term, no ties between plans
    cluster = replace(preset, device=replace(preset.device, op_model=replace(preset.device.op_model, host_op_s=0.0)))
    cluster = cluster.for_world_size(8)

    def step() -> float:
        return solve(graph, 8, cluster, TrainingSpec(8, dtype="bf16"), pins=Pins.parse(["pp=2"]),
                     memory_budget_bytes=6 << 20, options=SolverOptions(time_limit_s=600.0),
                     runners_up=0).prediction.step_time_s

    with_them = step()
    _without_split_backward(monkeypatch)
    assert with_them <= step() * (1 + 1e-9)


def test_searched_freely_only_on_the_meshes_their_runs_cover():
    """pp beside dp alone (configs.split_proven: what tests/passes/test_zero_bubble.py holds to one device); beside
    tp neither the free search nor a pin plans them (contract.split_backward_mesh_refusal), and admission refuses a
    plan file that has them there."""
    graph = transformer_graph(2, 1024, 512, vocab=8192, heads=16)
    cluster, training = tiny_cluster(80, 4).for_world_size(8), TrainingSpec(8, "bf16")
    searched = enumerate_configs(graph, 8, cluster, training, Pins())
    split = [c for c in searched if c.schedule.split_backward]
    assert split and all(c.mesh.tp == c.mesh.cp == c.mesh.ep == c.mesh.dp_replicate == 1 for c in split)
    assert any(c.mesh.tp > 1 and c.mesh.pp > 1 for c in searched)  # those meshes are searched, under the others
    with pytest.raises(PinError, match=r"pin schedule=zbv: .*beside tp=2 they are not offered yet"):
        enumerate_configs(graph, 8, cluster, training, Pins.parse(["schedule=zbv", "tp=2"]))
    pinned = enumerate_configs(graph, 8, cluster, training, Pins.parse(["schedule=zbv"]))
    assert pinned and all(c.schedule.kind is ScheduleKind.ZBV and c.mesh.tp == c.mesh.cp == c.mesh.ep == 1
                          for c in pinned)
