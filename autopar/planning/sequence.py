"""Sequence parallelism's price: what Megatron-SP changes in a tensor-parallel layer.

With sequence parallelism on a Megatron style (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4.2.2), the
hidden state outside the projections holds 1/tp of the sequence. Per
microbatch, forward: each distinct column input is all-gathered and each row
output reduce-scattered (the all-reduce's two halves, so the bytes are the
same); backward: the conjugates (reduce-scatter of the gathered inputs'
gradients, all-gather of the row outputs'), and one all-reduce per replicated
tensor whose gradient is summed over the tp group (norm weights, row biases).

Activations: everything the layer saves outside the tensor-parallel region is
divided by tp, except the gathered column inputs, which the projections keep
whole for their backward (the runtime keeps what autograd saves; Megatron's
re-gathering in backward is not done here).

A region of sequence-parallel layers is entered by keeping this rank's share
(its gradient is all-gathered in backward) and left by an all-gather (forward):
:func:`region_s` is that pair, charged once per pipeline rank, model chunk and
cost class holding sequence-parallel layers (the contract: the hidden state is
gathered before a pipeline boundary, so a region never spans stages).
"""

from __future__ import annotations

from typing import Any

from autopar.cost_models.communication import Collective, GroupPlacement, collective_time_s
from autopar.cost_models.hardware import ClusterSpec
from autopar.graph import Layer
from autopar.tp_style import TPStyle


def sequence_comm_s(style: TPStyle, elem_bytes: float, group: GroupPlacement,
                    cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) tensor-parallel collectives of one microbatch with sequence parallelism;
    ``elem_bytes``: bytes of one activation element × the microbatch size."""
    gather = collective_time_s(Collective.ALL_GATHER, style.sequence_gather_elems * elem_bytes, group, cluster,
                               count=style.sequence_gathers)
    scatter = collective_time_s(Collective.REDUCE_SCATTER, style.fwd_allreduce_elems * elem_bytes, group, cluster,
                                count=style.fwd_allreduce_count)
    gather_back = collective_time_s(Collective.REDUCE_SCATTER, style.sequence_gather_elems * elem_bytes, group,
                                    cluster, count=style.sequence_gathers)
    scatter_back = collective_time_s(Collective.ALL_GATHER, style.fwd_allreduce_elems * elem_bytes, group,
                                     cluster, count=style.fwd_allreduce_count)
    # the summed gradients are a parameter's: their size does not grow with the microbatch
    sums = collective_time_s(Collective.ALL_REDUCE, style.sequence_grad_sum_elems * 4.0, group, cluster,
                             count=style.sequence_grad_sums)
    overhead = cluster.tp_overhead_s
    fwd = gather + scatter + overhead * (style.sequence_gathers + style.fwd_allreduce_count)
    bwd = gather_back + scatter_back + sums + overhead * (
        style.sequence_gathers + style.fwd_allreduce_count + style.sequence_grad_sums)
    return fwd, bwd


def sequence_activation_bytes(layer: Layer, style: TPStyle, tp: int, dtype_bytes: int) -> float:
    """Bytes per sample the layer keeps for backward with sequence parallelism on ``style`` (the
    captured dtype's): the tensor-parallel share, the rest over tp, the gathered inputs whole."""
    sharded = style.sharded_activation_elems_per_sample * dtype_bytes
    gathered = style.sequence_gather_elems * dtype_bytes
    rest = max(layer.activation_bytes_per_sample - sharded - gathered, 0.0)
    return sharded / tp + rest / tp + min(gathered, layer.activation_bytes_per_sample - sharded)


def sequence_input_bytes(layer: Layer, style: TPStyle, tp: int, dtype_bytes: int) -> float:
    """What recompute keeps of the layer's inputs with sequence parallelism: the hidden state's share."""
    stream = min(style.sequence_stream_elems * dtype_bytes, layer.input_bytes_per_sample)
    return layer.input_bytes_per_sample - stream * (1 - 1 / tp)


def region_s(style: TPStyle, elem_bytes: float, group: GroupPlacement, cluster: ClusterSpec) -> float:
    """Entering and leaving one sequence-parallel region, per microbatch: two all-gathers of the
    hidden state (the exit's forward, the entry's backward)."""
    return 2 * (collective_time_s(Collective.ALL_GATHER, style.sequence_stream_elems * elem_bytes, group, cluster)
                + cluster.tp_overhead_s)


def sequence_regions(table: Any, stages: tuple[int, ...], strategies: tuple) -> list[float]:
    """Per pipeline rank of a :class:`~autopar.planning.pricing.PriceTable`'s configuration, the
    sequence-parallel regions' entries and exits per microbatch: each cost class with a
    sequence-parallel layer on the rank pays one region per model chunk (as the solver prices it)."""
    c, out = table.config, [0.0] * table.config.mesh.pp
    seen: set[tuple[int, int]] = set()
    for i, (stage, strategy) in enumerate(zip(stages, strategies)):
        rank, cls = c.rank_of_stage(stage), table.graph.cost_classes[i]
        if strategy.sp and (rank, cls) not in seen:
            seen.add((rank, cls))
            out[rank] += c.schedule.chunks * table.sequence_region_s(i, table.index_of(i, strategy))
    return out


__all__ = ["region_s", "sequence_activation_bytes", "sequence_comm_s", "sequence_input_bytes", "sequence_regions"]
