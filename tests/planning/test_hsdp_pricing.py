"""Hybrid sharding (HSDP, the ``dp_replicate`` axis) in the planner: ZeRO's all-gathers and reduce-scatters
priced on the shard group (one replica's dp/R × cp ranks, inside a node when it fits one), an all-reduce of
each reduce-scattered gradient shard on the replicate group (across nodes), model states sharded over the
shard group; searched with the other axes (1 and the node-sized shard group), pinned as ``dp_replicate=``
or ``dp_shard=``, refused with one line where it cannot run; plans without the key load as before."""

from __future__ import annotations

import json

import pytest
from synthetic import transformer_graph

import autopar
from autopar.choice import LayerChoice
from autopar.contract import DataParallelism
from autopar.contract_hsdp import dp_shard, hsdp_refusal, searched_replicas, shard_ranks
from autopar.cost_models.communication import Collective, collective_time_s, place_group
from autopar.cost_models.memory import model_state_bytes
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.errors import PinError
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.plan import Plan
from autopar.planning import hsdp_price
from autopar.planning.configs import enumerate_configs
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable


def _table(mesh: Mesh, zero: int = 3, microbatches: int = 2):
    graph = transformer_graph(2, 1024, 512, vocab=4096, heads=8)
    cluster = PRESETS["a100-80g"].for_world_size(mesh.world_size)
    config = Configuration(mesh, microbatches, Schedule(ScheduleKind.NONE), DataParallelism(True, zero))
    table = PriceTable(graph, config, cluster, TrainingSpec(8 * mesh.dp * microbatches, dtype="bf16"))
    i = next(l.index for l in graph if l.kind == "Block")
    return table, graph[i], table.prices[i][table.choices[i].index(LayerChoice(None, zero, False, False))]


def test_the_replicas_are_outermost_in_dp_so_a_shard_group_is_neighbouring_ranks() -> None:
    mesh = Mesh(dp=8, dp_replicate=2, tp=2)  # 16 ranks: 2 replicas × (4 dp ranks × 2 tp)
    assert mesh.world_size == 16 and mesh.dim_names() == ("pp", "dp", "cp", "tp")  # folded: no device-mesh dim
    assert (mesh.stride("dp"), mesh.stride("dp_replicate")) == (2, 8)  # a replica's ranks: 8 neighbours
    assert shard_ranks(mesh) == 4 and dp_shard(mesh) == 4 and shard_ranks(Mesh(dp=4, cp=2, dp_replicate=2)) == 4
    assert mesh.describe() == "dp=8 × dp_replicate=2 × tp=2"
    with pytest.raises(autopar.errors.MeshError, match="dp_replicate=3 must divide dp=8"):
        Mesh(dp=8, dp_replicate=3)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_unit_gathers_and_scatters_in_the_node_and_all_reduces_its_shard_across_nodes(zero: int) -> None:
    mesh = Mesh(dp=32, dp_replicate=4)  # 32 A100s, 8 a node: a replica is one node
    table, layer, price = _table(mesh, zero)
    cl, m = table.cluster, 2
    shard, across = place_group(8, 1, 8), place_group(4, 8, 8)
    assert (table.shard_group, table.replicate_group, table.shard_ranks) == (shard, across, 8)
    assert not shard.spans_nodes and across.spans_nodes and across.local == 1
    params = table.effective_params(layer, table.runs_as(layer.index, LayerChoice(None, zero, False, False)))
    grads, weights = 2 * params, 2 * params  # bf16
    rs, ag = {1: (1, 1), 2: (m, 1), 3: (m, 2 * m)}[zero]
    expect = (rs * collective_time_s(Collective.REDUCE_SCATTER, grads, shard, cl)
              + ag * collective_time_s(Collective.ALL_GATHER, weights, shard, cl)
              + rs * collective_time_s(Collective.ALL_REDUCE, grads / 8, across, cl))
    assert table.dp_collectives_s(params, zero) == pytest.approx(expect, rel=1e-12)
    # memory: sharded over the 8 ranks of the replica, not the 32 of dp
    plain_table, _, plain = _table(Mesh(dp=32), zero)
    assert price.state_bytes == model_state_bytes(params, zero, 8, table.prec) > plain.state_bytes
    assert plain_table.shard_group == plain_table.dp_group and plain_table.replicate_group.size == 1


def test_hsdp_trades_memory_for_traffic_that_stays_in_the_node() -> None:
    hsdp, _, h = _table(Mesh(dp=64, dp_replicate=8))
    plain, _, p = _table(Mesh(dp=64))
    assert h.dp_comm_s < p.dp_comm_s and h.state_bytes > p.state_bytes


def test_the_search_tries_one_and_the_node_sized_shard_group_and_pins_take_any() -> None:
    graph = transformer_graph(2, 1024, 512, vocab=4096, heads=8)
    cluster = PRESETS["a100-80g"].for_world_size(32)
    training = TrainingSpec(64, dtype="bf16")
    configs = enumerate_configs(graph, 32, cluster, training, Pins())
    replicas = {(c.mesh.dp, c.mesh.tp, c.mesh.dp_replicate) for c in configs}
    assert all(r == 1 or dp // r * tp == 8 for dp, tp, r in replicas)
    assert (32, 1, 4) in replicas and (16, 2, 4) in replicas and (32, 1, 2) not in replicas
    assert all(c.data_parallel.sharded for c in configs if c.mesh.dp_replicate > 1)  # never beside ZeRO-0 alone
    assert searched_replicas(Mesh(dp=32, dp_replicate=4), 8) and not searched_replicas(Mesh(dp=32, dp_replicate=2), 8)
    pinned = enumerate_configs(graph, 32, cluster, training, Pins.parse(["dp_shard=16", "tp=1", "pp=1"]))
    assert {c.mesh.dp_replicate for c in pinned} == {2} and {c.mesh.dp for c in pinned} == {32}
    plan = autopar.solve(graph, 32, cluster=cluster, global_batch=64, dtype="bf16",
                         pins=["dp=32", "dp_replicate=2", "zero=3"])
    assert plan.mesh.dp_replicate == 2 and "dp_replicate=2" in plan.summary()


def test_what_cannot_run_is_refused_with_one_line() -> None:
    assert "leaves ZeRO one rank" in hsdp_refusal(Mesh(dp=4, dp_replicate=4))
    assert "beside ep=2" in hsdp_refusal(Mesh(dp=4, dp_replicate=2, ep=2))
    assert "shards nothing" in hsdp_refusal(Mesh(dp=4, dp_replicate=2), sharded=False)
    assert "torch.compile" in hsdp_refusal(Mesh(dp=4, dp_replicate=2), compiled=True)
    assert hsdp_refusal(Mesh(dp=4)) is None and hsdp_refusal(Mesh(dp=4, dp_replicate=2)) is None
    graph = transformer_graph(2, 1024, 512, vocab=4096, heads=8)
    with pytest.raises(PinError, match=r"shards nothing .* pin zero ≥ 1 or use dp_replicate=1") as err:
        autopar.solve(graph, 4, cluster="a100-80g", global_batch=8, pins=["dp=4", "dp_replicate=2", "zero=0"])
    assert "\n" not in str(err.value)
    with pytest.raises(PinError, match="dp_shard=0"):
        Pins.parse(["dp_shard=0"])
    with pytest.raises(PinError, match=r"pin dp_shard=3: no mesh .* has a dp that is 3 × dp_replicate"):
        autopar.solve(graph, 4, cluster="a100-80g", global_batch=8, pins=["dp=4", "dp_shard=3"])


def test_a_plan_file_without_the_key_loads_as_sharded_over_all_of_dp() -> None:
    graph = transformer_graph(2, 1024, 512, vocab=4096, heads=8)
    plan = autopar.solve(graph, 4, cluster="a100-80g", global_batch=8, pins=["dp=4", "dp_replicate=2", "zero=3"])
    data = json.loads(plan.to_json())
    assert data["mesh"]["dp_replicate"] == 2 and Plan.from_json(plan.to_json()) == plan
    del data["mesh"]["dp_replicate"]
    old = Plan.from_dict(data)
    assert old.mesh.dp_replicate == 1 and old.mesh.dp == 4 and shard_ranks(old.mesh) == 4


def _tables(preset: str, world: int = 32):
    graph = transformer_graph(2, 1024, 512, vocab=4096, heads=8)
    cluster = PRESETS[preset].for_world_size(world)
    config = Configuration(Mesh(dp=world, dp_replicate=4), 2, Schedule(ScheduleKind.NONE), DataParallelism(True, 3))
    training = TrainingSpec(16 * world, dtype="bf16")
    return (PriceTable(graph, config, cluster, training),
            PriceTable(graph, hsdp_price.twin(config), cluster, training))


def test_replicas_that_save_no_exposed_traffic_are_not_searched() -> None:
    # 16 A100s: every collective hides under compute or costs more with replicas, and HSDP holds more:
    # its configuration is skipped and ZeRO over all of dp stays the plan
    hsdp, twin = _tables("a100-80g", 16)
    assert twin.config.mesh.dp_replicate == 1 and hsdp_price.dominated(hsdp, twin)
    # 32: the embedding's all-gathers, which no compute hides, are cheaper inside a node: searched
    hsdp, twin = _tables("a100-80g", 32)
    embed = hsdp.graph[0].index
    assert min(p.tail_s for p in hsdp.prices[embed]) < min(p.tail_s for p in twin.prices[embed])
    assert not hsdp_price.dominated(hsdp, twin) and not hsdp_price.dominated(hsdp, None)
    # searched only where the twin's exposed traffic could be 2% of its cheapest step
    most = sum(max(p.exposed_comm_s for p in row) for row in twin.prices)
    assert hsdp_price.worth_searching(hsdp, twin, most) and not hsdp_price.worth_searching(hsdp, twin, 1e3 * most)


def test_explain_shows_the_free_plan_beside_its_hsdp_counterfactual() -> None:
    from autopar.tools.explain import explain

    graph = transformer_graph(2, 1024, 512, vocab=4096, heads=8)
    plan = autopar.solve(graph, 32, cluster="a100-80g", global_batch=64, dtype="bf16", pins=["zero=3", "tp=1",
                                                                                             "pp=1"])
    assert plan.mesh.dp_replicate == 1
    text = explain(plan, graph, ["dp_shard=8"]).render()
    assert "dp=32 × dp_replicate=4" in text and "HSDP: 8 dp ranks a replica × 4 replicas" in text
    assert "dp_shard=8:" in text
