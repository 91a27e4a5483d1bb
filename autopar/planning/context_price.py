"""What context parallelism (cp) adds to a layer's price and takes from it (``passes/context_parallel.py`` runs it).

A rank holds S/cp tokens of each sample: compute is divided in ``layer_compute`` (its ``cp``
argument), the loss's logits and the workspace in :class:`~autopar.planning.pricing.PriceTable`,
and here, per layer and microbatch of b samples:

    K/V all-gather (forward) and its reduce-scatter (backward): (cp − 1)/cp · 2 · b · S · h_kv/tp · bytes each
                      (h_kv/tp: a tensor-parallel style splits the heads; h_kv on a layer tp leaves whole)
    kept activations: acts / cp + (cp − 1)/cp · K/V bytes (the other ranks', saved by SDPA)
                      + attention calls · L · (2·cp + 1)·L · bytes / b, L = S/(2·cp)
                        (each call's two prefix masks, saved as biases: :func:`mask_bytes`)

and the data-parallel group the gradients average and ZeRO shards over is the dp × cp ranks.
Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from typing import Any

from autopar import contract
from autopar.cost_models.communication import Collective, GroupPlacement, collective_time_s, place_group
from autopar.cost_models.hardware import ClusterSpec
from autopar.graph import Layer
from autopar.mesh import Mesh


def data_group(mesh: Mesh, dp_group: GroupPlacement, cluster: ClusterSpec) -> tuple[int, GroupPlacement]:
    """(dp × cp, its group): contiguous, every tp-th rank (cp sits between dp and tp); the dp group at cp = 1."""
    ranks = contract.data_ranks(mesh)
    if mesh.cp <= 1:
        return ranks, dp_group
    return ranks, place_group(ranks, mesh.stride("cp"), cluster.gpus_per_node)


def context_part(table: Any, layer: Layer, acts: float, heads_split: int = 1) -> tuple[float, float, float]:
    """Under cp, per microbatch: the forward all-gather of the layer's K and V over the cp group and
    the backward reduce-scatter of their gradients (on the critical path: attention waits for
    them), and the activations a sample keeps (module docstring); (0, 0, ``acts``) at cp = 1.
    ``heads_split``: the tp degree when a tensor-parallel style splits the layer's heads (each tp rank
    gathers and keeps its heads' K and V, 1/tp of them), else 1."""
    cp = table.config.mesh.cp
    if cp <= 1:
        return 0.0, 0.0, acts
    kv = layer.kv_bytes_per_sample / heads_split
    gathered = table.microbatch_size * kv * table.act_scale
    fwd = collective_time_s(Collective.ALL_GATHER, gathered, table.cp_group, table.cluster)
    bwd = collective_time_s(Collective.REDUCE_SCATTER, gathered, table.cp_group, table.cluster)
    mask = mask_bytes(table, layer) / table.act_scale / table.microbatch_size  # per sample, captured dtype
    return fwd, bwd, acts / cp + kv * (cp - 1) / cp + mask


def mask_bytes(table: Any, layer: Layer) -> float:
    """Under cp, the causal masks the layer's attention calls save, per microbatch, in the activations'
    dtype (SDPA keeps a boolean mask as an additive bias, one per kernel call; measured on CPU). Each
    call runs one SDPA per query chunk on its key prefix (``passes/context_parallel.prefix_attention``),
    masked L × (r + 1)·L and L × (2·cp − r)·L on rank r, L = S/(2·cp): L × (2·cp + 1)·L together on
    every rank, (2·cp + 1)/(4·cp) of the S/cp × S one masked call over all keys would keep."""
    cp, seq = table.config.mesh.cp, table.graph.seq_len or 0
    if cp <= 1:
        return 0.0
    chunk = seq // (2 * cp)
    return layer.attention_calls * chunk * (2 * cp + 1) * chunk * table.prec.activation_bytes


__all__ = ["context_part", "data_group", "mask_bytes"]
