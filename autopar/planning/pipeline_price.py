"""The pipeline schedule's terms of the step and the memory: w in m·T + w·(S − T), and microbatches in flight.

GPipe, 1F1B and interleaved 1F1B: w = 1/v with v chunks per rank (Narayanan et al. 2021). The
split-backward schedules (``interleaved_zb``, ``zbv``, ``dualpipev``: :mod:`autopar.cost_models.pipeline`)
are simulated on torch's own actions (:mod:`autopar.cost_models.schedule_sim`) with the plan's ratio
T_F : T_B : T_W, summed over the layers as each runs replicated over tp, recomputing nothing (the choice
every split-backward row offers first; read from the times tables of one mesh and microbatch count share,
so a search does not price a configuration's rows to key it):

    T_F = Σ forward,   T_W = Σ weight_share · backward,   T_B = Σ (forward + backward) − T_F − T_W

A layer's W is its weight gradients' GEMMs, dW = Xᵀ·dY: one GEMM of its forward's FLOPs for every
forward GEMM against a weight (capture's records whose rows grow with the tokens; a batched
activation × activation GEMM, attention by hand, has none), so its share of the backward is those
GEMMs' forward FLOPs over twice the layer's forward FLOPs (backward does twice the forward's work);
a layer without records: half its backward if it has parameters.

The search keys a configuration by a bound before it prices it; for these schedules that bound reads
:func:`bubble_weight_floor`, a floor of w no simulation is needed for: rank p − 1 can start nothing before
microbatch 0's forward has passed the p − 1 stages before it (each T_F/v with equal stages, v chunks a rank),
and then does its m microbatches' work, so the step is at least (p − 1)·T_F/v + m·(T_F + T_B + T_W), and
w ≥ T_F / (v·(T_F + T_B + T_W)) (torch's schedules meet it at T_F = T_B = T_W: ZB-H1 1/3, ZB-V 1/6).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

from autopar.cost_models import schedule_sim
from autopar.cost_models.communication import p2p_time_s
from autopar.cost_models.hardware import ClusterSpec, blocking_wait_share
from autopar.cost_models.pipeline import Schedule
from autopar.graph import Layer, OpKind, SampleDim
from autopar.planning import loss_price

PriceTable = Any  # planning.pricing.PriceTable, which imports this module


def weight_share(layer: Layer) -> float:
    """The share of ``layer``'s backward that is its weight gradients (see the module docstring)."""
    if not layer.param_count:
        return 0.0
    if not layer.ops or layer.flops_per_sample <= 0:
        return 0.5
    weights = sum(op.gemm_flops_per_sample() for op in layer.ops
                  if op.kind is OpKind.GEMM and op.per_sample is SampleDim.M)
    return min(0.5, weights / (2 * layer.flops_per_sample))


def phase_times(table: PriceTable) -> tuple[float, float, float]:
    """(T_F, T_B, T_W) of one microbatch through every layer (see the module docstring), once for the tables
    alike in their times (:attr:`~.pricing.PriceTable.times_alike`)."""
    memo = table.shared.phases
    if (key := table.times_alike) not in memo:
        per_class: dict[int, tuple[float, float, float]] = {}
        f = b = w = 0.0
        for layer, cls in zip(table.graph, table.graph.cost_classes):
            if cls not in per_class:
                forward, compute = _phase_parts_mb_s(table, layer)
                backward = compute - forward
                share = weight_share(layer)
                per_class[cls] = (forward, backward - share * backward, share * backward)
            lf, lb, lw = per_class[cls]
            f, b, w = f + lf, b + lb, w + lw
        memo[key] = (table.graph, (f, b, w))  # the graph is kept, so its id is not reused
    return memo[key][1]


def _phase_parts_mb_s(table: PriceTable, layer: Layer) -> tuple[float, float]:
    """(forward, forward + backward) per microbatch of ``layer`` replicated over tp, recomputing nothing, with
    what :meth:`~.pricing.PriceTable._price` adds to them (a BatchNorm's statistics, the loss's kernels and the
    chunked loss's head GEMM on the last layer)."""
    fwd, bwd, *_, times = table._style_part(layer, None, False)
    norm_sync = table._norm_sync_s(layer)
    loss_fwd, loss_bwd = table.loss_time_s if layer.index == len(table.graph) - 1 else (0.0, 0.0)
    forward = fwd + norm_sync + loss_fwd
    return forward, forward + bwd + norm_sync + loss_bwd + loss_price.recompute_s(table, layer, times.device_fwd_s)


def bubble_weight(table: PriceTable) -> Fraction:
    """w in step = m·T + w·(S − T) (``planning.pricing``'s step model) for the table's schedule."""
    c = table.config
    if c.mesh.pp <= 1:
        return Fraction(0)
    if not c.schedule.split_backward:
        return Fraction(1, c.schedule.chunks)
    return schedule_sim.bubble_weight(c.schedule, c.mesh.pp, c.microbatches, *phase_times(table))


def step_s(table: PriceTable, per_rank_mb_s: list[float]) -> float:
    """The step before the tail, from each pipeline rank's per-microbatch time.

    The critical path is m·T + w·(S − T). Where ranks share cores (σ > 1,
    :attr:`PriceTable.core_sharing`), it runs σ times faster at best, and a node's cores cannot do its k
    ranks' m microbatches of work faster than m·(their sum)/k: the step is the larger of the two. Both are
    exact when every phase keeps the cores busy, as GPipe and 1F1B do once a stage's ranks fill them.
    """
    m, w = table.config.microbatches, float(table.bubble_weight)
    chain = (m - w) * max(per_rank_mb_s) + w * sum(per_rank_mb_s)
    sigma, k = table.core_sharing
    if sigma == 1:
        return chain
    work = max(sum(per_rank_mb_s[g:g + k]) for g in range(0, len(per_rank_mb_s), k))
    return max(chain / float(sigma), m * work / k)


def send_s(table: PriceTable, cut: int, stage: int | None) -> float:
    """One send of the values crossing a cut before layer ``cut`` into virtual stage ``stage``, per
    microbatch (:meth:`PriceTable.p2p_s`). The receiving rank blocks on it as on a collective: beyond the
    bubble (its wait for the sender, priced there) it pays what every blocking exchange does where ranks
    share a host's cores and drift apart (``collective_sync_s``: 0 on GPUs) — a pipeline of more sends per
    step (more microbatches, interleaved chunks) measured that much slower on CPU."""
    if cut <= 0 or cut >= len(table.graph):
        return 0.0
    nbytes = (table.microbatch_size * table.graph[cut - 1].boundary_bytes_per_sample
              * table.act_scale / table.config.mesh.cp)  # under cp a stage sends its S/cp tokens
    inter = table.boundary_inter_node
    across = (len(inter) > 1 and all(inter[1:])) if stage is None else inter[stage]
    return p2p_time_s(nbytes, inter_node=across, cluster=table.cluster) + table.paced_cluster.collective_sync_s


def busy_ranks(table: PriceTable) -> float:
    """How many of a node's ranks work at once while the pipeline runs: its k consecutive pipeline ranks
    (:attr:`PriceTable.core_sharing`'s k) hold at most m microbatches between them, so min(k, m) of them
    work and the rest wait in a receive; every rank where no pipeline rank waits (pp = 1, or a node's
    ranks all of one stage)."""
    on_node = min(table.cluster.gpus_per_node, table.config.world_size)
    _, k = table.core_sharing  # k = 1 where no rank lends its cores (then every rank works)
    return on_node * min(k, table.config.microbatches) / k


def paced_cluster(table: PriceTable) -> ClusterSpec:
    """The cluster the pipeline's per-microbatch collectives (tp's, the sends) are priced on: its blocking
    waits (``collective_sync_s``, ``tp_overhead_s``, measured with every rank busy) at the share
    :func:`~autopar.cost_models.hardware.blocking_wait_share` gives for :func:`busy_ranks` — the cluster
    itself where that is 1 (GPUs; every rank busy). One object per share, so the tables' memos keyed by
    its id see one cluster."""
    cluster = table.cluster
    on_node = min(cluster.gpus_per_node, table.config.world_size)
    share = blocking_wait_share(cluster, busy_ranks(table), on_node)
    if share == 1.0:
        return cluster
    memo = table.shared.paced
    if (key := (id(cluster), share)) not in memo:  # the cluster is kept, so its id is not reused
        memo[key] = (cluster, replace(cluster, collective_sync_s=cluster.collective_sync_s * share,
                                      tp_overhead_s=cluster.tp_overhead_s * share))
    return memo[key][1]


def bubble_weight_floor(table: PriceTable, schedule: Schedule | None = None) -> Fraction:
    """A floor of :func:`bubble_weight` (the module docstring): w itself for GPipe and the 1F1B schedules; for
    the split-backward ones T_F / (v·(T_F + T_B + T_W)), less the simulated w's rounding to a fraction
    (:data:`~autopar.cost_models.schedule_sim.DENOMINATOR`). ``schedule``: a split-backward schedule of a
    configuration alike in its times to ``table``'s (:attr:`~.pricing.PriceTable.times_alike`), whose own
    table need not be built (:mod:`.candidates`)."""
    c = table.config
    schedule = schedule or c.schedule
    if c.mesh.pp <= 1 or not schedule.split_backward:
        return bubble_weight(table)
    memo = table.shared.phases  # keyed apart from phase_times' entries: a search keys ~16,000 of these
    if (key := (table.times_alike, "floor", schedule.chunks)) not in memo:
        f, b, w = phase_times(table)
        floor = Fraction(0) if f + b + w <= 0 else max(
            Fraction(f / (schedule.chunks * (f + b + w))) - Fraction(1, schedule_sim.DENOMINATOR), Fraction(0))
        memo[key] = (table.graph, floor)
    return memo[key][1]
