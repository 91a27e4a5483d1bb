"""Evaluate once: a complete assignment priced into one typed breakdown.

:func:`evaluate` walks a plan's layers once through a
:class:`~autopar.planning.pricing.PriceTable` and returns an
:class:`Evaluation`: the step (the model of :mod:`autopar.planning.pricing`,
which the solver optimises), its breakdown on the critical rank, every
virtual stage's work per microbatch, and every pipeline rank's memory by kind
and tail. The solver ranks candidates by it; the plan, its runners-up,
``autopar explain`` and the pictures read it; nothing prices a plan again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.choice import LayerChoice
from autopar.contract import Buffers
from autopar.plan import Breakdown, RankCost, StageTime
from autopar.planning import edges
from autopar.planning.pricing import PriceTable
from autopar.planning.sequence import sequence_regions


@dataclass(frozen=True)
class Evaluation:
    """A priced assignment: the step, where its time goes, each stage's work and each rank's memory.

    ``rank_time_mb_s`` is each pipeline rank's T_j per microbatch (sends included); its
    stages add up to it. ``pace`` is the priced pipeline over its critical path m·T + w·(S − T):
    below 1 where waiting ranks lend cores (``PriceTable.pipeline_s``), and the breakdown's
    pipeline terms are scaled by it so that the terms add up to the step.
    """

    step_time_s: float
    breakdown: Breakdown
    stages: tuple[StageTime, ...]  # per virtual stage
    ranks: tuple[RankCost, ...]  # per pipeline rank
    rank_time_mb_s: tuple[float, ...]
    pace: float = 1.0

    @property
    def memory_per_rank_bytes(self) -> tuple[int, ...]:
        return tuple(r.memory_bytes for r in self.ranks)

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_per_rank_bytes)


@dataclass
class _Rank:
    """What one pipeline rank adds up while the layers are walked."""

    compute_s: float = 0.0
    tp_s: float = 0.0  # the experts' all-to-alls (ep_s) and cp's K/V collectives (cp_s) among them
    ep_s: float = 0.0
    cp_s: float = 0.0
    p2p_s: float = 0.0
    exposed_s: float = 0.0
    optimizer_s: float = 0.0
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    buckets_bytes: int = 0
    buffers: Buffers = Buffers.NONE

    @property
    def per_microbatch_s(self) -> float:
        return self.compute_s + self.tp_s + self.p2p_s

    @property
    def tail_s(self) -> float:
        return self.exposed_s + self.optimizer_s


def evaluate(table: PriceTable, stages: tuple[int, ...], choices: tuple[LayerChoice, ...]) -> Evaluation:
    """Price a complete assignment with the same model the solver optimises.

    Each layer is priced as the contract says it runs (:meth:`PriceTable.runs_as`): a
    root-unit layer at its root's ZeRO stage, recompute only on a layer with a module. The
    table's configuration must carry the assignment's data-parallel mode
    (:func:`autopar.contract.mode_of`).
    """
    c = table.config
    ranks = [_Rank() for _ in range(c.mesh.pp)]
    rows = [[0.0] * 6 for _ in range(c.stages)]  # fwd, bwd, fwd tp, bwd tp, send fwd, send bwd
    level = 0  # the highest ZeRO stage of an FSDP2 unit: what the first and last units expose
    for i, (stage, choice) in enumerate(zip(stages, choices)):
        k = table.index_of(i, choice)
        price, rank = table.prices[i][k], c.rank_of_stage(stage)
        r = ranks[rank]
        r.buffers = max(r.buffers, table.buffers_needed(i, k))
        level = max(level, edges.edge_level(table, i, k))
        r.compute_s += price.compute_mb_s
        r.tp_s += price.tp_comm_mb_s
        r.ep_s += price.ep_comm_mb_s
        r.cp_s += price.cp_comm_mb_s
        r.exposed_s += price.exposed_comm_s
        r.optimizer_s += price.optimizer_s
        r.params_bytes += price.params_bytes
        r.grads_bytes += price.grads_bytes
        r.optimizer_bytes += price.optimizer_bytes
        r.buckets_bytes += price.buckets_bytes
        r.activations_bytes += table.activation_bytes(i, k, rank)
        row = rows[stage]
        row[0] += price.forward_mb_s
        row[1] += price.compute_mb_s - price.forward_mb_s
        row[2] += price.forward_tp_mb_s
        row[3] += price.tp_comm_mb_s - price.forward_tp_mb_s
    for j, region in enumerate(sequence_regions(table, stages, choices)):
        ranks[j].tp_s += region
        if region:  # drawn on the rank's first stage with a sequence-parallel layer
            first = next(st for st, ch in zip(stages, choices) if ch.sp and c.rank_of_stage(st) == j)
            rows[first][2] += region / 2  # the exit's all-gather
            rows[first][3] += region / 2  # the entry's, in backward
    for cut in range(1, len(stages)):
        before, after = stages[cut - 1], stages[cut]
        if before != after:  # activations forward, gradients back
            send = table.p2p_s(cut, after)
            ranks[c.rank_of_stage(before)].p2p_s += send
            ranks[c.rank_of_stage(after)].p2p_s += send
            rows[before][4] += send
            rows[after][5] += send
    edge = edges.edge_exposed_s(table, level)  # the ends, at the plan's highest ZeRO stage, on every rank
    for r in ranks:
        r.exposed_s += edge
    return _evaluation(table, ranks, tuple(StageTime(s, *row) for s, row in enumerate(rows)))


def _evaluation(table: PriceTable, ranks: list[_Rank], stages: tuple[StageTime, ...]) -> Evaluation:
    """The step and its breakdown from the ranks' sums (see the pricing module's step model)."""
    c = table.config
    per_mb = [r.per_microbatch_s for r in ranks]
    for j, priced in enumerate(per_mb):
        drawn = sum(st.per_microbatch_s for st in stages if c.rank_of_stage(st.stage) == j)
        if not math.isclose(drawn, priced, rel_tol=1e-9, abs_tol=1e-15):
            raise RuntimeError(f"stage times of rank {j} add up to {drawn} s, its layers to {priced} s")
    crit = max(range(len(ranks)), key=lambda j: per_mb[j])
    last = max(range(len(ranks)), key=lambda j: ranks[j].tail_s)
    m, w = c.microbatches, float(table.bubble_weight)
    chain, pipeline = m * per_mb[crit] + w * (sum(per_mb) - per_mb[crit]), table.pipeline_s(per_mb)
    pace = pipeline / chain if chain else 1.0  # < 1 where waiting ranks lend cores
    breakdown = Breakdown(
        compute_s=pace * m * ranks[crit].compute_s,
        bubble_s=pace * w * (sum(per_mb) - per_mb[crit]),
        tp_comm_s=pace * m * (ranks[crit].tp_s - ranks[crit].ep_s - ranks[crit].cp_s),
        dp_comm_s=ranks[last].exposed_s,
        pp_comm_s=pace * m * ranks[crit].p2p_s,
        optimizer_s=ranks[last].optimizer_s,
        ep_comm_s=pace * m * ranks[crit].ep_s,
        cp_comm_s=pace * m * ranks[crit].cp_s,
    )
    costs = tuple(RankCost(r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.activations_bytes,
                           r.buckets_bytes + table.buffer_bytes(r.buffers), table.rank_workspace_bytes(j),
                           r.exposed_s, r.optimizer_s) for j, r in enumerate(ranks))
    return Evaluation(pipeline + ranks[last].tail_s, breakdown, stages, costs, tuple(per_mb), pace)


__all__ = ["Evaluation", "evaluate"]
