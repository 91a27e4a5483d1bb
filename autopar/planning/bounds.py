"""Bounds: step times and memory no plan of a configuration can beat, to skip or prune it.

:func:`lower_bound_s` bounds the step time (a knapsack over all ranks'
memory, and rank by rank with in-flight activations and FSDP2's buffers);
:func:`memory_lower_bound` bounds the least peak memory, for the search
that names the least memory an infeasible problem needs. Both read the
buffers a strategy makes its rank hold from the price table, which asks the
contract (:meth:`PriceTable.buffers_needed`).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from autopar.contract import Buffers
from autopar.planning import edges, pipeline_price
from autopar.planning.pricing import PriceTable

Curve = list[tuple[int, list[tuple[int, float]]]]  # (room in bytes, strategy frontier) per buffer choice
EXACT_WORK = 4096  # most count combinations tried for one rank's least time (beyond: the LP's bound)
_ROUNDING = 1 + 1e-12  # a count is skipped only when its least time is past the best by more than rounding


def lower_bound_s(table: PriceTable, allowed: list[list[int]], budget: int | None = None,
                  cuts_ok: list[int] | None = None, enough: float = math.inf, bubble_weight: Any = None) -> float:
    """Step time no plan of this configuration can beat (``inf``: none fits in memory).

    Every rank's time is at least the average over ranks of the layers' summed
    times, and the layers together must fit in pp × (budget − workspace) bytes
    (each layer counted at its smallest in-flight multiplier). The best such
    sum is bounded by the Lagrangian dual of that knapsack, max over λ ≥ 0 of
    Σ_l min_k (t_lk + λ·mem_lk) − λ·capacity (:func:`knapsack_dual_bound`). The
    slowest rank is also bounded rank by rank (:func:`_rank_time_bound_s`), unless the bound
    without it is already ``enough`` to rule the configuration out (it then returns that weaker
    bound: the rank by rank one costs most of a search's bounding time). ``bubble_weight``: a floor of
    the table's w to bound with (:func:`balanced_step_s`; None: w itself).
    """
    c = table.config
    memo: dict[tuple, float] = {}
    fastest = []
    for i, ks in enumerate(allowed):
        key = (table.graph.cost_classes[i], tuple(ks))
        if key not in memo:
            memo[key] = min(table.prices[i][k].time_mb_s for k in ks)
        fastest.append(memo[key])
    total, slowest = sum(fastest), max(fastest)
    sends = 0.0
    if cuts_ok and c.stages > 1:
        thinnest = min(cuts_ok, key=lambda q: table.graph[q - 1].boundary_bytes_per_sample)
        sends = 2 * (c.stages - 1) * table.p2p_s(thinnest)  # p2p time grows with bytes
    if budget is not None:
        capacity = sum(budget - table.rank_workspace_bytes(j) for j in range(c.mesh.pp))
        total = _knapsack_bound(table, allowed, capacity)
        edge = least_edge_s(table, allowed, capacity)
        with_tail = _step_knapsack_bound_s(table, allowed, capacity, sends, bubble_weight) + edge
        weaker = max(balanced_step_s(table, total + sends, slowest, bubble_weight) + edge, with_tail)
        if weaker >= enough:
            return weaker
        slowest = max(slowest, _rank_time_bound_s(table, allowed, budget, cuts_ok or []))
        return max(balanced_step_s(table, total + sends, slowest, bubble_weight) + edge, with_tail)
    return balanced_step_s(table, total + sends, slowest, bubble_weight)


def pooled_bound_s(table: PriceTable, allowed: list[list[int]], budget: int | None = None,
                   cuts_ok: list[int] | None = None) -> float:
    """:func:`lower_bound_s` without its rank by rank part, which costs most of it: what the search keys a
    configuration by until it comes next (the full bound is computed only for those that do). A split-backward
    schedule's w is its floor here (:func:`.pipeline_price.bubble_weight_floor`): its exact w simulates torch's
    actions, which only the configurations that come next need."""
    return lower_bound_s(table, allowed, budget, cuts_ok, enough=-math.inf,
                         bubble_weight=pipeline_price.bubble_weight_floor(table))


def balanced_step_s(table: PriceTable, total: float, slowest_layer: float, bubble_weight: Any = None) -> float:
    """The least step (:meth:`PriceTable.pipeline_s`) when S ≥ ``total`` and T ≥ S/pp, T ≥ any one
    layer (``slowest_layer`` may be any lower bound on T): a node's k ranks hold at least k/pp
    of S, so its work term is at least m·S/pp. It grows with w (T ≤ S), so ``bubble_weight``, a floor of
    the table's w (:func:`.pipeline_price.bubble_weight_floor`; None: w itself), gives a bound too.

    An infinite ``total`` or ``slowest_layer`` (no rank can hold its layers) is ``inf``, never nan: at
    w = m (GPipe at m = 1) 0·inf was nan, which as the search's heap key broke the heap's order, so the
    search stopped before configurations whose bound was below the plan it kept (with the split-backward
    schedules searched, a tiny Llama at 6 MiB on 8 ranks then got a plan 0.4% slower)."""
    if math.isinf(total) or math.isinf(slowest_layer):  # w = 0 at pp = 1, or w = m: 0·inf
        return math.inf
    c = table.config
    w = float(table.bubble_weight if bubble_weight is None else bubble_weight)
    chain = (c.microbatches - w) * max(total / c.mesh.pp, slowest_layer) + w * total
    sigma, _ = table.core_sharing
    return chain if sigma == 1 else max(chain / float(sigma), c.microbatches * total / c.mesh.pp)


def _knapsack_bound(table: PriceTable, allowed: list[list[int]], capacity: int) -> float:
    rank = min(range(table.config.mesh.pp), key=lambda j: table.in_flight[j])
    rows: dict[tuple, list[int]] = {}
    for i, ks in enumerate(allowed):
        rows.setdefault((table.graph.cost_classes[i], tuple(ks)), []).append(i)
    groups = [
        (tuple((table.prices[i][k].time_mb_s, table.memory_coefficient(i, k, rank)) for k in ks), len(members))
        for (_, ks), members in rows.items() for i in members[:1]
    ]
    return knapsack_dual_bound(groups, capacity)


def least_edge_s(table: PriceTable, allowed: list[list[int]], capacity: int) -> float:
    """What every rank's tail holds at the least: the first and last FSDP2 units' exposed traffic
    (:func:`.edges.edge_exposed_s`) at the lowest ZeRO level whose choices can hold the layers in the pooled
    memory (a model that fits only at ZeRO-3 pays ZeRO-3's ends; Llama 3 70B × 512: 0.52 s at pp=2)."""
    rank = min(range(table.config.mesh.pp), key=lambda j: table.in_flight[j])
    rows: dict[tuple, list[int]] = {}
    for i, ks in enumerate(allowed):
        rows.setdefault((table.graph.cost_classes[i], tuple(ks)), []).append(i)
    points = [([(edges.edge_level(table, i, k), table.memory_coefficient(i, k, rank)) for k in ks], len(members))
              for (_, ks), members in rows.items() for i in members[:1]]
    levels = sorted({z for row, _ in points for z, _ in row})
    for n, level in enumerate(levels):
        if sum(k * min((m for z, m in row if z <= level), default=math.inf) for row, k in points) <= capacity:
            return min(edges.edge_exposed_s(table, z) for z in levels[n:])  # a plan may run at any level above
    return 0.0  # nothing fits: the knapsack says so


def _step_knapsack_bound_s(table: PriceTable, allowed: list[list[int]], capacity: int, sends: float,
                           bubble_weight: Any = None) -> float:
    """The step with the tail in the knapsack: the step is at least α·S + X, with S the layers' summed time
    per microbatch (α its least weight in :func:`balanced_step_s`'s step, T ≥ S/pp) and X the slowest rank's
    tail, at least the mean of the ranks' (the layers' tails over pp). Each layer's choice then costs
    α·t + tail/pp. Why: the time-only knapsack takes the fastest choice's tail, ZeRO-0's, which hides its
    traffic, while the memory it has room for is ZeRO-3's, whose gathers and FSDP2's host work per
    microbatch the tail carries (Llama 3 70B × 512 at 8,192 tokens: pp=2 × dp=32 × cp=8 at 32 microbatches
    was bounded at 15.5 s beside its 21.8 s optimum, and 50 such configurations were solved to be refuted)."""
    c, w = table.config, float(table.bubble_weight if bubble_weight is None else bubble_weight)
    sigma, _ = table.core_sharing
    alpha = ((c.microbatches - w) / c.mesh.pp + w) if sigma == 1 else c.microbatches / c.mesh.pp
    rank = min(range(c.mesh.pp), key=lambda j: table.in_flight[j])
    rows: dict[tuple, list[int]] = {}
    for i, ks in enumerate(allowed):
        rows.setdefault((table.graph.cost_classes[i], tuple(ks)), []).append(i)
    groups = [
        (tuple((alpha * table.prices[i][k].time_mb_s + table.prices[i][k].tail_s / c.mesh.pp,
                table.memory_coefficient(i, k, rank)) for k in ks), len(members))
        for (_, ks), members in rows.items() for i in members[:1]
    ]
    return knapsack_dual_bound(groups, capacity) + alpha * sends


def knapsack_dual_bound(groups: list[tuple[tuple[tuple[float, int], ...], int]], capacity: int) -> float:
    """The least total time of ``groups`` ((time, memory) points of a layer, and how many such layers)
    whose memories sum within ``capacity``, bounded below by the Lagrangian dual's maximum (``inf``:
    even the smallest choices overflow).

    The dual D(λ) = Σ n·min_k (t_k + λ·m_k) − λ·capacity is concave and piecewise linear; its slope
    (memory used − capacity) drops only where a group's choice moves to the next vertex leftward of
    its lower convex hull, at λ = Δt/Δm. The maximum is at the first such breakpoint where the memory
    used fits: found exactly by sorting the breakpoints (a bisection took ~90 evaluations of D).
    Any λ ≥ 0 gives a valid bound, so D is evaluated there directly.
    """
    def dual(lam: float) -> float:
        return sum(n * min(t + lam * m for t, m in points) for points, n in groups) - lam * capacity

    fastest = [(min(points), n) for points, n in groups]  # at λ = 0: the fastest, the smallest among them
    if sum(n * m for (_, m), n in fastest) <= capacity:
        return sum(n * t for (t, _), n in fastest)
    if sum(n * min(m for _, m in points) for points, n in groups) > capacity:
        return math.inf
    used, events = 0, []
    for points, n in groups:
        least: dict[int, float] = {}  # one vertex a memory: the fastest
        for t, m in points:
            least[m] = min(t, least.get(m, math.inf))
        hull = lower_convex_hull(list(least.items()))
        first = min(range(len(hull)), key=lambda v: (hull[v][1], hull[v][0]))
        used += n * hull[first][0]
        for (m0, t0), (m1, t1) in zip(hull[:first], hull[1:first + 1]):
            events.append(((t0 - t1) / (m1 - m0), n * (m1 - m0)))
    events.sort()
    for lam, freed in events:
        used -= freed
        if used <= capacity:
            return max(dual(0.0), dual(lam))
    return max(dual(0.0), dual(events[-1][0]))  # unreachable: the smallest choices fit


def _rank_time_bound_s(table: PriceTable, allowed: list[list[int]], budget: int,
                       cuts_ok: list[int]) -> float:
    """A lower bound on T, the slowest pipeline rank's time per microbatch, from each rank's
    own memory (its in-flight activations, workspace and FSDP2 buffers).

    The knapsack bound pools every rank's memory, so it lets the first rank of a 1F1B pipeline,
    which holds pp microbatches of activations, borrow the last rank's room; and it leaves out
    the buffers, which on a 1T model are as large as a rank's layers. Here, for each group of
    alike layers, g_j(n) is the least time rank j can hold n of them in (:func:`rank_curves`);
    g_j grows with n, and the group's N layers are spread over the ranks, so T is at least the
    N-th smallest of all g_j(n), plus the least point-to-point time rank j's stage boundaries
    add. Other layers only add time and memory, so every group gives a bound; the largest is kept.
    """
    offsets = rank_p2p_floor(table, cuts_ok)
    best = max(offsets, default=0.0)
    for (i, ks), members in layer_groups(table, allowed).items():
        if min(table.prices[i][k].time_mb_s for k in ks) > 0:
            curves = rank_curves(table, i, ks, budget, float)
            best = max(best, nth_smallest(lambda j, n: offsets[j] + least_time(curves[j], n),
                                           len(curves), len(members)))
    return best * (1 - 1e-9)  # sums in another order than evaluate's must not prune a tie


def layer_groups(table: PriceTable, allowed: list[list[int]]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """Layers that price alike and allow the same strategies, keyed by (first layer, strategies)."""
    rows: dict[tuple, list[int]] = {}
    keys: dict[tuple, tuple] = {}  # one row object and strategies give one key: hashed once, not a layer
    for i, ks in enumerate(allowed):
        by_row = (table.graph.cost_classes[i], id(table.choices[i]), tuple(ks))
        if by_row not in keys:
            keys[by_row] = group_key(table, i, ks)
        rows.setdefault(keys[by_row], []).append(i)
    return {(members[0], tuple(allowed[members[0]])): members for members in rows.values()}


def group_key(table: PriceTable, i: int, ks: list[int]) -> tuple:
    """Layers alike for the rank bounds: one cost class and the same strategies (by value: a
    row extended for a pin may give another strategy the same index)."""
    return table.graph.cost_classes[i], tuple(table.choices[i][k] for k in ks)


def rank_curves(table: PriceTable, i: int, ks: list[int] | tuple[int, ...], budget: int,
                 time_of: Any) -> list[Curve]:
    """Per pipeline rank, what :func:`least_time` needs for layer ``i``'s strategies ``ks``:
    for each choice of FSDP2 buffers the rank holds (none, reduce-scatter, both), the room
    left after workspace and buffers, and the (memory, time) frontier of the strategies that choice allows.
    ``time_of`` maps seconds to the unit of the result (the model's integer units, or none)."""
    c = table.config
    buffers = [table.buffer_bytes(b) for b in Buffers]
    need = [table.buffers_needed(i, k).value for k in ks]
    curves = []
    for j in range(c.mesh.pp):
        room = budget - table.rank_workspace_bytes(j)
        curve = []
        for mode, buffer in enumerate(buffers):
            points = [(table.memory_coefficient(i, k, j), time_of(table.prices[i][k].time_mb_s))
                      for k, q in zip(ks, need) if q <= mode]
            if points and room - buffer >= 0:
                curve.append((room - buffer, _frontier(points)))
        curves.append(curve)
    return curves


def rank_p2p_floor(table: PriceTable, cuts_ok: list[int], time_of: Any = float) -> list[float]:
    """Per pipeline rank, the least time its stages' boundaries add (each cut: one send, charged
    to the ranks on both sides), at the thinnest cut allowed."""
    c = table.config
    floor = [0.0] * c.mesh.pp
    if c.stages <= 1 or not cuts_ok:
        return floor
    # a send's time grows with its bytes over a given link: the thinnest cut is the cheapest at every boundary
    thinnest = min(cuts_ok, key=lambda q: table.graph[q - 1].boundary_bytes_per_sample)
    for s in range(1, c.stages):
        send = time_of(table.p2p_s(thinnest, s))
        floor[c.rank_of_stage(s - 1)] += send
        floor[c.rank_of_stage(s)] += send
    return floor


def _frontier(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The (memory, time) points no other beats on both, by memory ascending (time descending)."""
    front: list[tuple[int, float]] = []
    for m, t in sorted(points):
        if not front or t < front[-1][1]:
            front.append((m, t))
    return front


def lower_convex_hull(points: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The vertices of the lower convex hull of (x, y) points, by x ascending. Of (memory, time)
    points: the least mean time of a fractional mix whose mean memory is at most some amount."""
    hull: list[tuple[Any, Any]] = []
    for x, y in sorted(points):
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                  >= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append((x, y))
    return hull


def least_time(curve: Curve, n: int) -> float:
    """g(n): the least time n layers take on a rank (each on one strategy, the best choice of
    buffers) in its room; inf if they cannot fit. 0 for none."""
    if n <= 0:
        return 0.0
    return min((least_time_in(front, room, n) for room, front in curve), default=math.inf)


def least_time_in(front: list[tuple[int, float]], room: int, n: int) -> float:
    """Least time of n layers on the strategies of ``front`` in ``room`` bytes (inf: none fit).

    Exact (integer counts) while that takes at most :data:`EXACT_WORK` combinations, which covers
    the usual frontier (a style with and without recomputation, maybe two styles) on ranks
    whose memory holds only a few layers, where the fractional mix's bound is several percent
    lower (1T on 4096: rank 0 holds 4 blocks). Beyond that, the fractional mix: still a bound.
    """
    if n * front[0][0] > room:
        return math.inf
    if n * front[-1][0] <= room:
        return n * front[-1][1]
    if (n + 1) ** max(len(front) - 2, 0) <= EXACT_WORK:
        return _least_integer_time(front, room, n)
    hull, per_layer = lower_convex_hull(front), room / n
    for (m0, t0), (m1, t1) in zip(hull, hull[1:]):
        if per_layer < m1:
            return n * (t0 + (t1 - t0) * (per_layer - m0) / (m1 - m0))
    return n * hull[-1][1]


def _least_integer_time(front: list[tuple[int, float]], room: int, n: int) -> float:
    """:func:`least_time_in` by enumerating the counts of the middle strategies; with two left,
    the fastest takes as many layers as the room allows."""
    (m_small, t_small), (m_fast, t_fast) = front[0], front[-1]
    if n * m_small > room:
        return math.inf
    if len(front) == 1 or n * m_fast <= room:
        return n * t_fast
    if len(front) == 2:
        fast = min(n, (room - n * m_small) // (m_fast - m_small))
        return fast * t_fast + (n - fast) * t_small
    # x middle layers and the rest all on the fastest strategy take x·t_mid + (n − x)·t_fast at
    # least, which grows with x: past ``best`` (with room for rounding), no larger x can beat it
    if len(front) == 3:  # the usual frontier, with the two-strategy case inlined (bounds call it ~10⁵ times)
        (m_mid, t_mid), span = front[1], m_fast - m_small
        best = math.inf
        for x in range(n + 1):
            left, k = room - x * m_mid, n - x
            if left < k * m_small or x * t_mid + k * t_fast > best * _ROUNDING:
                break
            fast = k if k * m_fast <= left else min(k, (left - k * m_small) // span)
            best = min(best, x * t_mid + fast * t_fast + (k - fast) * t_small)
        return best
    (m_mid, t_mid), rest = front[1], [front[0], *front[2:]]
    best = math.inf
    for x in range(n + 1):
        left = room - x * m_mid
        if left < (n - x) * m_small or x * t_mid + (n - x) * t_fast > best * _ROUNDING:
            break  # each more middle layer takes more room than a small one saves
        best = min(best, x * t_mid + _least_integer_time(rest, left, n - x))
    return best


def nth_smallest(g: Any, ranks: int, n_layers: int) -> float:
    """The ``n_layers``-th smallest of g(j, n) over ranks j and n ≥ 1, each g(j, ·) growing with n:
    were T below it, the ranks together could not hold the layers. A heap merges the ranks."""
    heap = [(g(j, 1), j, 1) for j in range(ranks)]
    heapq.heapify(heap)
    value = 0.0
    for _ in range(n_layers):
        value, j, n = heapq.heappop(heap)
        if math.isinf(value):
            return math.inf
        heapq.heappush(heap, (g(j, n + 1), j, n + 1))
    return value


def floor_table(curve: Curve, size: int) -> list[int]:
    """floor[n]: the least time of n layers on a rank (:func:`least_time`), rounded down to
    model units, for n = 0 up to the most that fit (at most ``size``)."""
    floor = [0]
    for n in range(1, size + 1):
        least = least_time(curve, n)
        if math.isinf(least):
            break
        floor.append(max(0, math.floor(least - 1e-6)))
    return floor


def memory_lower_bound(table: PriceTable, allowed: list[list[int]]) -> float:
    """A lower bound on the least peak memory of a configuration, rank by rank.

    For each group of N alike layers, h_j(n), the least rank j can hold n of
    them in, is its workspace plus, for the best choice of FSDP2 buffers (none;
    reduce-scatter, allowing ZeRO-1/2; both, allowing ZeRO-3), the buffers and
    n times the layer's least memory under the strategies that choice allows.
    h_j grows with n and the ranks hold the N layers between them, so the peak
    is at least the N-th smallest of all h_j(n) (:func:`nth_smallest`); the
    largest over the groups is kept.
    """
    c = table.config
    modes = [(table.buffer_bytes(b), b.value) for b in Buffers]
    workspace = [table.rank_workspace_bytes(j) for j in range(c.mesh.pp)]
    best = 0.0
    for (i, _), members in layer_groups(table, allowed).items():
        per_rank = []  # per rank: (buffers, least memory of one layer) for each buffer choice
        for j in range(c.mesh.pp):
            choices = []
            for buffers, most in modes:
                fits = [table.memory_coefficient(i, k, j) for k in allowed[i]
                        if table.buffers_needed(i, k).value <= most]
                if fits:
                    choices.append((buffers, min(fits)))
            per_rank.append(choices)

        def least_held(j: int, n: int) -> float:
            return workspace[j] + min(buffers + n * least for buffers, least in per_rank[j])

        best = max(best, nth_smallest(least_held, c.mesh.pp, len(members)))
    return best
