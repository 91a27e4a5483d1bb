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
                      (the all-to-alls save nothing; the causal mask is SDPA's own, not a bias).
                      Attention written by hand (``passes/manual_attention.py``) moves q, kᵀ, v and its
                      output alike (capture records their bytes and heads); its masked softmax keeps
                      S × S scores for heads/cp, as many as S/cp × S for every head under all-gather:
                      one device's ÷ cp again (its S × S boolean mask beyond that: a plan note)

Ring (K/V passed round the cp ring by torch's ring, ``passes/context_ring.py``), per attention call,
with x the time to pass the rank's K/V (b · S/cp · h_kv · bytes: ``kv_bytes`` / calls / cp) to the
next rank and y its K/V gradient's (in fp32, torch's ring accumulates them so), each
``p2p_time_s`` over the link the cp group's farthest hop takes (NVLink within a node, the rank's NIC
share across nodes: the steps are in lockstep, so the slowest hop paces each) plus the collective's
wait for the slowest rank; a_0, a the step-0 and later steps' attention (``layer_compute.ring_step_times``),
b_0, b their backward. Each transfer is issued before the step's attention and awaited at the next
step, so a step takes the longer of the two:

    forward:  Σ_{i=0}^{cp−2} max(a_i, x) + a_{cp−1}
    backward: Σ_{i=0}^{cp−1} max(b_i, l_i) + y,  l_i = x·[i ≤ cp − 2] + y·[i ≥ 1]
              (step i's K/V for the next step and the K/V gradient passed on after step i − 1 share the
              link; the last step's gradient is awaited unhidden)
    kept activations: acts / cp — the ring's autograd function keeps the rank's q, k, v, output and
                      log-sum-exp, what one device's SDPA keeps ÷ cp; no gathered K/V

:func:`context_part` returns the excess over the attention compute ``layer_compute`` already prices
(Σ max(a_i, x) − Σ a_i, ...), the transfer time left unhidden; the buffers in flight (a received and a
sent K/V, and in the backward three K/V gradients in fp32) are transient (:func:`ring_transient_bytes`).

and the data-parallel group the gradients average and ZeRO shards over is the dp × cp ranks.
Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from typing import Any

from autopar import contract
from autopar.choice import CpAttention
from autopar.cost_models.communication import Collective, GroupPlacement, collective_time_s, p2p_time_s, place_group
from autopar.cost_models.hardware import ClusterSpec
from autopar.graph import Layer, OpKind
from autopar.mesh import Mesh
from autopar.planning.layer_compute import ring_step_times

FP32_BYTES = 4  # torch's ring accumulates and passes the K/V gradients in fp32 (its ``convert_to_f32``)


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
    if table.config.cp_attention is CpAttention.RING:
        fwd, bwd = ring_s(table, layer, heads_split)
        return fwd, bwd, acts / cp
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


def ring_transfers_s(table: Any, layer: Layer, heads_split: int = 1) -> tuple[float, float]:
    """(x, y): one ring step's K/V transfer and K/V-gradient transfer of one attention call (module
    docstring), seconds."""
    cp, calls = table.config.mesh.cp, max(layer.attention_calls, 1)
    local = table.microbatch_size * table.act_scale * layer.kv_bytes_per_sample / heads_split / calls / cp
    grads = local * FP32_BYTES / table.prec.activation_bytes

    def send(nbytes: float) -> float:
        return p2p_time_s(nbytes, inter_node=table.cp_group.spans_nodes, cluster=table.cluster) + (
            table.cluster.collective_sync_s if nbytes > 0 else 0.0)

    return send(local), send(grads)


def ring_s(table: Any, layer: Layer, heads_split: int = 1) -> tuple[float, float]:
    """Ring attention's unhidden transfer time, (forward, backward), per microbatch: each call's
    stepped time (module docstring) less the steps' attention compute ``layer_compute`` prices."""
    cp = table.config.mesh.cp
    x, y = ring_transfers_s(table, layer, heads_split)
    fwd = bwd = 0.0
    ops = [op for op in layer.ops if op.kind is OpKind.ATTENTION]
    if not ops:  # no kernel recorded to hide them under: every transfer unhidden (an upper bound)
        calls = layer.attention_calls
        return calls * (cp - 1) * x, calls * ((cp - 1) * x + cp * y)
    for op in ops:
        a0, a, b0, b = ring_step_times(op, table.microbatch_size, None, 1, table.cluster.device,
                                       table.dtype_for_compute, cp, share=1 / heads_split)
        links = [x * (i <= cp - 2) + y * (i >= 1) for i in range(cp)]
        fwd += op.count * sum(max(0.0, x - t) for t in [a0] + [a] * (cp - 2))
        bwd += op.count * (sum(max(0.0, link - t) for link, t in zip(links, [b0] + [b] * (cp - 1))) + y)
    return fwd, bwd


def ring_transient_bytes(table: Any, layer: Layer, heads_split: int = 1) -> float:
    """The buffers ring attention holds in flight while one call runs, per microbatch (plan dtype): a
    received and a sent K/V of the rank, and in the backward besides them the accumulated, the sent
    and the received K/V gradient in fp32 (``_templated_ring_attention_backward``); 0 under the other
    methods. The workspace asks it with ``heads_split`` 1 whatever the layer's style (one figure for every
    choice): beside tp an upper bound, a style splitting the heads holding h_kv/tp heads' buffers."""
    if table.config.mesh.cp <= 1 or table.config.cp_attention is not CpAttention.RING:
        return 0.0
    calls = max(layer.attention_calls, 1)
    local = (table.microbatch_size * table.act_scale * layer.kv_bytes_per_sample / heads_split / calls
             / table.config.mesh.cp)
    return 2 * local + 3 * local * FP32_BYTES / table.prec.activation_bytes


def kept_bytes(table: Any, layer: Layer, heads_split: int = 1) -> float:
    """What cp's attention keeps per sample (captured dtype) beyond the layer's activations ÷ cp: under
    all-gather the other ranks' K and V (saved by SDPA) and the prefix masks; under Ulysses nothing
    (module docstring)."""
    cp = table.config.mesh.cp
    if cp <= 1 or table.config.cp_attention is not CpAttention.ALL_GATHER:
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
    if cp <= 1 or table.config.cp_attention is not CpAttention.ALL_GATHER:
        return 0.0
    chunk = seq // (2 * cp)
    return layer.attention_calls * chunk * (2 * cp + 1) * chunk * table.prec.activation_bytes


__all__ = ["context_part", "data_group", "kept_bytes", "mask_bytes", "ring_s", "ring_transfers_s",
           "ring_transient_bytes", "ulysses_s"]
