"""Price every choice of every layer for one configuration (a mesh, microbatches, schedule, data parallelism).

This module is the one place where the cost models meet the LayerGraph. The
solver builds its CP-SAT model from a :class:`PriceTable`, and
:func:`~autopar.planning.evaluate.evaluate` prices a complete assignment from the same table, so the
solver's objective and a plan's reported prediction are the same function.

The step-time model of a configuration (pp × dp × cp × tp mesh, cp in :mod:`.context_price`, m
microbatches, schedule with v chunks per rank), for pipeline rank j:

    T_j  = Σ_{layers on j} (compute_fwd+bwd(+re-fwd) + tp_comm) per microbatch
           + point-to-point sends at j's stage boundaries
    E_j  = Σ_{layers on j} max(dp_comm − ω · compute, (1 − ω) · dp_comm)       (exposed DP/ZeRO traffic)
           + FSDP2's work around each collective, hooks and buffer copies (never hidden: the host does it)
           + ω · (the first and last FSDP2 unit's collectives at the plan's highest ZeRO stage), which
             no compute hides (planning.edges)
    step = m · T + w · (S − T) + max_j (E_j + optimizer_j),   T = max_j T_j,  S = Σ_j T_j

The slowest rank paces the m microbatches, and filling and draining the
pipeline passes through every other rank once: w = 1/v with v chunks per
rank (zero-bubble schedules: simulated, :mod:`.pipeline_price`). With equal stages this is the
textbook (m + (pp − 1)/v)·T; with unequal ones the bubble is the other stages' time, not (pp − 1) times the
slowest's. On a host whose k pipeline ranks share fewer cores than there
are processes, a waiting rank lends its cores to the working ones: then

    step = max((m · T + w · (S − T)) / σ,  m · max_node Σ_{j on node} T_j / k) + tail

the critical path at the speed σ of a rank with the node's cores to itself
(cost_models.hardware.idle_core_speedup), or the node's work spread over
its cores, whichever is longer (PriceTable.pipeline_s). There the per-microbatch collectives (tp's, the
sends) wait for descheduled peers only as much as the ranks busy at once compete for the cores
(cost_models.hardware.blocking_wait_share; PriceTable.paced_cluster): none while each has a core.

Each layer's data-parallel collectives hide only under that layer's own
compute over the step (FSDP2 prefetches one layer ahead), so a layer with no
compute, such as an embedding, exposes all of its traffic. ω is the cluster's
``comm_overlap``: running compute c and communication d together takes
max(c, d) + (1 − ω)·min(c, d), so ω = 1 (GPUs) hides d fully under c and a
CPU host whose collectives take turns with compute on its cores has ω < 1.

and the memory of rank j (integer bytes):

    M_j  = Σ model_states(zero, dp, tp) + Σ ⌈activations per microbatch · in_flight(j)⌉ + workspace (one layer's
           or, last rank, the loss's if larger) + (FSDP2's buffers if j has ZeRO layers)
Expert parallelism (``ep``) is priced in :mod:`.expert_price`; the data-parallel collectives, hybrid
sharding's (``dp_replicate``: shard group and replicate group) among them, in :mod:`.hsdp_price`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cached_property
from typing import Any

from autopar import contract
from autopar.batch_coupling import synced
from autopar.choice import LayerChoice, LossKind, Recompute
from autopar.contract import Buffers, Engine
from autopar.cost_models.communication import Collective, collective_time_s, p2p_time_s, place_group
from autopar.cost_models.hardware import ClusterSpec, idle_core_speedup
from autopar.cost_models.memory import optimizer_shard_params
from autopar.cost_models.pipeline import in_flight
from autopar.graph import Layer, LayerGraph
from autopar.planning import context_price, edges, expert_price, hsdp_price, loss_price, pipeline_price
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.layer_compute import LayerCompute, master_hooks_s
from autopar.planning.memory_floor import held_bytes, kept_mb_bytes
from autopar.planning.recompute_price import compiled_ops
from autopar.planning.sequence import region_s
from autopar.planning.shared_prices import SharedPrices
from autopar.planning.style_price import style_part

FP32_BYTES = 4  # the loss, and a bf16 plan's master gradients outside FSDP2, are fp32


def exposed_comm_s(comm_s: float, compute_s: float, overlap: float) -> float:
    """What ``comm_s`` of collectives adds to ``compute_s`` beside it: together max(c, d) + (1 − ω)·min(c, d)."""
    return max(comm_s - overlap * compute_s, (1.0 - overlap) * comm_s, 0.0)


@dataclass(frozen=True)
class LayerPrice:
    """One layer under one choice: times in seconds, memory in bytes, each part kept apart so that
    one evaluation (:mod:`.evaluate`) gives the step, the stages' times and the ranks' memory by kind."""

    forward_mb_s: float  # forward compute per microbatch
    compute_mb_s: float  # forward + backward (+ recomputed forward) per microbatch
    forward_tp_mb_s: float  # forward tensor-parallel collectives per microbatch
    tp_comm_mb_s: float  # the layer's collectives per microbatch, forward and backward (ep's and cp's among them)
    dp_comm_s: float  # data-parallel / ZeRO collectives per step
    exposed_comm_s: float  # the part of dp_comm_s not hidden under the layer's compute
    optimizer_s: float  # optimizer step per step
    params_bytes: int  # weights held (whole, or this rank's ZeRO-3 shard)
    grads_bytes: int  # gradients held (whole, or this rank's ZeRO-2/3 shard)
    optimizer_bytes: int  # optimizer state held, and a bf16 plan's fp32 master gradients outside FSDP2
    buckets_bytes: int  # DDP's gradient buckets
    activation_mb_bytes: int  # activations kept per microbatch in flight
    ep_comm_mb_s: float = 0.0  # the part of tp_comm_mb_s that is the experts' all-to-alls under ep
    cp_comm_mb_s: float = 0.0  # the part of tp_comm_mb_s that is cp's K/V all-gather and its reduce-scatter

    @property
    def state_bytes(self) -> int:
        """Weights + gradients + optimizer state + gradient buckets: the layer's memory but its activations."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.buckets_bytes

    @property
    def time_mb_s(self) -> float:
        return self.compute_mb_s + self.tp_comm_mb_s

    @property
    def tail_s(self) -> float:
        """What the layer adds after the pipeline drains: exposed DP traffic and its optimizer step."""
        return self.exposed_comm_s + self.optimizer_s


class PriceTable:
    """Prices of every admissible choice of every layer under one :class:`Configuration`."""

    def __init__(self, graph: LayerGraph, config: Configuration, cluster: ClusterSpec,
                 training: TrainingSpec, shared: SharedPrices | None = None):
        """``shared``: what one search's tables share (:class:`SharedPrices`); a search passes one
        to every table it builds."""
        samples = config.mesh.dp * config.microbatches
        if training.global_batch % samples:
            raise ValueError(f"global batch {training.global_batch} does not split into "
                             f"dp={config.mesh.dp} × microbatches={config.microbatches}")
        if config.mesh.pp > 1:  # tied embeddings: the last stage holds the first layer's weight too
            graph = graph.pipeline_view()
        self.graph, self.config, self.cluster, self.training = graph, config, cluster, training
        self.prec = training.precision
        self.microbatch_size = training.global_batch // samples
        self.act_scale = self.prec.activation_bytes / graph.dtype_bytes
        self.dtype_for_compute = "bf16" if training.dtype == "bf16" else "fp32"
        self.shared = self._shared = SharedPrices() if shared is None else shared
        (self.tp_group, self.ep_group, self.cp_group, self.data_ranks, self.dp_group, self.shard_ranks,
         self.shard_group, self.replicate_group, self.edp_group) = self._groups(config.mesh, cluster)
        self.pp_inter_node = edges.ranks_inter_node(0, config.mesh.pp - 1, self)  # the tied ends' all-reduce
        self.engine = config.engine
        self._p2p_memo: dict[tuple[int, int | None], float] = {}
        self._runs_memo: dict[tuple[int, LayerChoice], LayerChoice] = {}
        self._region_memo: dict[tuple, float] = {}  # (i, k), and (None, a style's cost signature)

    def _groups(self, mesh: Any, cluster: ClusterSpec) -> tuple:
        """Each axis's group placed on the nodes, the data ranks and HSDP's groups: one answer a mesh, shared by
        the search's tables (10,000 configurations have some hundreds of meshes)."""
        key = (id(cluster), mesh)
        if key not in self._shared.groups:
            groups = {name: place_group(degree, mesh.stride(name), cluster.gpus_per_node)
                      for name, degree in mesh.items()}
            data_ranks, dp_group = context_price.data_group(mesh, groups["dp"], cluster)
            # HSDP (all dp × cp at R = 1); the expert-data-parallel group: the dp × cp ranks holding the same
            # experts, ep apart in dp × cp
            hsdp = hsdp_price.groups(mesh, data_ranks, dp_group, cluster)
            edp = place_group(data_ranks // mesh.ep, mesh.stride("ep") * mesh.ep, cluster.gpus_per_node)
            self._shared.groups[key] = (cluster, (groups["tp"], groups["ep"], groups["cp"], data_ranks, dp_group,
                                                  *hsdp, edp))
        return self._shared.groups[key][1]

    @cached_property
    def _rows(self) -> tuple[list[list[LayerChoice]], list[list[LayerPrice]]]:
        """Every layer's choices and prices, built on first use.

        Layers of one cost class (the repeated blocks) share one priced row; a row
        is copied before a layer's row is extended (see solver._pinned_outside_search).
        Tables :attr:`alike` share them (a price is per microbatch or per step; the schedule sets only the
        microbatches in flight, which :meth:`activation_bytes` applies)."""
        if (alike := self.alike) in self._shared.rows:
            return self._shared.rows[alike][1]
        rows: dict[tuple, tuple[list[LayerChoice], list[LayerPrice]]] = {}
        keys = []
        for layer, key, zeros in self.row_keys():
            if key not in rows:
                choices = self.offered_choices(layer, zeros)
                rows[key] = (choices, [self._price(layer, s) for s in choices])
            keys.append(key)
        out = [rows[k][0] for k in keys], [rows[k][1] for k in keys]
        self._shared.rows[alike] = (self.graph, out)  # the graph is kept, so its id is not reused
        return out

    def row_keys(self) -> Iterator[tuple[Layer, tuple, tuple[int, ...]]]:
        """Each layer, what its row depends on (layers equal in it share one), and its ZeRO stages offered."""
        for layer in self.graph:
            zeros = contract.offered_zeros(self.graph, layer.index, self.config.data_parallel, self.config.mesh.pp,
                                           self.config.schedule.split_backward)
            yield layer, (self.graph.cost_classes[layer.index], zeros, self._recompute_options(layer),
                          loss_price.recomputes(self, layer)), zeros

    def style_activation_bytes(self, layer: Layer, style_name: str | None, sp: bool = False) -> float:
        """Activation bytes per sample ``layer`` saves under a style (:meth:`_style_part`'s)."""
        return self._style_part(layer, style_name, sp)[4]

    @cached_property
    def alike(self) -> tuple:
        """What the rows depend on: tables equal in it (their configurations differ in the schedule at most,
        which :class:`Configuration` equality leaves out, but for whether it splits backward) share them."""
        return id(self.graph), id(self.cluster), id(self.training), self.config, self.config.schedule.split_backward

    @cached_property
    def choices(self) -> list[list[LayerChoice]]:
        return list(self._rows[0])  # this table's own list: index_of replaces a layer's row in it

    @cached_property
    def prices(self) -> list[list[LayerPrice]]:
        return list(self._rows[1])

    def fastest_time_mb_s(self) -> list[float]:
        """Per layer, the least per-microbatch time any choice could take: its fastest style's, plus what
        every choice adds (ep's all-to-alls, norm statistics sync; without them ep's bounds were ep=1's).
        It reads the mesh (but its dp_replicate: no time per microbatch depends on it), microbatches and cp's
        method only: tables alike in those share it."""
        if (alike := self.times_alike) not in self._shared.fastest:
            self._shared.fastest[alike] = (self.graph, self._fastest_time_mb_s())
        return list(self._shared.fastest[alike][1])

    @cached_property
    def times_alike(self) -> tuple:
        """What per-microbatch times read of the configuration (tables equal in it share them): the mesh but
        its dp_replicate, the microbatches and cp's method."""
        c = self.config
        mesh = c.mesh.replace(dp_replicate=1) if c.mesh.dp_replicate > 1 else c.mesh
        return id(self.graph), id(self.cluster), id(self.training), mesh, c.microbatches, c.cp_attention

    def _fastest_time_mb_s(self) -> list[float]:
        memo: dict[int, float] = {}
        out = []
        for layer, cls in zip(self.graph, self.graph.cost_classes):
            if cls not in memo:
                styles = {(s.tp, s.sp) for s in self.offered_choices(layer, (0,))}
                every = sum(expert_price.dispatch_s(self, layer)) + 2 * self._norm_sync_s(layer)
                memo[cls] = every + min(sum(self._style_part(layer, t, sp)[:4]) for t, sp in styles)
            out.append(memo[cls])
        return out

    def _recompute_options(self, layer: Layer) -> tuple[Recompute, ...]:
        key = (id(self.graph), layer.index, self.config.mesh.pp, split := self.config.schedule.split_backward)
        memo = self._shared.recomputes
        if key not in memo:
            memo[key] = contract.offered_recomputes(self.graph, layer.index, self.config.mesh.pp, split)
        return memo[key]

    def offered_choices(self, layer: Layer, zeros: tuple[int, ...]) -> list[LayerChoice]:
        """What the contract lets this layer run as (styles, ZeRO stages, recompute); tables of one mesh share it."""
        key = (id(layer), zeros, self.config.mesh, self.config.schedule.split_backward)
        if key not in self._shared.choices:  # the layer is kept, so its id is not reused
            self._shared.choices[key] = (layer, self._new_choices(layer, zeros))
        return list(self._shared.choices[key][1])

    def _new_choices(self, layer: Layer, zeros: tuple[int, ...]) -> list[LayerChoice]:
        styles: list[tuple[str | None, bool]] = [(None, False)]
        tp = self.config.mesh.tp
        if tp > 1 and contract.tp_applies(self.graph, self.config.mesh.pp) \
                and not contract.tied_across_stages(self.graph, layer.index, self.config.mesh.pp):
            for s in layer.tp_styles:
                if s.admits(tp) and contract.cp_admits_style(s, self.config.mesh) \
                        and not contract.experts_split_refusal(s, self.config.mesh) \
                        and not (s.experts and self.training.compiled):  # eager only (runtime/compiled.py)
                    sp = s.admits_sequence(tp) and contract.cp_admits_sequence(self.graph.seq_len or 0,
                                                                               self.config.mesh)
                    styles += [(s.name, False)] + ([(s.name, True)] if sp else [])
        return [LayerChoice(t, z, r, sp) for t, sp in styles for z in zeros for r in self._recompute_options(layer)]

    def index_of(self, i: int, choice: LayerChoice) -> int:
        """``choice``'s index in layer ``i``'s row, pricing it there first if the search space
        leaves it out (a pinned or hand-made choice). Rows are shared between layers that
        price alike, so the row is copied before it is extended."""
        if choice not in self.choices[i]:
            self.choices[i] = [*self.choices[i], choice]
            self.prices[i] = [*self.prices[i], self._price(self.graph[i], choice)]
        return self.choices[i].index(choice)

    def runs_as(self, i: int, choice: LayerChoice) -> LayerChoice:
        """What layer ``i`` asking for ``choice`` runs as (the contract's ZeRO stage and recompute):
        what it is priced as."""
        key = (i, choice)
        if key not in self._runs_memo:
            c = self.config
            zero = contract.effective_zero(self.graph, i, choice.zero, c.data_parallel, self.data_ranks, c.mesh.pp)
            self._runs_memo[key] = replace(choice, zero=zero, recompute=contract.recompute_runs_as(
                self.graph, i, c.mesh.pp, choice.recompute))
        return self._runs_memo[key]

    def buffers_needed(self, i: int, k: int) -> Buffers:
        """The FSDP2 buffers layer ``i`` under choice ``k`` makes its rank hold (the contract's)."""
        if self.data_ranks <= 1 or self.engine is Engine.DDP:
            return Buffers.NONE
        zero = self.runs_as(i, self.choices[i][k]).zero
        return contract.buffers_of(zero, bool(self.graph[i].param_count))

    def buffer_bytes(self, buffers: Buffers) -> int:
        """Bytes of FSDP2's ``buffers`` on a rank."""
        return ((self.reduce_scatter_buffer_bytes if buffers >= Buffers.REDUCE_SCATTER else 0)
                + (self.prefetch_buffer_bytes if buffers is Buffers.PREFETCH else 0))

    @cached_property
    def bubble_weight(self) -> Fraction:
        """w in step = m·T + w·(S − T) + X (see the module docstring; :mod:`.pipeline_price`)."""
        return pipeline_price.bubble_weight(self)

    @cached_property
    def core_sharing(self) -> tuple[Fraction, int]:
        """(σ, k): σ how much faster a rank runs while the others of its node wait, k how many
        consecutive pipeline ranks share a node's cores; (1, 1) where no rank lends cores.

        A node holds :func:`~autopar.contract.pipeline_ranks_per_node` pipeline
        ranks; with k = 1 every rank of a node waits at the same moments and
        lends nothing.
        """
        c = self.config
        on_node = min(self.cluster.gpus_per_node, c.world_size)
        k = math.gcd(contract.pipeline_ranks_per_node(c.mesh, self.cluster.gpus_per_node), c.mesh.pp)
        sigma = idle_core_speedup(self.cluster, on_node)
        return (Fraction(1), 1) if c.mesh.pp <= 1 or k < 2 or sigma == 1 else (sigma, k)

    @cached_property
    def paced_cluster(self) -> ClusterSpec:  # blocking waits at the ranks busy at once: pipeline_price
        return pipeline_price.paced_cluster(self)

    def pipeline_s(self, per_rank_mb_s: list[float]) -> float:
        """The step before the tail, from each pipeline rank's per-microbatch time (:func:`.pipeline_price.step_s`)."""
        return pipeline_price.step_s(self, per_rank_mb_s)

    def step_time_s(self, per_rank_mb_s: list[float], tail_s: float) -> float:
        """The step from each pipeline rank's per-microbatch time and the largest tail."""
        return self.pipeline_s(per_rank_mb_s) + tail_s

    @cached_property
    def in_flight(self) -> list[Fraction]:
        c = self.config
        return [in_flight(c.schedule, c.mesh.pp, c.microbatches, j) for j in range(c.mesh.pp)]

    @cached_property
    def largest_unit_params(self) -> int:
        """Parameters of the largest FSDP unit (:func:`autopar.contract.largest_unit_params`); under ep an MoE
        layer's split experts are a unit of their own (its 1/ep; ``passes/expert_parallel.py``; at ZeRO-0 outside
        FSDP2, a unit all the same: an upper bound)."""
        w = contract.wrapping(self.graph, self.config.mesh.pp)
        if self.config.mesh.ep <= 1:
            return w.largest_unit_params
        dense = [layer.param_count - expert_price.split_params(self, layer) for layer in self.graph]
        units = [d for d, own in zip(dense, w.own) if own]
        units.append(sum(d for d, root in zip(dense, w.root) if root))  # every stage's root: a bound, as contract's
        units += [expert_price.local_params(self, layer) for layer in self.graph if layer.moe]
        return max(units)

    @cached_property
    def workspace_bytes(self) -> int:
        """Transient on every rank: the largest unit gathered, one layer's activations (and ring's K/V in flight)."""
        return self.prec.param_bytes * self.largest_unit_params + self.layer_transient_bytes

    @cached_property
    def layer_transient_bytes(self) -> int:
        alike = list({(l.activation_bytes_per_sample, l.kv_bytes_per_sample, l.attention_calls): l  # what they read
                      for l in self.graph}.values())
        largest_act = max((context_price.context_part(self, l, l.activation_bytes_per_sample)[2]
                           for l in alike), default=0.0)
        ring = max((context_price.ring_transient_bytes(self, l) for l in alike), default=0.0)
        return math.ceil(self.microbatch_size * largest_act * self.act_scale + ring)

    @cached_property
    def loss(self) -> LossKind:  # the loss this configuration runs (loss_price.loss_runs)
        return loss_price.loss_runs(self)

    @cached_property
    def loss_bytes(self) -> tuple[int, int]:  # (the loss's peak, what it keeps beside a layer's): loss_price
        return loss_price.loss_bytes(self)

    @cached_property
    def loss_time_s(self) -> tuple[float, float]:  # (forward, backward) per microbatch: loss_price
        return loss_price.loss_time_s(self)

    def rank_workspace_bytes(self, rank: int) -> int:
        """:attr:`workspace_bytes`, on the last pipeline rank the loss's peak in one layer's stead if larger."""
        peak, beside = self.loss_bytes if rank == self.config.mesh.pp - 1 else (0, 0)
        return self.workspace_bytes + max(peak - self.layer_transient_bytes, beside)

    @cached_property
    def reduce_scatter_buffer_bytes(self) -> int:
        """A rank with a ZeRO-1/2/3 layer holds two units' unsharded gradients in backward: those
        autograd is producing, and the previous unit's, kept until their reduce-scatter is done
        (FSDP2 overlaps one unit's reduce-scatter with the next unit's backward)."""
        return 2 * self.prec.grad_bytes * self.largest_unit_params if self.data_ranks > 1 else 0

    @cached_property
    def prefetch_buffer_bytes(self) -> int:
        """A rank with a ZeRO-3 layer gathers the next unit's weights while the current one runs
        (FSDP2's prefetch, forward and backward): a second unit of gathered weights."""
        return self.prec.param_bytes * self.largest_unit_params if self.data_ranks > 1 else 0

    def effective_params(self, layer: Layer, choice: LayerChoice) -> int:
        """Parameters one rank holds for the layer before ZeRO sharding."""
        if choice.tp is None:
            return layer.param_count
        sharded = layer.tp_style(choice.tp).sharded_params
        return layer.param_count - sharded + math.ceil(sharded / self.config.mesh.tp)

    def compiled_ops(self, layer: Layer) -> bool:
        return compiled_ops(self, layer)

    def _style_part(self, layer: Layer, style_name: str | None,
                    sp: bool = False) -> tuple[float, float, float, float, float, float, float, LayerCompute]:
        """What a tensor-parallel style (or none) sets, whatever the ZeRO stage and recompute: :mod:`.style_price`."""
        return style_part(self, layer, style_name, sp)

    def _price(self, layer: Layer, choice: LayerChoice) -> LayerPrice:
        """The layer priced as it runs (:meth:`runs_as`)."""
        runs = self.runs_as(layer.index, choice)
        c, prec, device = self.config, self.prec, self.cluster.device
        fwd, bwd, tp_comm_fwd, tp_comm_bwd, acts, kv_fwd, kv_bwd, times = self._style_part(layer, runs.tp, runs.sp)
        if self.prec.grad_bytes < FP32_BYTES and self.engine in (Engine.NONE, Engine.DDP):  # fp32 masters
            bwd += master_hooks_s(layer, times, device)
        a2a_fwd, a2a_bwd = expert_price.dispatch_s(self, layer)
        tp_comm_fwd, tp_comm_bwd = tp_comm_fwd + a2a_fwd, tp_comm_bwd + a2a_bwd
        norm_sync = self._norm_sync_s(layer)
        fwd, bwd = fwd + norm_sync, bwd + norm_sync
        refwd, activation_mb = kept_mb_bytes(self, layer, runs, fwd, acts, times)
        loss_fwd, loss_bwd = self.loss_time_s if layer.index == len(self.graph) - 1 else (0.0, 0.0)
        fwd, bwd = fwd + loss_fwd, bwd + loss_bwd  # the loss's kernels, on the last layer's rank
        compute = fwd + bwd + refwd + loss_price.recompute_s(self, layer, times.device_fwd_s)
        # a recomputed forward issues its collectives again (selective keeps only matmul-class outputs)
        tp_comm = tp_comm_fwd + tp_comm_bwd + (tp_comm_fwd if runs.recompute else 0.0)
        ep_comm = a2a_fwd + a2a_bwd + (a2a_fwd if runs.recompute else 0.0)
        cp_comm = kv_fwd + kv_bwd + (kv_fwd if runs.recompute else 0.0)  # a recomputed forward gathers K/V again
        params = self.effective_params(layer, runs)
        experts = expert_price.local_params(self, layer)  # ep: this rank's experts, outside the dp engine
        dense = params - expert_price.split_params(self, layer)
        ez, edp = expert_price.expert_zero(self, layer, runs.zero), self.edp_group.size  # the experts' ZeRO over edp
        share = contract.collective_share(self.graph, layer.index, self.engine, c.mesh.pp, prec.grad_bytes)
        gathered = (self.training.float8.gathered_elements(layer.name)
                    if self.training.float8 is not None and runs.zero >= 1 else (0, 0))
        dp_comm = (self.dp_collectives_s(dense, runs.zero, share, gathered)
                   + expert_price.collectives_s(self, experts, ez))
        fsdp_work = self._zero_overhead_s(dense, runs.zero, share)  # done by the host: never hidden
        fsdp_work += self._tied_sum_s(layer, runs.zero) + (expert_price.sync_s(self, layer) if ez == 0 else 0.0)
        if ez:  # FSDP2's own work around each of the experts unit's collectives
            fsdp_work += self.cluster.zero_overhead_s * sum(contract.dp_collectives(ez, c.microbatches))
        weights, grads, optimizer, buckets = held_bytes(self, layer, runs)
        return LayerPrice(
            forward_mb_s=fwd,
            compute_mb_s=compute,
            forward_tp_mb_s=tp_comm_fwd,
            tp_comm_mb_s=tp_comm,
            dp_comm_s=dp_comm + fsdp_work,
            exposed_comm_s=exposed_comm_s(dp_comm, c.microbatches * compute, self.cluster.comm_overlap)
            + fsdp_work,
            optimizer_s=(optimizer_shard_params(dense, runs.zero, self.shard_ranks)
                         + optimizer_shard_params(experts, ez, edp))
            * prec.optimizer_bytes_touched / device.memory_bandwidth_bytes_s
            + (len(layer.param_names) if self._dtensor(runs) else expert_price.dtensor_params(self, layer))
            * self.cluster.optimizer_dtensor_s,
            params_bytes=weights,
            grads_bytes=grads,
            optimizer_bytes=optimizer,  # what the ZeRO formula leaves, rounding included
            buckets_bytes=buckets,
            activation_mb_bytes=activation_mb,
            ep_comm_mb_s=ep_comm,
            cp_comm_mb_s=cp_comm,
        )

    def _norm_sync_s(self, layer: Layer) -> float:
        """Per microbatch, forward or backward: a BatchNorm under dp all-reduces its per-channel sum
        and sum of squared deviations over the dp group (two all-reduces of C fp32 values each way,
        passes/batchnorm.py), blocking the layer's compute."""
        if self.config.mesh.dp <= 1 or not layer.sync_norm_channels or not synced(self.training.batch_coupled):
            return 0.0  # batch_coupled=split: each rank normalises its own share, no collective
        return sum(2 * collective_time_s(Collective.ALL_REDUCE, FP32_BYTES * c, self.dp_group, self.cluster)
                   for c in layer.sync_norm_channels)

    def _dtensor(self, runs: LayerChoice) -> bool:
        """Whether the layer's parameters are DTensors once lowered (passes/zero.py,
        passes/tensor_parallel.py): tensor-parallel, or data-parallel on FSDP2 (anything but DDP)."""
        return runs.tp is not None or self.engine in (Engine.REPLICATE, Engine.FULLY_SHARD)

    def dp_collectives_s(self, params: int, zero: int, share: float = 1.0,
                         float8: tuple[int, int] = (0, 0)) -> float:
        """Per step: the collectives of :func:`autopar.contract.dp_collectives`. ``share``: the
        layer's share of each collective's latency. ``float8``: (elements, weights) of the layer's
        converted linears FSDP2 gathers in float8 (:meth:`autopar.float8.Float8Settings.gathered_elements`)."""
        if self.data_ranks <= 1 or params == 0:
            return 0.0
        key = (params, zero, share, float8, self.dp_group, self.shard_group, self.replicate_group,
               self.config.microbatches, self.prec, id(self.cluster))
        memo = self._shared.dp_collectives
        if key not in memo:
            memo[key] = hsdp_price.dp_collectives_s(self, params, zero, share, float8)
        return memo[key]

    def _tied_sum_s(self, layer: Layer, zero: int) -> float:
        """Per step, at each end of tied embeddings split across stages: the all-reduce of the tied
        weight's gradient (this rank's shard of it) between the first and last stage's ranks, after
        the pipeline drains — a two-rank all-reduce moves the shard once each way, priced as one send."""
        if not contract.tied_across_stages(self.graph, layer.index, self.config.mesh.pp):
            return 0.0
        shard = self.shard_ranks if zero >= 1 and self.data_ranks > 1 else 1
        nbytes = self.prec.grad_bytes * layer.tied_param_count / shard
        return p2p_time_s(nbytes, inter_node=self.pp_inter_node, cluster=self.cluster)

    def _zero_overhead_s(self, params: int, zero: int, share: float) -> float:
        """Per step: FSDP2's own work around each of its collectives (the cluster's
        ``zero_overhead_s``; ``share`` as in :meth:`dp_collectives_s`). FSDP2's replicate all-reduces once a
        step; DDP's bucketing is C++ beside its all-reduce and left out."""
        c, each = self.config, self.cluster.zero_overhead_s
        if each <= 0 or self.data_ranks <= 1 or params == 0 or self.engine is Engine.DDP:
            return 0.0
        return share * each * sum(contract.dp_collectives(zero, c.microbatches))

    def memory_coefficient(self, layer_index: int, k: int, rank: int) -> int:
        """Bytes layer ``layer_index`` under choice ``k`` adds to pipeline rank ``rank``."""
        return self.prices[layer_index][k].state_bytes + self.activation_bytes(layer_index, k, rank)

    def activation_bytes(self, layer_index: int, k: int, rank: int) -> int:
        """Activations layer ``layer_index`` under choice ``k`` keeps on pipeline rank ``rank``: one
        microbatch's times the microbatches in flight there at the peak."""
        f = self.in_flight[rank]
        return -(-self.prices[layer_index][k].activation_mb_bytes * f.numerator // f.denominator)

    def sequence_region_s(self, i: int, k: int) -> float:
        """Entering and leaving a sequence-parallel region, per microbatch, if layer ``i``'s choice
        ``k`` is sequence parallel (:func:`autopar.planning.sequence.region_s`); else 0."""
        key = (i, k)
        if key not in self._region_memo:  # the CP-SAT model asks for every layer's choices on every rank
            choice = self.choices[i][k]
            style = self.graph[i].tp_style(choice.tp) if choice.sp else None  # type: ignore[arg-type]
            alike = (None, style.cost_signature() if style is not None else None)  # styles that price alike
            if alike not in self._region_memo:
                self._region_memo[alike] = 0.0 if style is None else region_s(
                    style, self.prec.activation_bytes * self.microbatch_size, self.tp_group, self.paced_cluster)
            self._region_memo[key] = self._region_memo[alike]
        return self._region_memo[key]

    def p2p_s(self, cut: int, stage: int | None = None) -> float:
        """One send of the values crossing a cut placed before layer ``cut``, per microbatch, into
        virtual stage ``stage`` (over the NICs where its pipeline rank's node differs from the
        previous stage's, :func:`autopar.planning.edges.boundary_inter_node`); under cp, the rank's S/cp
        tokens of them (the lowering traces and runs the stages on those). Without ``stage``,
        the cheapest boundary of the pipeline's: what a bound may count on."""
        key = (cut, stage)
        if key not in self._p2p_memo:  # the bounds and the model ask for every cut at every boundary
            self._p2p_memo[key] = pipeline_price.send_s(self, cut, stage)
        return self._p2p_memo[key]

    @cached_property
    def boundary_inter_node(self) -> tuple[bool, ...]:
        """Per virtual stage s ≥ 1, whether the sends from stage s − 1 cross nodes (index 0 unused)."""
        return (False, *(edges.boundary_inter_node(self, s) for s in range(1, self.config.stages)))

    def p2p_largest_s(self) -> float:
        """The dearest send of any cut at any boundary (the solver's time unit counts it)."""
        return max(self.p2p_s(q, s) for q in range(len(self.graph) + 1) for s in range(max(self.config.stages, 1)))
