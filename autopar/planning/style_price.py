"""What a layer's tensor-parallel style (or none; with sequence parallelism or not) costs, whatever its ZeRO stage
and recompute: its compute forward and backward, the tp group's collectives (and cp's, :mod:`.context_price`),
and the activations it saves. Memoised in the search's :class:`~.shared_prices.SharedPrices` (``styles``): the
same layer, style and mesh price alike in every configuration that shares them.
"""

from __future__ import annotations

from typing import Any

from autopar.cost_models.communication import Collective, collective_time_s
from autopar.graph import Layer
from autopar.planning import context_price, loss_price
from autopar.planning.layer_compute import LayerCompute, layer_compute
from autopar.planning.sequence import sequence_activation_bytes, sequence_comm_s

PriceTable = Any  # a planning.pricing.PriceTable (not imported: pricing imports this module)


def style_part(table: PriceTable, layer: Layer, style_name: str | None,
               sp: bool = False) -> tuple[float, float, float, float, float, float, float, LayerCompute]:
    """What a tensor-parallel style (or none; with sequence parallelism or not) sets, whatever the
    ZeRO stage and recompute: forward and backward compute, forward and backward communication
    (tp's and cp's), saved activations, cp's forward and backward part of that communication, and
    the compute's device and host parts (:class:`~.layer_compute.LayerCompute`)."""
    c, b = table.config, table.microbatch_size
    key = (id(layer), style_name, sp, c.mesh.tp, b, table.tp_group, table.act_scale, table.dtype_for_compute,
           id(table.cluster), id(paced := table.paced_cluster), table.training.compiled, c.mesh.ep, c.mesh.cp,
           table.cp_group, c.cp_attention,
           id(table.training.float8), table.loss)
    if key in table.shared.styles:
        return table.shared.styles[key][1]
    acts = layer.activation_bytes_per_sample
    tp_comm_fwd = tp_comm_bwd = 0.0
    if style_name is not None:
        style = layer.tp_style(style_name)
        sharded_act = style.sharded_activation_elems_per_sample * table.graph.dtype_bytes
        acts -= sharded_act * (1 - 1 / c.mesh.tp)
        elem = table.prec.activation_bytes * b
        tp_comm_fwd = collective_time_s(
            Collective.ALL_REDUCE, style.fwd_allreduce_elems * elem, table.tp_group,
            paced, count=style.fwd_allreduce_count,
        ) + loss_price.output_gather_s(table, layer, style, elem)  # a vocab head's logits (or the loss's)
        tp_comm_bwd = collective_time_s(
            Collective.ALL_REDUCE, style.bwd_allreduce_elems * elem, table.tp_group,
            paced, count=style.bwd_allreduce_count,
        )
        overhead = paced.tp_overhead_s  # DTensor's work around each collective
        tp_comm_fwd += overhead * (style.fwd_allreduce_count + (style.fwd_allgather_elems > 0))
        tp_comm_bwd += overhead * style.bwd_allreduce_count
        if sp:
            tp_comm_fwd, tp_comm_bwd = sequence_comm_s(style, elem, table.tp_group, paced)
            acts = sequence_activation_bytes(layer, style, c.mesh.tp, table.graph.dtype_bytes)
    times = layer_compute(layer, style_name, c.mesh.tp, b, table.cluster.device, table.dtype_for_compute,
                          table.act_scale, c.mesh.cp, method=c.cp_attention,
                          compiled=table.compiled_ops(layer),
                          float8=table.training.float8.shapes(layer.name) if table.training.float8 else frozenset())
    heads_split = c.mesh.tp if style_name is not None else 1  # K/V of this tp rank's heads only
    kv_fwd, kv_bwd, acts = context_price.context_part(table, layer, acts, heads_split)
    part = (times.fwd_s, times.bwd_s, tp_comm_fwd + kv_fwd, tp_comm_bwd + kv_bwd, acts, kv_fwd, kv_bwd, times)
    table.shared.styles[key] = (layer, part)  # the layer is kept, so its id is not reused while the memo lives
    return part
