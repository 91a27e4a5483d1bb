"""What the edges of a rank's work cost: its first and last FSDP2 unit, and its pipeline sends.

FSDP2 hides a unit's all-gather under the compute before it and its
reduce-scatter under the compute after it: forward issues unit i+1's
all-gather on its own stream while unit i computes, keeping two all-gather
outputs alive at once ("In forward, it uses implicit prefetching and allows
two all-gather output tensors to be alive at once"; "In backward, it uses
explicit prefetching based on the reverse post-forward order",
pytorch/pytorch#128884, the PR that added ``set_modules_to_forward_prefetch``).
Nothing runs before the first unit's all-gather ("The 1st all-gather will not
be able to overlap with anything", docs.pytorch.org/docs/stable/notes/fsdp.html),
nor after the last unit's reduce-scatter in backward, which the root's
post-backward callback waits for before the optimizer step. Pricing hides
each layer's collectives under its own compute (``exposed_comm_s``: a unit
whose compute is smaller than its traffic already shows the difference), so
what that leaves out is the one unit at each end whose neighbour compute does
not exist: a rank whose layers run FSDP2 units at ZeRO stage z pays, per step,
ω × one unit's collectives at z (:func:`edge_exposed_s`), where ω is the
cluster's ``comm_overlap`` (the share the per-layer term had hidden). The unit
priced is the graph's largest (a block, or the root unit holding the
embedding and head), its weights split over tp where tp > 1, and the stage
the plan's highest: the step's tail is the slowest rank's, and every rank is
charged the ends at the highest stage any rank runs. Both are stated bounds
(a rank's own first unit may be smaller, its own stage lower), chosen so that
the term is one number per ZeRO stage that the solver adds with one boolean
per stage (model._edge_exposure): a boolean per rank and stage left GPT-1T on
4,096 GPUs unproved at the 30 s limit.

A pipeline send crosses nodes when the two pipeline ranks' devices sit on
different hosts (:func:`boundary_inter_node`); each tp and dp rank then sends
its own tensor over its own share of its node's NICs (communication.p2p_time_s).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from autopar import contract
from autopar.contract import Engine
from autopar.cost_models.hardware import ClusterSpec
from autopar.graph import LayerGraph


class PriceTable(Protocol):
    """What these functions read of :class:`autopar.planning.pricing.PriceTable` (a protocol:
    pricing imports this module)."""

    config: Any
    cluster: ClusterSpec
    graph: LayerGraph
    engine: Engine
    choices: list[list[Any]]
    largest_unit_params: int

    def runs_as(self, i: int, strategy: Any) -> Any: ...

    def dp_collectives_s(self, params: int, zero: int, share: float = 1.0) -> float: ...

ZERO_LEVELS = (1, 2, 3)  # the FSDP2 stages whose edge units a rank can pay for


def edge_level(table: PriceTable, i: int, k: int) -> int:
    """The ZeRO stage at which layer ``i`` under strategy ``k`` runs an FSDP2 unit (0: none)."""
    c = table.config
    if contract.data_ranks(c.mesh) <= 1 or table.engine is not Engine.FULLY_SHARD or not table.graph[i].param_count:
        return 0
    return table.runs_as(i, table.choices[i][k]).zero


def edge_unit_params(table: PriceTable) -> int:
    """Parameters per rank of the unit priced at each end (see the module docstring)."""
    params = table.largest_unit_params
    return math.ceil(params / table.config.mesh.tp) if table.config.mesh.tp > 1 else params


def edge_exposed_s(table: PriceTable, level: int) -> float:
    """Per step, what the first and last FSDP2 unit expose on a rank whose units run at ZeRO
    stage ``level`` at most (0 for a rank with none)."""
    if level <= 0:
        return 0.0
    return table.cluster.comm_overlap * table.dp_collectives_s(edge_unit_params(table), level)


def edge_increments_s(table: PriceTable) -> dict[int, float]:
    """What each ZeRO level adds to the level below it (the solver's per-rank booleans)."""
    return {z: edge_exposed_s(table, z) - edge_exposed_s(table, z - 1) for z in ZERO_LEVELS}


def node_of(pipeline_rank: int, table: PriceTable) -> int:
    """The node holding pipeline rank ``pipeline_rank``'s first device (ranks are pp-major)."""
    stride = table.config.mesh.stride("pp")
    return pipeline_rank * stride // table.cluster.gpus_per_node


def ranks_inter_node(a: int, b: int, table: PriceTable) -> bool:
    """Whether pipeline ranks ``a`` and ``b`` talk between nodes."""
    return table.cluster.nodes > 1 and a != b and node_of(a, table) != node_of(b, table)


def boundary_inter_node(table: PriceTable, stage: int) -> bool:
    """Whether the sends between virtual stages ``stage − 1`` and ``stage`` cross nodes."""
    c = table.config
    return ranks_inter_node(c.rank_of_stage(stage - 1), c.rank_of_stage(stage), table)
