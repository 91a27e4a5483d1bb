"""The data-parallel collectives of one unit per step, hybrid sharding (HSDP) included.

Without replicas (``dp_replicate`` = 1) a ZeRO unit's all-gathers and reduce-scatters run over all
dp × cp ranks, and a ZeRO-0 unit's all-reduce too. With R replicas (:mod:`autopar.contract_hsdp`)
each collective is priced on the links it crosses:

* the all-gathers and reduce-scatters over the **shard group** — one replica's dp/R × cp ranks, tp
  apart (:func:`groups`): inside a node when dp/R × cp × tp fits one, on NVLink;
* after each reduce-scatter, an all-reduce of the rank's gradient shard (1/(dp/R × cp) of the unit's
  gradients) over the **replicate group** — R ranks a replica apart, across nodes: FSDP2's HSDP
  all-reduces every reduce-scattered gradient, so ZeRO-1 pays one a step, ZeRO-2 and -3 one a
  microbatch (:func:`autopar.contract.dp_collectives`' reduce-scatters);
* a ZeRO-0 unit's all-reduce over all dp × cp ranks, as at R = 1.

Memory shards over the shard group (``planning/memory_floor.py``, :attr:`PriceTable.shard_ranks`).

HSDP changes nothing a microbatch computes or sends, only what a step's tail pays and what a rank
holds; so a configuration with replicas whose every price is no better than its twin's without
(:func:`dominated`) cannot give a faster plan, and the search skips it: the twin, what a plan without
the axis means, stays the plan on a tie, and the search does not pay for both. Nor can replicas save
more than the twin's exposed data-parallel traffic (each layer's most, and FSDP2's exposed ends at
their most): the free search takes a configuration with replicas only where that could be at least
:data:`SEARCHED_SAVING` of a step (:func:`worth_searching`; a pin takes it whatever it saves). Without
the screen, the configurations with replicas doubled the sharded rows priced (planning Llama 3 70B on
512 H100: 12.0 s of CPU before the axis, 14.3 s with it, runs 25 minutes apart on a loaded machine);
with it, 2–6% more CPU than the same tree searching no replicas, the same hour, no plan changed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.contract import dp_collectives
from autopar.contract_hsdp import shard_ranks
from autopar.cost_models.communication import Collective, GroupPlacement, collective_time_s, place_group
from autopar.cost_models.hardware import ClusterSpec
from autopar.mesh import Mesh

FP32_BYTES = 4
FLOAT8_BYTES = 1  # a weight FSDP2 gathers in float8 (torchao's float8 all-gather)


def groups(mesh: Mesh, data_ranks: int, dp_group: GroupPlacement,
           cluster: ClusterSpec) -> tuple[int, GroupPlacement, GroupPlacement]:
    """(shard ranks, the shard group, the replicate group): at dp_replicate = 1 all dp × cp ranks, their
    own group (``dp_group``), and no replicate group; else one replica's dp/R × cp neighbouring ranks, tp
    apart, and R ranks ``mesh.stride("dp_replicate")`` apart."""
    if mesh.dp_replicate <= 1:
        return data_ranks, dp_group, place_group(1, 1, cluster.gpus_per_node)
    shards = shard_ranks(mesh)
    return (shards, place_group(shards, mesh.stride("cp"), cluster.gpus_per_node),
            place_group(mesh.dp_replicate, mesh.stride("dp_replicate"), cluster.gpus_per_node))


def dp_collectives_s(table: Any, params: int, zero: int, share: float, float8: tuple[int, int]) -> float:
    """Per step, the collectives of one unit of ``params`` at ``zero`` (see the module docstring).

    Weights gathered in float8 move 1 byte an element; their scales come from one all-reduce a
    step of every gathered weight's amax (``runtime.float8.precompute_scales``: one fp32 value a
    weight, this layer paying its weights' share of the latency). The casts stay priced on whole
    weights (``layer_compute``), though the gather casts the rank's shard: an overestimate of at
    most n·k·(1 − 1/dp) elements' cast a gather, beside the activations' casts."""
    cl = table.cluster
    elements, weights_f8 = float8
    grads = table.prec.grad_bytes * params
    weights = table.prec.param_bytes * (params - elements) + FLOAT8_BYTES * elements
    all_reduce, reduce_scatter, all_gather = dp_collectives(zero, table.config.microbatches)
    shard, replicas = (table.shard_group, table.replicate_group) if zero >= 1 else (table.dp_group, None)
    scales = 0.0
    if weights_f8 and all_gather:
        every = len(table.training.float8.linears) if table.training.float8 is not None else weights_f8
        scales = collective_time_s(Collective.ALL_REDUCE, FP32_BYTES * weights_f8, table.dp_group, cl,
                                   count=weights_f8 / every)
    across = 0.0
    if replicas is not None and replicas.size > 1 and reduce_scatter:
        across = reduce_scatter * collective_time_s(Collective.ALL_REDUCE, grads / table.shard_ranks, replicas, cl,
                                                    count=share)
    return (all_reduce * collective_time_s(Collective.ALL_REDUCE, grads, shard, cl, count=share)
            + reduce_scatter * collective_time_s(Collective.REDUCE_SCATTER, grads, shard, cl, count=share)
            + all_gather * collective_time_s(Collective.ALL_GATHER, weights, shard, cl, count=share)
            + across + scales)


SEARCHED_SAVING = 0.02  # of the twin's cheapest step: less, and replicas are not searched (pins take them)
_SAME = ("forward_mb_s", "compute_mb_s", "forward_tp_mb_s", "tp_comm_mb_s", "activation_mb_bytes", "ep_comm_mb_s",
         "cp_comm_mb_s")  # what a microbatch computes, sends and keeps: HSDP changes none of them
_SLACK = 1e-12  # relative: a price equal to rounding counts as equal


def twin(config: Any) -> Any:
    """``config`` without replicas (dp_replicate = 1): ZeRO over all of dp, what a plan without the axis means."""
    return replace(config, mesh=config.mesh.replace(dp_replicate=1))


def dominated(table: Any, without: Any) -> bool:
    """Whether ``table`` (a configuration with replicas) is no better than ``without`` (its :func:`twin`) in
    every choice of every layer: the same choices, the same per-microbatch prices and activations, a tail
    (exposed data-parallel traffic and optimizer step) and model states no smaller, and FSDP2's exposed
    ends no cheaper at any ZeRO stage. Then every plan of ``table`` has a plan of ``without`` as fast that
    holds no more, and the search need not solve it."""
    from autopar.planning.edges import ZERO_LEVELS, edge_exposed_s

    if without is None or table.choices != without.choices:
        return False
    for row, twin_row in zip(table.prices, without.prices):
        for p, q in zip(row, twin_row):
            if any(getattr(p, f) != getattr(q, f) for f in _SAME):
                return False
            if p.tail_s < q.tail_s * (1 - _SLACK) or p.state_bytes < q.state_bytes:
                return False
    return all(edge_exposed_s(table, z) >= edge_exposed_s(without, z) * (1 - _SLACK) for z in ZERO_LEVELS)


def worth_searching(table: Any, without: Any, floor_s: float) -> bool:
    """Whether the search takes ``table`` (a configuration with replicas) beside ``without``, its twin whose
    cheapest step is at least ``floor_s``: its replicas could save :data:`SEARCHED_SAVING` of that (at most
    the twin's exposed data-parallel traffic: each layer's most over its choices, and FSDP2's exposed ends
    at their most), and it is not :func:`dominated`."""
    from autopar.planning.edges import ZERO_LEVELS, edge_exposed_s

    if without is None:
        return True
    most = (sum(max((p.exposed_comm_s for p in row), default=0.0) for row in without.prices)
            + max(edge_exposed_s(without, z) for z in ZERO_LEVELS))
    return most >= SEARCHED_SAVING * floor_s and not dominated(table, without)
