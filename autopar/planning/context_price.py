"""What context parallelism (cp) adds to a layer's price and takes from it (``passes/context_parallel.py`` runs it).

A rank holds S/cp tokens of each sample: compute is divided in ``layer_compute`` (its ``cp``
argument), the loss's logits and the workspace in :class:`~autopar.planning.pricing.PriceTable`,
and here, per layer and microbatch of b samples, by the plan's attention method
(:class:`~autopar.choice.CpAttention`, the configuration's ``cp_attention``). All-gather:

    K/V all-gather (forward) and its reduce-scatter (backward): (cp − 1)/cp · 2 · b · S · h_kv/tp · bytes each
                      (h_kv/tp: a tensor-parallel style splits the heads; h_kv on a layer tp leaves whole)
    kept activations: acts / cp + (cp − 1)/cp · K/V bytes (the other ranks', saved by SDPA)
                      + attention calls · L · (2·cp + 1)·L · bytes / b, L = S/(2·cp)
                        (each call's two prefix masks, saved as biases: :func:`mask_bytes`)

Ulysses (the head all-to-all), with Q = the query's and O = the output's bytes:

    forward: four all-to-alls, of q, k, v (sequence split → head split) and of the output (back), each
             rank sending its local b · S/cp · h · bytes, (cp − 1)/cp of it to other ranks:
             (cp − 1)/cp² · b · S · h · bytes each (Q, K, V, O; h/tp under a style splitting heads)
    backward: the same four, reversed (autograd's all-to-all of each gradient)
    kept activations: acts / cp — SDPA keeps q, k, v and the output of heads/cp over S, the bytes
                      of all heads over S/cp that one device's activations ÷ cp already count
                      (the all-to-alls save nothing; the causal mask is SDPA's own, not a bias)

and the data-parallel group the gradients average and ZeRO shards over is the dp × cp ranks.
Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from typing import Any

from autopar import contract
from autopar.choice import CpAttention
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
    """Under cp, per microbatch: the forward collectives of the layer's attention over the cp group and
    their backward (on the critical path: attention waits for them), and the activations a sample
    keeps, by the configuration's method (module docstring); (0, 0, ``acts``) at cp = 1.
    ``heads_split``: the tp degree when a tensor-parallel style splits the layer's heads (each tp rank
    moves and keeps its heads' share, 1/tp of them), else 1."""
    cp = table.config.mesh.cp
    if cp <= 1:
        return 0.0, 0.0, acts
    kv = layer.kv_bytes_per_sample / heads_split
    if table.config.cp_attention is CpAttention.ULYSSES:
        fwd = bwd = ulysses_s(table, layer, heads_split)
        return fwd, bwd, acts / cp
    gathered = table.microbatch_size * kv * table.act_scale
    fwd = collective_time_s(Collective.ALL_GATHER, gathered, table.cp_group, table.cluster)
    bwd = collective_time_s(Collective.REDUCE_SCATTER, gathered, table.cp_group, table.cluster)
    return fwd, bwd, acts / cp + kept_bytes(table, layer, heads_split)


def ulysses_s(table: Any, layer: Layer, heads_split: int = 1) -> float:
    """The four all-to-alls of one direction (q, k, v in, the output back), each rank sending its local
    b · S/cp tokens of the tensor (:func:`~autopar.cost_models.communication.all_to_all_time_s` moves
    (cp − 1)/cp of it): (cp − 1)/cp² · b · S · h · bytes each. K and V together are ``kv_bytes``, Q and
    the output ``qo_bytes`` (per sample, whole sequence)."""
    cp, b = table.config.mesh.cp, table.microbatch_size
    local = b * table.act_scale / cp / heads_split
    q_o = layer.qo_bytes_per_sample / 2 * local
    k_v = layer.kv_bytes_per_sample / 2 * local
    return 2 * (collective_time_s(Collective.ALL_TO_ALL, q_o, table.cp_group, table.cluster)
                + collective_time_s(Collective.ALL_TO_ALL, k_v, table.cp_group, table.cluster))


def kept_bytes(table: Any, layer: Layer, heads_split: int = 1) -> float:
    """What cp's attention keeps per sample (captured dtype) beyond the layer's activations ÷ cp: under
    all-gather the other ranks' K and V (saved by SDPA) and the prefix masks; under Ulysses nothing
    (module docstring)."""
    cp = table.config.mesh.cp
    if cp <= 1 or table.config.cp_attention is CpAttention.ULYSSES:
        return 0.0
    mask = mask_bytes(table, layer) / table.act_scale / table.microbatch_size  # per sample, captured dtype
    return layer.kv_bytes_per_sample / heads_split * (cp - 1) / cp + mask


def mask_bytes(table: Any, layer: Layer) -> float:
    """Under cp, the causal masks the layer's attention calls save, per microbatch, in the activations'
    dtype (SDPA keeps a boolean mask as an additive bias, one per kernel call; measured on CPU). Each
    call runs one SDPA per query chunk on its key prefix (``passes/context_parallel.prefix_attention``),
    masked L × (r + 1)·L and L × (2·cp − r)·L on rank r, L = S/(2·cp): L × (2·cp + 1)·L together on
    every rank, (2·cp + 1)/(4·cp) of the S/cp × S one masked call over all keys would keep."""
    cp, seq = table.config.mesh.cp, table.graph.seq_len or 0
    if cp <= 1 or table.config.cp_attention is CpAttention.ULYSSES:
        return 0.0
    chunk = seq // (2 * cp)
    return layer.attention_calls * chunk * (2 * cp + 1) * chunk * table.prec.activation_bytes


__all__ = ["context_part", "data_group", "kept_bytes", "mask_bytes", "ulysses_s"]
