"""The step-time model of autopar.planning.pricing where ranks share a host's cores."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
from synthetic import transformer_graph

from autopar.choice import LayerChoice
from autopar.contract import REPLICATED, DataParallelism
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.graph import LayerGraph
from autopar.mesh import Mesh
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable

GPIPE = Schedule(ScheduleKind.GPIPE)


def _table(pp: int, dp: int, m: int, *, per_node: int, cores: int, nodes: int = 1) -> PriceTable:
    graph = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    cluster = replace(PRESETS["a100-80g"], gpus_per_node=per_node, cores_per_node=cores)
    cluster = cluster.for_world_size(pp * dp, nodes=nodes)
    return PriceTable(graph, Configuration(Mesh(pp=pp, dp=dp), m, GPIPE), cluster, TrainingSpec(8 * dp * m))


def test_devices_of_their_own_pay_the_textbook_bubble():
    table = _table(2, 2, 2, per_node=4, cores=0)
    assert table.core_sharing == (1, 1)
    assert table.pipeline_s([1.0, 1.0]) == pytest.approx(3.0)  # (m + pp − 1)·T
    assert table.pipeline_s([1.0, 0.5]) == pytest.approx(2.5)  # m·T + (S − T)


def test_waiting_pipeline_ranks_lend_their_cores_to_working_ones():
    # 4 ranks on 2 cores: a rank alone gets a whole core, twice its pace with every rank busy
    table = _table(2, 2, 2, per_node=4, cores=2)
    assert table.core_sharing == (2, 2)
    # the two stages' 2·2 microbatches of work keep both cores busy throughout: 2T, not 3T
    assert table.pipeline_s([1.0, 1.0]) == pytest.approx(2.0)
    # one microbatch: one stage works at a time, at twice the pace
    assert _table(2, 2, 1, per_node=4, cores=2).pipeline_s([1.0, 1.0]) == pytest.approx(1.0)
    # unequal stages: the critical path at double pace (1.25) is shorter than the work (1.5)
    assert table.pipeline_s([1.0, 0.5]) == pytest.approx(1.5)
    # a share of the cores (other work on the host takes the rest): 2.5 of 4 cores lend 4/2.5 = 1.6×,
    # and less than a whole core lends all of it — a rank alone gets the ranks' whole share
    assert _table(2, 2, 1, per_node=4, cores=2.5).core_sharing == (Fraction(8, 5), 2)
    assert _table(2, 2, 1, per_node=4, cores=0.5).core_sharing == (4, 2)


def test_no_cores_are_lent_between_nodes_or_without_oversubscription():
    # each node holds one stage: its ranks wait at the same moments and have no one to lend to
    assert _table(2, 2, 2, per_node=2, cores=1, nodes=2).core_sharing == (1, 1)
    # as many cores as ranks: nobody runs faster for another's wait
    assert _table(2, 2, 2, per_node=4, cores=4).core_sharing == (1, 1)
    assert _table(2, 2, 2, per_node=4, cores=4).pipeline_s([1.0, 1.0]) == pytest.approx(3.0)


def test_dtensor_parameters_cost_the_optimizer_a_dispatch_per_tensor():
    synthetic = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    names = tuple(f"w{i}" for i in range(12))
    graph = LayerGraph([replace(layer, param_names=names) for layer in synthetic], model_name="named",
                       example_batch=1, dtype_bytes=2, seq_len=64)
    cluster = replace(PRESETS["a100-80g"], gpus_per_node=2).for_world_size(2)

    def optimizer_s(strategy: LayerChoice, dtensor_s: float) -> float:
        # a pure-DP plan is DDP; a plan sharding a block is FSDP2 (autopar.contract)
        mode = DataParallelism(sharded=True, root_zero=3) if strategy.zero else REPLICATED
        config = Configuration(Mesh(dp=2), 1, Schedule(ScheduleKind.NONE), mode)
        table = PriceTable(graph, config, replace(cluster, optimizer_dtensor_s=dtensor_s), TrainingSpec(8))
        return table.prices[1][table.choices[1].index(strategy)].optimizer_s

    ddp, fsdp = LayerChoice(None, 0, False), LayerChoice(None, 3, False)
    # DDP keeps plain tensors; FSDP2 shards each of the block's 12 parameters into a DTensor
    assert optimizer_s(ddp, 1e-3) == pytest.approx(optimizer_s(ddp, 0.0))
    assert optimizer_s(fsdp, 1e-3) == pytest.approx(optimizer_s(fsdp, 0.0) + 12e-3)


def test_fsdp2_overhead_is_priced_per_collective_and_never_hidden():
    graph = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    cluster = replace(PRESETS["a100-80g"], gpus_per_node=2, comm_overlap=1.0).for_world_size(2)

    def exposed(strategy: LayerChoice, overhead: float) -> float:
        mode = DataParallelism(sharded=True, root_zero=3) if strategy.zero else REPLICATED
        config = Configuration(Mesh(dp=2), 2, Schedule(ScheduleKind.NONE), mode)  # 2 microbatches
        table = PriceTable(graph, config, replace(cluster, zero_overhead_s=overhead), TrainingSpec(8))
        return table.prices[1][table.choices[1].index(strategy)].exposed_comm_s

    # a block is its own FSDP2 unit; ZeRO-1: RS + AG a step, ZeRO-2: RS per microbatch + AG, ZeRO-3: 2 AG + RS each
    for zero, collectives in ((1, 2), (2, 2 + 1), (3, 2 * 3)):
        strategy = LayerChoice(None, zero, False)
        assert exposed(strategy, 1e-3) - exposed(strategy, 0.0) == pytest.approx(collectives * 1e-3)
    ddp = LayerChoice(None, 0, False)
    assert exposed(ddp, 1e-3) == exposed(ddp, 0.0)


def _gpu_table(pp: int, dp: int, tp: int, mode: DataParallelism = REPLICATED, m: int = 1) -> PriceTable:
    graph = transformer_graph(4, 1024, 512, vocab=4096, heads=8)
    cluster = PRESETS["a100-40g"].for_world_size(pp * dp * tp)
    schedule = Schedule(ScheduleKind.ONE_F_ONE_B) if pp > 1 else GPIPE
    config = Configuration(Mesh(pp=pp, dp=dp, tp=tp), m, schedule, mode)
    return PriceTable(graph, config, cluster, TrainingSpec(8 * dp * m))


def test_pipeline_sends_cross_nodes_only_between_ranks_on_different_nodes():
    # 16 GPUs on 2 nodes, dp·tp = 4: pipeline ranks 0, 1 on node 0 and 2, 3 on node 1
    table = _gpu_table(4, 2, 2, m=4)
    assert table.boundary_inter_node == (False, False, True, False)
    cut = 2
    assert table.p2p_s(cut, 2) > 5 * table.p2p_s(cut, 1)  # over a 24 GB/s NIC, not 230 GB/s NVLink
    assert table.p2p_s(cut) == table.p2p_s(cut, 1)  # what a bound may count on: the cheapest
    # the tied ends: rank 0 and rank 3 are on different nodes
    assert table.pp_inter_node
    # dp·tp = 8 fills a node: every boundary crosses
    assert all(_gpu_table(2, 4, 2, m=4).boundary_inter_node[1:])


def test_the_first_and_last_fsdp2_unit_show_on_every_sharded_rank():
    from autopar.planning import edges
    from autopar.planning.evaluate import evaluate

    table = _gpu_table(1, 16, 1, DataParallelism(sharded=True, root_zero=3), m=2)
    n = len(table.graph)
    zero3 = evaluate(table, (0,) * n, tuple(LayerChoice(None, 3) for _ in range(n)))
    per_layer = sum(table.prices[i][table.index_of(i, LayerChoice(None, 3))].exposed_comm_s for i in range(n))
    edge = edges.edge_exposed_s(table, 3)
    # one unit's ZeRO-3 traffic per step (2 all-gathers and a reduce-scatter per microbatch), all of it shown
    assert edge == pytest.approx(table.dp_collectives_s(table.largest_unit_params, 3)) and edge > 0
    assert zero3.breakdown.dp_comm_s == pytest.approx(per_layer + edge)
    # ZeRO-1's ends show once a step: less than ZeRO-3's
    assert 0 < edges.edge_exposed_s(table, 1) < edges.edge_exposed_s(table, 2) < edge
    # a replicated plan has no FSDP2 unit to expose
    replicated = _gpu_table(1, 16, 1, m=2)
    assert edges.edge_level(replicated, 1, 0) == 0


def _shared_host_table(pp: int, tp: int, m: int, cores: float) -> PriceTable:
    """4 ranks on one host of ``cores`` cores, with calibrate's blocking waits (measured with all 4 busy)."""
    graph = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    cluster = replace(PRESETS["a100-80g"], gpus_per_node=4, cores_per_node=cores, collective_sync_s=5e-4,
                      tp_overhead_s=4e-3).for_world_size(pp * tp)
    return PriceTable(graph, Configuration(Mesh(pp=pp, tp=tp), m, GPIPE), cluster, TrainingSpec(8 * m))


def test_collectives_wait_only_for_ranks_that_compete_for_the_cores():
    # pp=2 × tp=2, one microbatch, 4 ranks on 2 cores: one stage works at a time, its two tp ranks each
    # have a core, so their all-reduces and the pipeline's sends wait for no descheduled peer
    alone = _shared_host_table(2, 2, 1, cores=2)
    assert alone.paced_cluster.collective_sync_s == 0 and alone.paced_cluster.tp_overhead_s == 0
    busy = _shared_host_table(2, 2, 2, cores=2)  # two microbatches: both stages at once, as calibrate measured
    assert busy.paced_cluster is busy.cluster
    cut = 2
    assert busy.p2p_s(cut, 1) - alone.p2p_s(cut, 1) == pytest.approx(5e-4)
    # a tp layer's collectives per microbatch: its tp_overhead_s and sync dropped while alone
    i = 1
    k_alone = next(k for k, c in enumerate(alone.choices[i]) if c.tp is not None and not c.sp)
    k_busy = busy.choices[i].index(alone.choices[i][k_alone])
    assert busy.prices[i][k_busy].tp_comm_mb_s - alone.prices[i][k_alone].tp_comm_mb_s > 2 * 4e-3
    # fewer cores (other work on the host): the two busy ranks are off their cores half the time,
    # against 3/4 with all four busy: 2/3 of the measured wait
    loaded = _shared_host_table(2, 2, 1, cores=1)
    assert loaded.paced_cluster.collective_sync_s == pytest.approx(5e-4 * 2 / 3)
    # every rank busy (pp = 1), or a GPU node (no shared cores): the cluster as calibrated
    assert _shared_host_table(1, 4, 1, cores=2).paced_cluster.collective_sync_s == 5e-4
    gpu = _shared_host_table(2, 2, 1, cores=0)
    assert gpu.paced_cluster is gpu.cluster
