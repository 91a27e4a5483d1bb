"""The step-time model of autopar.planning.pricing where ranks share a host's cores."""

from __future__ import annotations

from dataclasses import replace

import pytest
from autopar.cost_models.hardware import PRESETS
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from synthetic import transformer_graph

from autopar.contract import REPLICATED, DataParallelism
from autopar.graph import LayerGraph
from autopar.planning.pricing import MeshConfig, PriceTable, Strategy, TrainingSpec

GPIPE = Schedule(ScheduleKind.GPIPE)


def _table(pp: int, dp: int, m: int, *, per_node: int, cores: int, nodes: int = 1) -> PriceTable:
    graph = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    cluster = replace(PRESETS["a100-80g"], gpus_per_node=per_node, cores_per_node=cores)
    cluster = cluster.for_world_size(pp * dp, nodes=nodes)
    return PriceTable(graph, MeshConfig(pp, dp, 1, m, GPIPE), cluster, TrainingSpec(8 * dp * m))


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

    def optimizer_s(strategy: Strategy, dtensor_s: float) -> float:
        # a pure-DP plan is DDP; a plan sharding a block is FSDP2 (autopar.contract)
        mode = DataParallelism(sharded=True, root_zero=3) if strategy.zero else REPLICATED
        config = MeshConfig(1, 2, 1, 1, Schedule(ScheduleKind.NONE), mode)
        table = PriceTable(graph, config, replace(cluster, optimizer_dtensor_s=dtensor_s), TrainingSpec(8))
        return table.prices[1][table.strategies[1].index(strategy)].optimizer_s

    ddp, fsdp = Strategy(None, 0, False), Strategy(None, 3, False)
    # DDP keeps plain tensors; FSDP2 shards each of the block's 12 parameters into a DTensor
    assert optimizer_s(ddp, 1e-3) == pytest.approx(optimizer_s(ddp, 0.0))
    assert optimizer_s(fsdp, 1e-3) == pytest.approx(optimizer_s(fsdp, 0.0) + 12e-3)


def test_fsdp2_overhead_is_priced_per_collective_and_never_hidden():
    graph = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    cluster = replace(PRESETS["a100-80g"], gpus_per_node=2, comm_overlap=1.0).for_world_size(2)

    def exposed(strategy: Strategy, overhead: float) -> float:
        mode = DataParallelism(sharded=True, root_zero=3) if strategy.zero else REPLICATED
        config = MeshConfig(1, 2, 1, 2, Schedule(ScheduleKind.NONE), mode)  # 2 microbatches
        table = PriceTable(graph, config, replace(cluster, zero_overhead_s=overhead), TrainingSpec(8))
        return table.prices[1][table.strategies[1].index(strategy)].exposed_comm_s

    # a block is its own FSDP2 unit; ZeRO-1: RS + AG a step, ZeRO-2: RS per microbatch + AG, ZeRO-3: 2 AG + RS each
    for zero, collectives in ((1, 2), (2, 2 + 1), (3, 2 * 3)):
        strategy = Strategy(None, zero, False)
        assert exposed(strategy, 1e-3) - exposed(strategy, 0.0) == pytest.approx(collectives * 1e-3)
    ddp = Strategy(None, 0, False)
    assert exposed(ddp, 1e-3) == exposed(ddp, 0.0)
