"""What expert parallelism (ep) adds to a layer's price (``passes/expert_parallel.py`` runs it).

Expert parallelism (``ep`` > 1, folded into dp × cp; ``passes/expert_parallel.py``): an MoE layer's
routed experts (``MoEFacts.routed_params``) are split over the ep group and left out of the dp
engine — a rank holds 1/ep of them. At the layer's ZeRO-0 they are whole over the
expert-data-parallel (edp) group of (dp × cp)/ep ranks and their gradients all-reduced over it once a
step after the backward (never hidden: the runtime issues it after the last microbatch); at
ZeRO ≥ 1 the experts module is an FSDP2 unit of its own over edp at that stage (ZeRO-1 runs as
ZeRO-2 there), priced like any unit over the edp group (:func:`expert_zero`). Per microbatch
each block moves its tokens' top-k rows (the layer's boundary, b·s·H, times top-k) to their experts and back with
two all-to-alls forward and two backward, plus the per-expert row counts forward (the all-to-alls
are on the critical path, counted with the layer's collectives, ``tp_comm_mb_s``, as ``ep_comm_mb_s``;
a recomputed forward issues its two again), and its routed activations carry the load-imbalance
margin of :meth:`autopar.experts.MoEFacts.activation_margin`. Expert compute is priced at balanced
routing (top-k rows a token, the captured FLOPs).

Each function takes the layer's :class:`~autopar.planning.pricing.PriceTable` (its configuration, groups,
precision and cluster). Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from typing import Any

from autopar import contract
from autopar.cost_models.communication import Collective, collective_time_s
from autopar.experts import ExpertLayout
from autopar.graph import Layer


def split_params(table: Any, layer: Layer) -> int:
    """The layer's routed-expert parameters that ep splits (0 at ep = 1)."""
    return sum(m.routed_params for m in layer.moe) if table.config.mesh.ep > 1 else 0



def local_params(table: Any, layer: Layer) -> int:
    """This rank's share of :func:`split_params`: 1/ep of every block's experts."""
    return split_params(table, layer) // table.config.mesh.ep



def dtensor_params(table: Any, layer: Layer) -> int:
    """The layer's parameters ep makes DTensors (3-D experts' [E, …] weights; a module list's
    experts stay plain): the optimizer steps them through DTensor dispatch beside a DDP root."""
    if table.config.mesh.ep <= 1:
        return 0
    return sum(m.expert_tensors for m in layer.moe if m.layout is not ExpertLayout.MODULE_LIST)


def expert_zero(table: Any, layer: Layer, zero: int) -> int:
    """The ZeRO stage this rank's experts run at over the edp group (``passes/expert_parallel.py``): the
    layer's, where there are experts split by ep and an edp group to shard over, else 0; ZeRO-1
    runs as ZeRO-2 there (the experts' FSDP2 unit reduce-scatters every microbatch). A capacity block's
    own 3-D experts stay whole over edp at every stage (0: they cannot be a unit apart from the block's
    router, ``passes/expert_capacity.py``)."""
    if not zero or not local_params(table, layer) or table.edp_group.size <= 1:
        return 0
    if any(m.block_held for m in layer.moe):
        return 0
    return max(zero, 2)



def collectives_s(table: Any, experts: int, zero: int) -> float:
    """Per step: the experts' FSDP2 collectives over the edp group at ``zero`` ≥ 1 (the experts module is a
    unit of its own: its whole latency)."""
    if not zero or not experts:
        return 0.0
    group, cl = table.edp_group, table.cluster
    grads, weights = table.prec.grad_bytes * experts, table.prec.param_bytes * experts
    _, reduce_scatter, all_gather = contract.dp_collectives(zero, table.config.microbatches)
    return (reduce_scatter * collective_time_s(Collective.REDUCE_SCATTER, grads, group, cl)
            + all_gather * collective_time_s(Collective.ALL_GATHER, weights, group, cl))



def dispatch_s(table: Any, layer: Layer) -> tuple[float, float]:
    """Per microbatch under ep, (forward, backward): each MoE block's dispatch and combine
    all-to-alls (a rank sends its tokens' top-k rows, b · the layer's boundary bytes a sample
    × top-k, each way; under cp its S/cp tokens': ÷ cp) and, forward, the all-to-all of its
    per-expert row counts (int64); the backward runs the two all-to-alls in reverse. A fixed-capacity
    block (GShard/Switch) sends its whole dispatched [E, C, H] tensor instead, E·C = capacity factor ×
    tokens × top-k slots (dropped and padded slots included), and no counts (every rank's C is the same)."""
    mesh = table.config.mesh
    if mesh.ep <= 1 or not layer.moe:
        return 0.0, 0.0
    tokens_bytes = table.microbatch_size * layer.boundary_bytes_per_sample * table.act_scale / mesh.cp
    g = table.ep_group
    rows = sum(collective_time_s(Collective.ALL_TO_ALL, tokens_bytes * m.top_k * (m.capacity_factor or 1.0),
                                 g, table.cluster) for m in layer.moe)
    counts = sum(collective_time_s(Collective.ALL_TO_ALL, 8 * m.num_experts, g, table.cluster)
                 for m in layer.moe if m.capacity_factor is None)
    return 2 * rows + counts, 2 * rows



def sync_s(table: Any, layer: Layer) -> float:
    """Per step under ep: the all-reduce of this rank's expert gradients over the expert-data-parallel
    group, one per expert weight (unbucketed, after the backward: never hidden)."""
    experts = local_params(table, layer)
    if not experts:
        return 0.0
    count = sum(m.expert_tensors for m in layer.moe)  # MoEFacts.expert_tensors: a module list's one bucket
    return collective_time_s(Collective.ALL_REDUCE, table.prec.grad_bytes * experts, table.edp_group,
                             table.cluster, count=count)



def imbalance_bytes(table: Any, layer: Layer) -> float:
    """Activation bytes per sample the routed experts of one rank may hold beyond the balanced share
    under ep (:meth:`autopar.experts.MoEFacts.activation_margin`, minus the share already counted)."""
    ep, cp = table.config.mesh.ep, table.config.mesh.cp  # under cp a sample's S/cp tokens on this rank
    return sum(m.routed_activation_bytes_per_sample * (m.activation_margin(ep) - 1.0) for m in layer.moe) / cp
