"""A pipeline's ranks given their alike layers by dynamic programming: a tighter bound, and a first plan.

Most models are a run of alike blocks between a few layers every plan puts on the first and the last
pipeline stage (the *ends*: the layers before the first allowed cut and after the last). Then how many
blocks each rank holds decides most of the step, (m − w)·T + w·S + X (:mod:`.pricing`). With
A_j(n) the least time per microbatch rank j can run n blocks in, in its own memory (its ends, their
least time and room, and the FSDP2 buffers its strategies need, as :func:`.bounds.rank_curves`), and
B_j(n) the least of w·time + tail/pp there (X is at least the ranks' mean tail), every plan has a
cap T ≥ A_j(n_j) on each rank and step ≥ (m − w)·T + Σ_j B_j(n_j) + the least exposed ends
(:func:`.bounds.least_edge_s`). For each cap, the least Σ_j B_j(n_j) over Σ_j n_j = N is a knapsack
over ranks solved exactly (:func:`_least_sum`); the least over the caps is :attr:`RankDp.bound_s`.
The rank floors the search had (:func:`.bounds.lower_bound_s`) bound T alone and let every rank
sit at the slowest's time; here the ranks that must recompute (the first, holding pp microbatches)
are charged for it in S as well; and a rank running blocks sequence parallel pays the region's entry and
exit (:mod:`.sequence`). Layers neither blocks nor ends count nothing: the bound stays a bound.

The allotment the programme picks, each rank's ends and blocks on the strategies (two at most) that
least its α·time + tail/pp (α = (m − w)/pp + w, a rank's weight in a balanced pipeline), at each ZeRO
stage the root units may share and each highest ZeRO stage (what the ends expose), is a whole plan
(:meth:`RankDp.plan`). Priced by :func:`.evaluate.evaluate` and kept only where it fits and keeps the
model's rules (cuts where allowed, every stage holding a layer, a sharded plan sharding a layer, the root
units at one ZeRO stage), it is offered to the search before the configuration's CP-SAT solve, which
starts from it (:func:`.model.hint_plan`). A plan that meets the bound is proved best for its
configuration without a solve: no plan of it is faster than a lower bound. The 462B stand-in at tp 8 ×
pp 16 × dp 48 (``examples/gpt.py:gpt_462b_standin``): its best configuration (interleaved ×4, m = 32)
bounded at 9.10 s a step (the search's bound 8.79), the programme's plan 9.64 s, the optimum 9.46 s,
proved by CP-SAT in 0.23 deterministic seconds from that plan (0.49 held to it without the hint, past
the first solve's 0.5 s once the model is built); the next configuration (×2) bounded at 9.51 s, past the optimum, where
the search's 9.17 s had to be refuted by CP-SAT.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from autopar import contract
from autopar.choice import LayerChoice
from autopar.contract import Buffers
from autopar.planning import edges
from autopar.planning.bounds import layer_groups, least_edge_s, least_time_in, rank_p2p_floor
from autopar.planning.evaluate import Evaluation, evaluate
from autopar.planning.pricing import LayerPrice, PriceTable

Point = tuple[int, float, int]  # a strategy's memory on a rank, its weighed time, its index
MOST_END_CHOICES = 256  # end-layer choice combinations enumerated per rank (beyond: each end at its least)
MOST_CAPS = 400  # caps T tried; past them the bound is what the next cap could reach at best


Plan = tuple[tuple[int, ...], tuple[LayerChoice, ...], Evaluation]  # stages, choices, and their prediction


@dataclass
class RankDp:
    """What the programme found for one configuration: a lower bound on its step (``-inf``: it does not
    apply) and what its plan is built from, only when asked (:meth:`plan`: most configurations bounded are
    never solved, and building and pricing the plans took two thirds of the programme's time)."""

    bound_s: float
    allotment: tuple | None = None  # (facts, allowed, cuts_ok, ends, blocks, counts, budget): _best_plan's
    _plan: list = field(default_factory=list)

    def plan(self) -> Plan | None:
        """The allotment's plan (None: none that fits and keeps the model's rules), built once."""
        if not self._plan:
            self._plan.append(_best_plan(*self.allotment) if self.allotment is not None else None)
        return self._plan[0]


@dataclass(frozen=True)
class _End:
    """One combination of choices of a rank's end layers: its memory there, weighed time, the buffers it
    needs, and the choices."""

    memory: int
    value: float
    need: int
    choices: tuple[int, ...]


def rank_dp(table: PriceTable, allowed: list[list[int]], budget: int | None, cuts_ok: list[int],
            layer_pins: list[dict] | None = None) -> RankDp:
    """The bound and plan of this module's docstring, for a pipeline (pp > 1) with a memory budget and no
    shared cores; elsewhere ``-inf`` and no plan. A layer pinned to a stage leaves the plan out."""
    c = table.config
    if budget is None or c.mesh.pp < 2 or not cuts_ok or table.core_sharing[0] != 1:
        return RankDp(-math.inf)
    n_layers = len(table.graph)
    first, last = range(cuts_ok[0]), range(cuts_ok[-1], n_layers)
    ends = {0: list(first)}
    ends.setdefault(c.rank_of_stage(c.stages - 1), []).extend(last)
    (block, _), members = max(layer_groups(table, allowed).items(), key=lambda item: len(item[1]))
    blocks = [i for i in members if i not in first and i not in last]
    if len(blocks) < 2:
        return RankDp(-math.inf)
    w, pp, n = float(table.bubble_weight), c.mesh.pp, len(blocks)
    offsets, facts = rank_p2p_floor(table, cuts_ok), _Facts(table)
    a_cost, b_cost = np.full((pp, n + 1), math.inf), np.full((pp, n + 1), math.inf)
    # a rank running any block sequence parallel pays the blocks' region once a chunk (:mod:`.sequence`): the
    # least over its sp strategies (evaluate charges the first one's); the least with none of them is apart
    sp = [k for k in allowed[block] if table.choices[block][k].sp]
    region = c.schedule.chunks * min((table.sequence_region_s(block, k) for k in sp), default=0.0)
    plain = [ks if i != block else [k for k in ks if k not in sp] for i, ks in enumerate(allowed)] \
        if region > 0 and len(sp) < len(allowed[block]) else None
    for j in range(pp):
        a_rank = _rank_options(facts, allowed, ends.get(j, []), block, j, budget, lambda p: p.time_mb_s)
        b_rank = _rank_options(facts, allowed, ends.get(j, []), block, j, budget,
                               lambda p: w * p.time_mb_s + p.tail_s / pp)
        if plain is not None:
            a_plain = _rank_options(facts, plain, ends.get(j, []), block, j, budget, lambda p: p.time_mb_s)
            b_plain = _rank_options(facts, plain, ends.get(j, []), block, j, budget,
                                    lambda p: w * p.time_mb_s + p.tail_s / pp)
        for count in range(n + 1):
            a_cost[j, count] = offsets[j] + _least(*a_rank, count) + (region if count else 0.0)
            b_cost[j, count] = w * offsets[j] + _least(*b_rank, count) + (w * region if count else 0.0)
            if plain is not None and count:
                a_cost[j, count] = min(a_cost[j, count], offsets[j] + _least(*a_plain, count))
                b_cost[j, count] = min(b_cost[j, count], w * offsets[j] + _least(*b_plain, count))
            if math.isinf(a_cost[j, count]):
                break  # more blocks fit no better: both stay inf (one frontier's least memory)
    edge = least_edge_s(table, allowed, sum(budget - table.rank_workspace_bytes(j) for j in range(pp)))
    bound, cap = _best_cap(a_cost, b_cost, c.microbatches - w, n)
    if math.isinf(bound):
        return RankDp(math.inf)
    bound = (bound + edge) * (1 - 1e-9)  # sums in another order than evaluate's must not prune a tie
    if any("stage" in pin for pin in layer_pins or ()):
        return RankDp(bound)
    counts = _allotment(np.where(a_cost <= cap, b_cost, math.inf), n)
    return RankDp(bound, (facts, allowed, cuts_ok, ends, blocks, counts, budget))


def _best_plan(facts: _Facts, allowed: list[list[int]], cuts_ok: list[int], ends: dict[int, list[int]],
               blocks: list[int], counts: list[int] | None, budget: int) -> Plan | None:
    """The fastest of the allotment's plans over the ZeRO stage the root units share and the highest ZeRO
    stage any layer runs at (what the ends expose: :mod:`.edges`), each rank's layers weighed as the step
    weighs a rank of a balanced pipeline: α·time + tail/pp, α = (m − w)/pp + w."""
    if counts is None:
        return None
    table = facts.table
    c, w = table.config, float(table.bubble_weight)
    alpha = (c.microbatches - w) / c.mesh.pp + w
    plans, seen = [], set()  # an assignment found again is priced once
    alike = set(blocks[1:])  # priced as the first block (one group): its levels stand for theirs
    for held in _root_stages(table, allowed):
        level = {i: {k: edges.edge_level(table, i, k) for k in ks} for i, ks in enumerate(held) if i not in alike}
        for z in sorted({z for row in level.values() for z in row.values()}):
            capped = [[k for k in ks if level[blocks[0] if i in alike else i][k] <= z] for i, ks in enumerate(held)]
            if any(not ks for ks in capped):
                continue
            options = [_rank_options(facts, capped, ends.get(j, []), blocks[0], j, budget,
                                     lambda p: alpha * p.time_mb_s + p.tail_s / c.mesh.pp) for j in range(c.mesh.pp)]
            if (plan := _plan(table, capped, cuts_ok, ends, blocks, counts, options, budget, seen)) is not None:
                plans.append(plan)
    return min(plans, key=lambda p: p[2].step_time_s, default=None)


def _root_stages(table: PriceTable, allowed: list[list[int]]) -> list[list[list[int]]]:
    """``allowed`` with the root-unit layers held to one ZeRO stage, for each stage they share, where the
    configuration leaves that stage open (a sharded one without its root's stage); else ``allowed``."""
    c = table.config
    if not c.data_parallel.sharded or c.data_parallel.root_zero:
        return [allowed]
    root = contract.wrapping(table.graph, c.mesh.pp).root
    zeros = [{table.choices[i][k].zero for k in ks} for i, ks in enumerate(allowed) if root[i]]
    if not zeros:
        return [allowed]
    return [[[k for k in ks if table.choices[i][k].zero == z] if root[i] else ks for i, ks in enumerate(allowed)]
            for z in sorted(set.intersection(*zeros))]


class _Facts:
    """A table's memory of a layer's strategy on a rank and the buffers it needs, each asked once: the plans
    ask them again for every root and edge stage tried (GPT-1T at pp 64: 1.1 of a programme's 2.1 s)."""

    def __init__(self, table: PriceTable):
        self.table = table
        self._memory: dict[tuple[int, int, int], int] = {}
        self._need: dict[tuple[int, int], int] = {}

    def memory(self, i: int, k: int, j: int) -> int:
        if (i, k, j) not in self._memory:
            self._memory[i, k, j] = self.table.memory_coefficient(i, k, j)
        return self._memory[i, k, j]

    def need(self, i: int, k: int) -> int:
        if (i, k) not in self._need:
            self._need[i, k] = self.table.buffers_needed(i, k).value
        return self._need[i, k]


def _rank_options(facts: _Facts, allowed: list[list[int]], layers: list[int], block: int, j: int, budget: int,
                  weigh: Callable[[LayerPrice], float]) -> tuple[list[_End], list[tuple[int, list[Point]]]]:
    """Rank j's end-layer combinations (:func:`_end_options`) and, per choice of FSDP2 buffers, the room
    left and the (memory, weighed time, strategy) frontier of the blocks' strategies it allows."""
    table = facts.table
    room = budget - table.rank_workspace_bytes(j)
    weighed = {k: weigh(table.prices[block][k]) for k in allowed[block]}
    by_mode = []
    for mode, buffers in enumerate(Buffers):
        points = [(facts.memory(block, k, j), weighed[k], k) for k in allowed[block] if facts.need(block, k) <= mode]
        by_mode.append((room - table.buffer_bytes(buffers), _frontier(points)))
    return _end_options(facts, allowed, layers, j, weigh), by_mode


def _end_options(facts: _Facts, allowed: list[list[int]], layers: list[int], j: int,
                 weigh: Callable[[LayerPrice], float]) -> list[_End]:
    """The rank's end-layer combinations no other beats on memory, weighed time and buffers together; past
    :data:`MOST_END_CHOICES` combinations, one of each layer's least memory and time (a bound only)."""
    def point(i: int, k: int) -> tuple[int, float, int]:
        return facts.memory(i, k, j), weigh(facts.table.prices[i][k]), facts.need(i, k)

    if math.prod(len(allowed[i]) for i in layers) > MOST_END_CHOICES:
        pts = [[point(i, k) for k in allowed[i]] for i in layers]
        return [_End(sum(min(p[0] for p in ps) for ps in pts), sum(min(p[1] for p in ps) for ps in pts), 0, ())]
    options = []
    for combo in itertools.product(*(allowed[i] for i in layers)):
        pts = [point(i, k) for i, k in zip(layers, combo)]
        options.append(_End(sum(p[0] for p in pts), sum(p[1] for p in pts), max((p[2] for p in pts), default=0),
                            combo))
    return [e for e in options if not any(_beats(o, e) for o in options)]


def _beats(o: _End, e: _End) -> bool:
    return (o.memory <= e.memory and o.value <= e.value and o.need <= e.need
            and (o.memory, o.value, o.need) != (e.memory, e.value, e.need))


def _frontier(points: list[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
    """(memory, time, strategy) points no other beats on both, by memory ascending."""
    front: list[tuple[int, float, int]] = []
    for m, t, k in sorted(points):
        if not front or t < front[-1][1]:
            front.append((m, t, k))
    return front


def _least(end_options: list[_End], by_mode: list, count: int) -> float:
    """The rank's least weighed time of ``count`` blocks over its end combinations and buffers."""
    best = math.inf
    for end in end_options:
        for mode, (room, front) in enumerate(by_mode):
            if mode < end.need or not front:
                continue
            held = least_time_in([(m, t) for m, t, _ in front], room - end.memory, count) if count else \
                (0.0 if room >= end.memory else math.inf)
            best = min(best, end.value + held)
    return best


def _least_sum(cost: np.ndarray, n: int) -> float:
    """min Σ_j cost[j, n_j] over Σ_j n_j = n: a min-plus convolution rank by rank."""
    f = cost[0].copy()
    for row in cost[1:]:
        g = np.full(n + 1, math.inf)
        for k in np.flatnonzero(np.isfinite(row)):
            np.minimum(g[k:], f[:n + 1 - k] + row[k], out=g[k:])
        f = g
    return float(f[n])


def _best_cap(a_cost: np.ndarray, b_cost: np.ndarray, weight: float, n: int) -> tuple[float, float]:
    """The least weight·T + Σ_j B_j(n_j) with every A_j(n_j) ≤ T, and the cap T reaching it. Caps are
    tried from the least that lets the ranks hold every block, up; once weight·T plus the least sum
    with no cap reaches the best, no larger cap can beat it."""
    caps = np.unique(a_cost[np.isfinite(a_cost)])
    free = _least_sum(np.where(np.isfinite(a_cost), b_cost, math.inf), n)
    if math.isinf(free):
        return math.inf, math.inf
    best, at = math.inf, math.inf
    for tried, cap in enumerate(caps):
        cap = float(cap)
        if weight * cap + free >= best:
            break
        if tried >= MOST_CAPS:
            return min(best, weight * cap + free), at  # every cap left reaches at least that
        if int(np.sum(np.max(np.where(a_cost <= cap, np.arange(n + 1), -1), axis=1))) < n:
            continue  # the ranks cannot hold every block under this cap
        value = weight * cap + _least_sum(np.where(a_cost <= cap, b_cost, math.inf), n)
        if value < best:
            best, at = value, cap
    return best, at


def _allotment(cost: np.ndarray, n: int) -> list[int] | None:
    """The n_j reaching :func:`_least_sum` (None: none)."""
    pp = cost.shape[0]
    f = [cost[0].copy()]
    back = []
    for row in cost[1:]:
        g, arg = np.full(n + 1, math.inf), np.zeros(n + 1, dtype=int)
        for k in np.flatnonzero(np.isfinite(row)):
            cand = f[-1][:n + 1 - k] + row[k]
            better = cand < g[k:]
            g[k:][better], arg[k:][better] = cand[better], k
        f.append(g)
        back.append(arg)
    if math.isinf(f[-1][n]):
        return None
    counts, left = [0] * pp, n
    for j in range(pp - 1, 0, -1):
        counts[j] = int(back[j - 1][left])
        left -= counts[j]
    counts[0] = left
    return counts


def _mix(front: list[tuple[int, float, int]], room: int, count: int) -> tuple[float, dict[int, int]] | None:
    """``count`` blocks on at most two strategies of ``front`` in ``room`` bytes, the fastest such mix."""
    best: tuple[float, dict[int, int]] | None = None
    for a, (m_a, t_a, k_a) in enumerate(front):
        if count * m_a > room:
            continue
        if best is None or count * t_a < best[0]:
            best = (count * t_a, {k_a: count})
        for m_b, t_b, k_b in front[a + 1:]:
            fast = min(count, (room - count * m_a) // (m_b - m_a))
            if fast > 0 and (t := fast * t_b + (count - fast) * t_a) < best[0]:
                best = (t, {k_b: fast, k_a: count - fast} if fast < count else {k_b: count})
    return best


def _plan(table: PriceTable, allowed: list[list[int]], cuts_ok: list[int], ends: dict[int, list[int]],
          blocks: list[int], counts: list[int], options: list, budget: int, seen: set):
    """The plan of an allotment, each rank's ends and blocks on what its least weighed time used (``options``
    per rank: :func:`_rank_options`); None where it breaks a rule of the model or does not fit."""
    c = table.config
    chosen: dict[int, int] = {}
    per_rank: list[list[int]] = []
    for j, count in enumerate(counts):
        end_options, by_mode = options[j]
        best: tuple[float, _End, dict[int, int]] | None = None
        for end in end_options:
            if not end.choices and ends.get(j):
                return None  # too many end combinations: no plan
            for mode, (room, front) in enumerate(by_mode):
                if mode < end.need or not front:
                    continue
                mix = _mix(front, room - end.memory, count) if count else ((0.0, {}) if room >= end.memory else None)
                if mix is not None and (best is None or end.value + mix[0] < best[0]):
                    best = (end.value + mix[0], end, mix[1])
        if best is None:
            return None
        chosen.update(zip(ends.get(j, []), best[1].choices))
        per_rank.append([k for k, many in sorted(best[2].items()) for _ in range(many)])
    # each rank's blocks over its stages, in order, as evenly as its chunks allow
    rank_of = [c.rank_of_stage(s) for s in range(c.stages)]
    own: dict[int, list[int]] = {}
    for s, j in enumerate(rank_of):
        own.setdefault(j, []).append(s)
    per_stage = [0] * c.stages
    for j, count in enumerate(counts):
        for n, s in enumerate(own[j]):
            per_stage[s] = count // len(own[j]) + (n < count % len(own[j]))
    stage_of_block = [s for s, many in enumerate(per_stage) for _ in range(many)]
    stages, choices, b, stage = [], [], 0, 0
    for i in range(len(table.graph)):
        if i < cuts_ok[0]:
            stage = 0
        elif i >= cuts_ok[-1]:
            stage = c.stages - 1
        elif b < len(blocks) and i == blocks[b]:
            stage = stage_of_block[b]
            chosen[i] = per_rank[rank_of[stage]].pop()
            b += 1
        if i not in chosen:  # neither a block nor an end: its fastest choice, with the layer before it
            chosen[i] = min(allowed[i], key=lambda k: table.prices[i][k].time_mb_s)
        stages.append(stage)
        choices.append(table.choices[i][chosen[i]])
    if (key := (tuple(stages), tuple(choices))) in seen or not _keeps_rules(table, stages, choices, cuts_ok):
        return None
    seen.add(key)
    prediction = evaluate(table, tuple(stages), tuple(choices))
    if max(prediction.memory_per_rank_bytes) > budget:
        return None
    return tuple(stages), tuple(choices), prediction


def _keeps_rules(table: PriceTable, stages: list[int], choices: list[LayerChoice], cuts_ok: list[int]) -> bool:
    """Whether a plan keeps the CP-SAT model's rules (:mod:`.model`): stages in order, each holding a layer,
    cut only where allowed; a sharded plan shards some layer where no root unit implies it; the root
    units at one ZeRO stage where the configuration leaves it open."""
    c = table.config
    allowed_cuts = set(cuts_ok)
    if stages[0] != 0 or stages[-1] != c.stages - 1:
        return False
    for q in range(1, len(stages)):
        moved = stages[q] != stages[q - 1]
        if stages[q] not in (stages[q - 1], stages[q - 1] + 1) or (moved and q not in allowed_cuts):
            return False
    if not c.data_parallel.sharded:
        return True
    wrap = contract.wrapping(table.graph, c.mesh.pp)
    if not wrap.root_params and not any(ch.zero >= 1 and layer.param_count for ch, layer in zip(choices, table.graph)):
        return False
    if not c.data_parallel.root_zero and len({ch.zero for ch, root in zip(choices, wrap.root) if root}) > 1:
        return False
    return True


