"""Price every strategy of every layer for one mesh configuration.

This module is the one place where the cost models meet the LayerGraph. The
solver builds its CP-SAT model from a :class:`PriceTable`, and
:func:`evaluate` prices a complete assignment from the same table, so the
solver's objective and a plan's reported prediction are the same function.

The step-time model of a configuration (pp × dp × tp mesh, m microbatches,
schedule with v chunks per rank), for pipeline rank j:

    T_j  = Σ_{layers on j} (compute_fwd+bwd(+re-fwd) + tp_comm) per microbatch
           + point-to-point sends at j's stage boundaries
    E_j  = Σ_{layers on j} max(dp_comm − ω · compute, (1 − ω) · dp_comm)       (exposed DP/ZeRO traffic)
    step = (m + (pp − 1)/v) · max_j T_j + max_j (E_j + optimizer_j)

Each layer's data-parallel collectives hide only under that layer's own
compute over the step (FSDP2 prefetches one layer ahead), so a layer with no
compute, such as an embedding, exposes all of its traffic. ω is the cluster's
``comm_overlap``: running compute c and communication d together takes
max(c, d) + (1 − ω)·min(c, d), so ω = 1 (GPUs) hides d fully under c and a
CPU host whose collectives take turns with compute on its cores has ω < 1.

and the memory of rank j (integer bytes):

    M_j  = Σ model_states(zero, dp, tp) + Σ ⌈activations per microbatch · in_flight(j)⌉ + workspace
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

from autopar.cost_models.communication import Collective, collective_time_s, p2p_time_s, place_group
from autopar.cost_models.compute import BACKWARD_FLOPS_FACTOR, compute_time_s
from autopar.cost_models.hardware import ClusterSpec
from autopar.cost_models.memory import Precision, model_state_bytes, optimizer_shard_params, precision
from autopar.cost_models.pipeline import Schedule, ScheduleKind, in_flight, step_time_multiplier
from autopar.graph import Layer, LayerGraph



def exposed_comm_s(comm_s: float, compute_s: float, overlap: float) -> float:
    """What ``comm_s`` of collectives adds to ``compute_s`` of compute they run beside.

    Both together take max(c, d) + (1 − ω)·min(c, d) (see the module docstring).
    """
    return max(comm_s - overlap * compute_s, (1.0 - overlap) * comm_s, 0.0)


@dataclass(frozen=True)
class Strategy:
    """What one layer does: tensor-parallel style (None = replicated), ZeRO stage, recompute."""

    tp: str | None = None
    zero: int = 0
    recompute: bool = False

    def __str__(self) -> str:
        return f"tp={self.tp or '-'} zero={self.zero} recompute={'on' if self.recompute else 'off'}"


@dataclass(frozen=True, order=True)
class MeshConfig:
    """The global choices: mesh degrees, microbatches and pipeline schedule."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    schedule: Schedule = field(compare=False)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: pp × chunks per rank."""
        return self.pp * self.schedule.chunks

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.pp

    def describe(self) -> str:
        return f"pp={self.pp} dp={self.dp} tp={self.tp} m={self.microbatches} {self.schedule}"


@dataclass(frozen=True)
class TrainingSpec:
    """What the plan trains with: global batch (samples per step) and precision."""

    global_batch: int
    dtype: str = "bf16"

    @property
    def precision(self) -> Precision:
        return precision(self.dtype)


@dataclass(frozen=True)
class LayerPrice:
    """One layer under one strategy: times in seconds, memory in bytes."""

    compute_mb_s: float  # forward + backward (+ recomputed forward) per microbatch
    tp_comm_mb_s: float  # tensor-parallel collectives per microbatch
    dp_comm_s: float  # data-parallel / ZeRO collectives per step
    exposed_comm_s: float  # the part of dp_comm_s not hidden under the layer's compute
    optimizer_s: float  # optimizer step per step
    state_bytes: int  # weights + gradients + optimizer state held
    activation_mb_bytes: int  # activations kept per microbatch in flight

    @property
    def time_mb_s(self) -> float:
        return self.compute_mb_s + self.tp_comm_mb_s

    @property
    def tail_s(self) -> float:
        """What the layer adds after the pipeline drains: exposed DP traffic and its optimizer step."""
        return self.exposed_comm_s + self.optimizer_s


class PriceTable:
    """Prices of every admissible strategy of every layer under one :class:`MeshConfig`."""

    def __init__(self, graph: LayerGraph, config: MeshConfig, cluster: ClusterSpec,
                 training: TrainingSpec, *, zero_stages: tuple[int, ...] = (0, 1, 2, 3)):
        samples = config.dp * config.microbatches
        if training.global_batch % samples:
            raise ValueError(f"global batch {training.global_batch} does not split into "
                             f"dp={config.dp} × microbatches={config.microbatches}")
        self.graph, self.config, self.cluster, self.training = graph, config, cluster, training
        self.prec = training.precision
        self.microbatch_size = training.global_batch // samples
        self.act_scale = self.prec.activation_bytes / graph.dtype_bytes
        self.dtype_for_compute = "bf16" if training.dtype == "bf16" else "fp32"
        self.tp_group = place_group(config.tp, 1, cluster.gpus_per_node)
        self.dp_group = place_group(config.dp, config.tp, cluster.gpus_per_node)
        self.pp_inter_node = cluster.nodes > 1 and config.dp * config.tp >= cluster.gpus_per_node
        self.zeros = zero_stages if config.dp > 1 else (0,)
        self._style_memo: dict[tuple[int, str | None], tuple[float, float, float, float, float]] = {}

    @cached_property
    def _rows(self) -> tuple[list[list[Strategy]], list[list[LayerPrice]]]:
        """Every layer's strategies and prices, built on first use.

        Layers of one cost class (the repeated blocks) share one priced row; a row
        is copied before a layer's row is extended (see solver._pinned_outside_search).
        """
        rows: dict[int, tuple[list[Strategy], list[LayerPrice]]] = {}
        for layer, cls in zip(self.graph, self.graph.cost_classes):
            if cls not in rows:
                strategies = self._strategies(layer, self.zeros)
                rows[cls] = (strategies, [self._price(layer, s) for s in strategies])
        classes = self.graph.cost_classes
        return [rows[c][0] for c in classes], [rows[c][1] for c in classes]

    @cached_property
    def strategies(self) -> list[list[Strategy]]:
        return self._rows[0]

    @cached_property
    def prices(self) -> list[list[LayerPrice]]:
        return self._rows[1]

    def fastest_time_mb_s(self) -> list[float]:
        """Per layer, the least per-microbatch time any strategy could take (no pricing of
        ZeRO or memory needed: only the tensor-parallel style sets it)."""
        memo: dict[int, float] = {}
        out = []
        for layer, cls in zip(self.graph, self.graph.cost_classes):
            if cls not in memo:
                styles = {s.tp for s in self._strategies(layer, (0,))}
                memo[cls] = min(sum(self._style_part(layer, t)[:4]) for t in styles)
            out.append(memo[cls])
        return out

    def _strategies(self, layer: Layer, zeros: tuple[int, ...]) -> list[Strategy]:
        if self.config.pp > 1 and self.graph.tracer == "export":
            # An export-captured model's pipeline stages are single ATen graphs with no
            # layer modules left to hook (passes/pipeline.py): each layer stays replicated.
            return [Strategy(None, 0, False)]
        styles: list[str | None] = [None]
        if self.config.tp > 1:
            styles += [s.name for s in layer.tp_styles if s.admits(self.config.tp)]
        return [Strategy(t, z, r) for t in styles for z in zeros for r in (False, True)]

    @cached_property
    def multiplier(self) -> Fraction:
        return step_time_multiplier(self.config.schedule, self.config.pp, self.config.microbatches)

    @cached_property
    def in_flight(self) -> list[Fraction]:
        c = self.config
        return [in_flight(c.schedule, c.pp, c.microbatches, j) for j in range(c.pp)]

    @cached_property
    def workspace_bytes(self) -> int:
        """Transient memory: the largest FSDP unit's gathered weights and one layer's activations.

        The runtime (passes/zero.py) gives each repeated layer a unit of its own and
        gathers every other layer's parameters together in the root unit.
        """
        counts = Counter(self.graph.cost_classes)
        repeated = [l.param_count for l, c in zip(self.graph, self.graph.cost_classes) if counts[c] > 1]
        others = sum(l.param_count for l, c in zip(self.graph, self.graph.cost_classes) if counts[c] == 1)
        largest_params = max(repeated + [others])
        largest_act = max((l.activation_bytes_per_sample for l in self.graph), default=0.0)
        return self.prec.param_bytes * largest_params + math.ceil(
            self.microbatch_size * largest_act * self.act_scale)

    def effective_params(self, layer: Layer, strategy: Strategy) -> int:
        """Parameters one rank holds for the layer before ZeRO sharding."""
        if strategy.tp is None:
            return layer.param_count
        sharded = layer.tp_style(strategy.tp).sharded_params
        return layer.param_count - sharded + math.ceil(sharded / self.config.tp)

    def _style_part(self, layer: Layer, style_name: str | None) -> tuple[float, float, float, float, float]:
        """What a tensor-parallel style (or none) sets, whatever the ZeRO stage and recompute:
        forward and backward compute, forward and backward tp communication, saved activations."""
        key = (id(layer), style_name)
        if key in self._style_memo:
            return self._style_memo[key]
        c, b = self.config, self.microbatch_size
        flops, acts = layer.flops_per_sample, layer.activation_bytes_per_sample
        tp_comm_fwd = tp_comm_bwd = 0.0
        if style_name is not None:
            style = layer.tp_style(style_name)
            flops -= style.sharded_flops_per_sample * (1 - 1 / c.tp)
            sharded_act = style.sharded_activation_elems_per_sample * self.graph.dtype_bytes
            acts -= sharded_act * (1 - 1 / c.tp)
            elem = self.prec.activation_bytes * b
            tp_comm_fwd = collective_time_s(
                Collective.ALL_REDUCE, style.fwd_allreduce_elems * elem, self.tp_group,
                self.cluster, count=style.fwd_allreduce_count,
            ) + collective_time_s(Collective.ALL_GATHER, style.fwd_allgather_elems * elem,
                                  self.tp_group, self.cluster)
            tp_comm_bwd = collective_time_s(
                Collective.ALL_REDUCE, style.bwd_allreduce_elems * elem, self.tp_group,
                self.cluster, count=style.bwd_allreduce_count,
            )
        device, dtype = self.cluster.device, self.dtype_for_compute
        fwd = compute_time_s(b * flops, device, dtype)
        bwd = compute_time_s(BACKWARD_FLOPS_FACTOR * b * flops, device, dtype)
        self._style_memo[key] = (fwd, bwd, tp_comm_fwd, tp_comm_bwd, acts)
        return self._style_memo[key]

    def _price(self, layer: Layer, strategy: Strategy) -> LayerPrice:
        c, b, prec, device = self.config, self.microbatch_size, self.prec, self.cluster.device
        fwd, bwd, tp_comm_fwd, tp_comm_bwd, acts = self._style_part(layer, strategy.tp)
        compute = fwd + bwd + (fwd if strategy.recompute else 0.0)
        tp_comm = tp_comm_fwd + tp_comm_bwd + (tp_comm_fwd if strategy.recompute else 0.0)
        kept = layer.input_bytes_per_sample if strategy.recompute else acts
        params = self.effective_params(layer, strategy)
        dp_comm = self._dp_comm_s(params, strategy.zero)
        return LayerPrice(
            compute_mb_s=compute,
            tp_comm_mb_s=tp_comm,
            dp_comm_s=dp_comm,
            exposed_comm_s=exposed_comm_s(dp_comm, c.microbatches * compute, self.cluster.comm_overlap),
            optimizer_s=optimizer_shard_params(params, strategy.zero, c.dp)
            * prec.optimizer_bytes_touched / device.memory_bandwidth_bytes_s,
            state_bytes=model_state_bytes(params, strategy.zero, c.dp, prec),
            activation_mb_bytes=math.ceil(b * max(kept, 0.0) * self.act_scale),
        )

    def _dp_comm_s(self, params: int, zero: int) -> float:
        """Per step: DP all-reduce; ZeRO-1 RS+AG once; ZeRO-2 RS per microbatch + AG; ZeRO-3 (2 AG + RS) per microbatch."""
        if self.config.dp <= 1 or params == 0:
            return 0.0
        m, group, cl = self.config.microbatches, self.dp_group, self.cluster
        grads, weights = self.prec.grad_bytes * params, self.prec.param_bytes * params
        rs = collective_time_s(Collective.REDUCE_SCATTER, grads, group, cl)
        ag = collective_time_s(Collective.ALL_GATHER, weights, group, cl)
        if zero == 0:
            return collective_time_s(Collective.ALL_REDUCE, grads, group, cl)
        if zero == 1:
            return rs + ag
        if zero == 2:
            return m * rs + ag
        return m * (2 * ag + rs)

    def memory_coefficient(self, layer_index: int, k: int, rank: int) -> int:
        """Bytes layer ``layer_index`` under strategy ``k`` adds to pipeline rank ``rank``."""
        price = self.prices[layer_index][k]
        f = self.in_flight[rank]
        return price.state_bytes + -(-price.activation_mb_bytes * f.numerator // f.denominator)

    def p2p_s(self, cut: int) -> float:
        """One send of the values crossing a cut placed before layer ``cut``, per microbatch."""
        if cut <= 0 or cut >= len(self.graph):
            return 0.0
        nbytes = (self.microbatch_size * self.graph[cut - 1].boundary_bytes_per_sample
                  * self.act_scale)
        return p2p_time_s(nbytes, inter_node=self.pp_inter_node, cluster=self.cluster)


@dataclass(frozen=True)
class Assignment:
    """A complete plan in solver terms: a config, each layer's stage and strategy."""

    config: MeshConfig
    stages: tuple[int, ...]
    strategies: tuple[Strategy, ...]


@dataclass(frozen=True)
class Prediction:
    """Predicted step time (with its breakdown on the critical rank) and memory per rank."""

    step_time_s: float
    memory_per_rank_bytes: tuple[int, ...]
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    optimizer_s: float

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_per_rank_bytes)


def evaluate(table: PriceTable, stages: tuple[int, ...], strategies: tuple[Strategy, ...]) -> Prediction:
    """Price a complete assignment with the same model the solver optimises."""
    c = table.config
    pp = c.pp
    t_compute, t_tp, t_p2p = [0.0] * pp, [0.0] * pp, [0.0] * pp
    exposed, opt = [0.0] * pp, [0.0] * pp
    memory = [table.workspace_bytes] * pp
    for i, (stage, strategy) in enumerate(zip(stages, strategies)):
        k = table.strategies[i].index(strategy)
        price, rank = table.prices[i][k], c.rank_of_stage(stage)
        t_compute[rank] += price.compute_mb_s
        t_tp[rank] += price.tp_comm_mb_s
        exposed[rank] += price.exposed_comm_s
        opt[rank] += price.optimizer_s
        memory[rank] += table.memory_coefficient(i, k, rank)
    for cut in range(1, len(stages)):
        if stages[cut] != stages[cut - 1]:
            send = table.p2p_s(cut)
            t_p2p[c.rank_of_stage(stages[cut - 1])] += send  # forward activations
            t_p2p[c.rank_of_stage(stages[cut])] += send  # backward gradients
    per_mb = [t_compute[j] + t_tp[j] + t_p2p[j] for j in range(pp)]
    tail = [exposed[j] + opt[j] for j in range(pp)]
    crit = max(range(pp), key=lambda j: per_mb[j])
    tail_rank = max(range(pp), key=lambda j: tail[j])
    mult, m = float(table.multiplier), c.microbatches
    return Prediction(
        step_time_s=mult * per_mb[crit] + tail[tail_rank],
        memory_per_rank_bytes=tuple(memory),
        compute_s=m * t_compute[crit],
        bubble_s=(mult - m) * per_mb[crit],
        tp_comm_s=m * t_tp[crit],
        pp_comm_s=m * t_p2p[crit],
        dp_comm_s=exposed[tail_rank],
        optimizer_s=opt[tail_rank],
    )
