"""The planner: choose mesh, microbatches, schedule and per-layer strategies.

Search, in two levels:

1. **Configurations** (:func:`enumerate_configs`): every mesh pp × dp × tp =
   world size (tp within a node unless pinned), microbatch count m dividing the
   per-replica batch, and schedule (GPipe only where 1F1B cannot run, since
   under this cost model 1F1B has GPipe's time and never more memory;
   interleaved 1F1B with 2 or 4 chunks per rank). Each configuration has a
   lower bound on its step time (fastest strategy per layer, perfectly
   balanced stages); configurations are solved in order of that bound and
   the search stops when the bound reaches the best plan found (branch and
   bound), so the answer is optimal over the whole space when every inner
   solve is. Before a configuration is solved, a bound with its memory terms
   (:func:`lower_bound_s`: a knapsack over all ranks' memory, and rank by rank
   with in-flight activations and FSDP2's buffers) may skip it.

2. **Per configuration, a CP-SAT model** (:func:`_build_model`) over runs of
   identical consecutive layers (a run r = layers [a_r, b_r), all pricing
   alike), S = pp·v virtual stages, strategies k of each run:

   Variables
     cut_c ∈ allowed cut positions, c = 1..S−1       stage c = layers [cut_c, cut_{c+1})
     cnt_{r,c} = |[a_r, b_r) ∩ [cut_c, cut_{c+1})|   layers of run r in stage c
     n_{r,c,k} ∈ [0, |r|],  Σ_k n_{r,c,k} = cnt_{r,c}  how many of them use strategy k
     T, X                                              critical rank time, tail

   Constraints (each group names the function that adds it)
     contiguity     cut_{c+1} ≥ cut_c + 1 and stage pins       (_add_cuts)
     counts         cnt via min/max of interval ends          (_add_counts)
     rank time      T ≥ Σ_{c on j} Σ n·t + p2p at j's cuts     (_add_rank_terms)
     tail           X ≥ Σ_{c on j} Σ n·(exposed dp comm + optimizer)
     memory         Σ n·mem_{r,k,j} + workspace_j + rs·u_j + ag·v_j ≤ budget   (memory_j)
                    u_j, v_j ∈ {0,1}: rank j has a ZeRO ≥ 1 / ZeRO-3 layer (FSDP2's buffers)
     rank floors    (redundant) time of a group of alike layers on j ≥ g_j(their count), the least
                    that many can take in j's own memory; T ≥ the bound they give  (_add_rank_floors)

   Objective (× den(w), to stay integral): minimise (m − w)·T + w·S + X with
   S = Σ_j t_j, i.e. step = m·T + w·(S − T) + X, the model of :mod:`autopar.planning.pricing`.
   Where ranks share cores: P + X, with P ≥ that critical path / σ and P ≥ each
   node's work term (:func:`_step_objective`).

Times become integers in one place (:class:`_Units`); memory is integral
bytes already. Runs with 1 worker and a deterministic time limit, so the same
inputs give the same plan.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ortools.sat.python import cp_model

from autopar.cost_models.hardware import ClusterSpec
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.errors import InfeasibleError, PinError
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.units import format_bytes
from autopar.planning.pricing import MeshConfig, PriceTable, Prediction, Strategy, TrainingSpec, evaluate

INTERLEAVED_CHUNKS = (2, 4)
TIME_RESOLUTION = 10**7  # the largest time coefficient of a configuration, in integer units


@dataclass(frozen=True)
class SolverOptions:
    """CP-SAT parameters, from one place."""

    time_limit_s: float = 30.0
    workers: int = 1
    seed: int = 0
    log: bool = False


@dataclass
class Solution:
    """The chosen assignment, its prediction, and how the search went."""

    config: MeshConfig
    stages: tuple[int, ...]
    strategies: tuple[Strategy, ...]
    prediction: Prediction
    table: PriceTable
    status: str
    gap: float
    wall_s: float
    configs_total: int
    configs_solved: int
    memory_budget_bytes: int


@dataclass
class _Search:
    best: tuple[float, MeshConfig, tuple, tuple, Prediction, PriceTable] | None = None
    open_bounds: list[float] = field(default_factory=list)
    solved: int = 0
    min_memory: tuple[int, MeshConfig] | None = None


# ---------------------------------------------------------------- configurations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cut_positions(graph: LayerGraph) -> list[int]:
    """Positions q (cut before layer q) where a pipeline may be cut."""
    return [i + 1 for i, layer in enumerate(graph.layers[:-1]) if layer.can_cut_after]


def enumerate_configs(graph: LayerGraph, world_size: int, cluster: ClusterSpec,
                      training: TrainingSpec, pins: Pins) -> list[MeshConfig]:
    """Every configuration the pins allow; raises PinError naming why none remain."""
    pins.check_form()
    pinned = [(k, getattr(pins, k)) for k in ("pp", "dp", "tp") if getattr(pins, k) is not None]
    product = math.prod(v for _, v in pinned)
    if world_size % product:
        names = " × ".join(f"{k}={v}" for k, v in pinned)
        total = f" = {product}" if len(pinned) > 1 else ""
        raise PinError(f"world size {world_size} is not a multiple of the pinned {names}{total}")
    if len(pinned) == 3 and product != world_size:
        raise PinError(f"pinned pp × dp × tp = {product} but the world size is {world_size}")
    max_stages = len(cut_positions(graph)) + 1
    configs: list[MeshConfig] = []
    for tp in [pins.tp] if pins.tp else [d for d in _divisors(world_size) if cluster.gpus_per_node % d == 0]:
        for pp in [pins.pp] if pins.pp else _divisors(world_size // tp):
            if (world_size // tp) % pp or pp > max_stages:
                continue
            dp = world_size // (tp * pp)
            if pins.dp not in (None, dp) or training.global_batch % dp:
                continue
            per_replica = training.global_batch // dp
            for m in [pins.microbatches] if pins.microbatches else _divisors(per_replica):
                if per_replica % m:
                    continue
                configs += [MeshConfig(pp, dp, tp, m, s) for s in _schedules(pp, m, max_stages, pins)]
    if not configs:
        raise PinError(_why_no_config(graph, world_size, training, pins, max_stages))
    return configs


def _schedules(pp: int, m: int, max_stages: int, pins: Pins) -> list[Schedule]:
    if pp == 1:
        return [Schedule(ScheduleKind.NONE)] if pins.schedule in (None, ScheduleKind.NONE) else []
    out: list[Schedule] = []
    want = pins.schedule
    if want is ScheduleKind.GPIPE or (want is None and m < pp):
        out.append(Schedule(ScheduleKind.GPIPE))
    if want in (None, ScheduleKind.ONE_F_ONE_B) and m >= pp and pins.chunks is None:
        out.append(Schedule(ScheduleKind.ONE_F_ONE_B))
    if want in (None, ScheduleKind.INTERLEAVED_1F1B) and m % pp == 0:
        for v in [pins.chunks] if pins.chunks else INTERLEAVED_CHUNKS:
            if pp * v <= max_stages:
                out.append(Schedule(ScheduleKind.INTERLEAVED_1F1B, v))
    return out


def _why_no_config(graph: LayerGraph, world: int, training: TrainingSpec, pins: Pins, max_stages: int) -> str:
    b = training.global_batch
    if pins.pp and pins.pp * (pins.chunks or 1) > max_stages:
        return (f"pp={pins.pp}{f' × chunks={pins.chunks}' if pins.chunks else ''} needs "
                f"{pins.pp * (pins.chunks or 1)} pipeline stages but the model can be cut into at "
                f"most {max_stages} (it has {max_stages - 1} places a cut may go)")
    if pins.dp and b % pins.dp:
        return f"batch size {b} does not divide over the pinned dp={pins.dp}"
    if pins.dp and pins.microbatches and b % (pins.dp * pins.microbatches):
        return (f"batch size {b} does not divide into the pinned dp={pins.dp} × "
                f"microbatches={pins.microbatches}")
    if pins.microbatches:
        return (f"batch size {b} cannot give microbatches={pins.microbatches} on any data-parallel "
                f"degree of world size {world} that the other pins allow")
    if pins.schedule or pins.chunks:
        return (f"no mesh for world size {world} and batch size {b} can run the pinned schedule "
                f"({pins.schedule.value if pins.schedule else 'interleaved_1f1b'}); interleaved "
                "1F1B needs microbatches divisible by pp")
    return (f"no mesh pp × dp × tp = {world} divides batch size {b} with the given pins; "
            "use a batch size divisible by the data-parallel degree")


# ---------------------------------------------------------------- per-layer choices


def _allowed(table: PriceTable, layer_pins: list[dict[str, Any]]) -> list[list[int]]:
    """Indices of each layer's strategies that satisfy its pins."""
    allowed = []
    memo: dict[tuple, list[int]] = {}
    classes = table.graph.cost_classes
    for i, (strategies, pin) in enumerate(zip(table.strategies, layer_pins)):
        key = (classes[i], tuple(sorted(pin.items())))
        if key in memo:
            allowed.append(memo[key])
            continue
        ks = [k for k, s in enumerate(strategies)
              if pin.get("tp", s.tp) == s.tp and pin.get("zero", s.zero) == s.zero
              and pin.get("recompute", s.recompute) == s.recompute]
        if not ks:  # a pinned choice outside the search space extends this layer's row only
            allowed.append(_pinned_outside_search(table, i, pin))
            continue
        memo[key] = _undominated(table, i, ks)
        allowed.append(memo[key])
    return allowed


def _undominated(table: PriceTable, i: int, ks: list[int]) -> list[int]:
    """Drop strategies another one beats or ties on every priced term (time, tail, memory,
    and the FSDP2 buffers its ZeRO stage makes the rank hold: none, reduce-scatter, + prefetch)."""

    def vector(k: int) -> tuple:
        p, zero = table.prices[i][k], table.strategies[i][k].zero
        return (p.time_mb_s, p.tail_s, p.state_bytes, p.activation_mb_bytes,
                (zero >= 1) + (zero == 3))

    vectors = {k: vector(k) for k in ks}

    def beaten(k: int) -> bool:
        for j in ks:
            if j == k:
                continue
            if all(a <= b for a, b in zip(vectors[j], vectors[k])) and (j < k or vectors[j] != vectors[k]):
                return True
        return False

    return [k for k in ks if not beaten(k)]


def _pinned_outside_search(table: PriceTable, i: int, pin: dict[str, Any]) -> list[int]:
    """A pinned choice the search space leaves out (e.g. zero>0 at dp=1): add it, or explain."""
    layer, tp = table.graph[i], table.config.tp
    style = pin.get("tp")
    if style is not None:
        names = [s.name for s in layer.tp_styles]
        if style not in names:
            raise PinError(f"layer {layer.name!r} has no tensor-parallel style {style!r} "
                           f"(it admits: {', '.join(names) or 'none'})")
        if not layer.tp_style(style).admits(tp):
            return []
    strategy = Strategy(style, pin.get("zero", 0), pin.get("recompute", False))
    table.strategies[i] = [*table.strategies[i], strategy]  # copies: the row is shared
    table.prices[i] = [*table.prices[i], table._price(layer, strategy)]
    return [len(table.strategies[i]) - 1]


def _runs(table: PriceTable, allowed: list[list[int]], layer_pins: list[dict]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive layers that price alike and are pinned alike."""
    def key(i: int) -> tuple:
        return (table.graph.cost_classes[i], tuple(allowed[i]), len(table.strategies[i]))

    runs: list[tuple[int, int]] = []
    for i in range(len(table.graph)):
        if runs and "stage" not in layer_pins[i] and "stage" not in layer_pins[runs[-1][0]] \
                and key(i) == key(runs[-1][0]):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def lower_bound_s(table: PriceTable, allowed: list[list[int]], budget: int | None = None,
                  cuts_ok: list[int] | None = None) -> float:
    """Step time no plan of this configuration can beat (``inf``: none fits in memory).

    Every rank's time is at least the average over ranks of the layers' summed
    times, and the layers together must fit in pp × (budget − workspace) bytes
    (each layer counted at its smallest in-flight multiplier). The best such
    sum is bounded by the Lagrangian dual of that knapsack, max over λ ≥ 0 of
    Σ_l min_k (t_lk + λ·mem_lk) − λ·capacity, found by bisection on λ. The
    slowest rank is also bounded rank by rank (:func:`_rank_time_bound_s`).
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
    if budget is not None:
        total = _knapsack_bound(table, allowed,
                                sum(budget - table.rank_workspace_bytes(j) for j in range(c.pp)))
        slowest = max(slowest, _rank_time_bound_s(table, allowed, budget, cuts_ok or []))
    if cuts_ok and c.stages > 1:
        thinnest = min(cuts_ok, key=lambda q: table.graph[q - 1].boundary_bytes_per_sample)
        total += 2 * (c.stages - 1) * table.p2p_s(thinnest)  # p2p time grows with bytes
    return _balanced_step_s(table, total, slowest)


def _balanced_step_s(table: PriceTable, total: float, slowest_layer: float) -> float:
    """The least step (:meth:`PriceTable.pipeline_s`) when S ≥ ``total`` and T ≥ S/pp, T ≥ any one
    layer (``slowest_layer`` may be any lower bound on T): a node's k ranks hold at least k/pp
    of S, so its work term is at least m·S/pp."""
    if math.isinf(total):  # w = 0 at pp = 1 must not turn "nothing fits" into nan
        return math.inf
    c, w = table.config, float(table.bubble_weight)
    chain = (c.microbatches - w) * max(total / c.pp, slowest_layer) + w * total
    sigma, _ = table.core_sharing
    return chain if sigma == 1 else max(chain / float(sigma), c.microbatches * total / c.pp)


def _knapsack_bound(table: PriceTable, allowed: list[list[int]], capacity: int) -> float:
    rank = min(range(table.config.pp), key=lambda j: table.in_flight[j])
    rows: dict[tuple, list[int]] = {}
    for i, ks in enumerate(allowed):
        rows.setdefault((table.graph.cost_classes[i], tuple(ks)), []).append(i)
    groups = [
        (tuple((table.prices[i][k].time_mb_s, table.memory_coefficient(i, k, rank)) for k in ks), len(members))
        for (_, ks), members in rows.items() for i in members[:1]
    ]

    def dual(lam: float) -> tuple[float, float]:
        value, used = -lam * capacity, 0.0
        for points, n in groups:
            t, mem = min(points, key=lambda p: (p[0] + lam * p[1], p[1]))
            value += n * (t + lam * mem)
            used += n * mem
        return value, used - capacity

    value, excess = dual(0.0)
    if excess <= 0:
        return value
    least = sum(n * min(p[1] for p in points) for points, n in groups)
    if least > capacity:
        return math.inf
    lo, hi = 0.0, 1e-15
    while dual(hi)[1] > 0:
        lo, hi = hi, hi * 4
    best = value
    for _ in range(60):
        mid = (lo + hi) / 2
        value, excess = dual(mid)
        best = max(best, value)
        lo, hi = (mid, hi) if excess > 0 else (lo, mid)
    return max(best, dual(hi)[0])


def _rank_time_bound_s(table: PriceTable, allowed: list[list[int]], budget: int,
                       cuts_ok: list[int]) -> float:
    """A lower bound on T, the slowest pipeline rank's time per microbatch, from each rank's
    own memory (its in-flight activations, workspace and FSDP2 buffers).

    The knapsack bound pools every rank's memory, so it lets the first rank of a 1F1B pipeline,
    which holds pp microbatches of activations, borrow the last rank's room; and it leaves out
    the buffers, which on a 1T model are as large as a rank's layers. Here, for each group of
    alike layers, g_j(n) is the least time rank j can hold n of them in (:func:`_rank_curves`);
    g_j grows with n, and the group's N layers are spread over the ranks, so T is at least the
    N-th smallest of all g_j(n), plus the least point-to-point time rank j's stage boundaries
    add. Other layers only add time and memory, so every group gives a bound; the largest is kept.
    """
    offsets = _rank_p2p_floor(table, cuts_ok)
    best = max(offsets, default=0.0)
    for (i, ks), members in _layer_groups(table, allowed).items():
        if min(table.prices[i][k].time_mb_s for k in ks) > 0:
            curves = _rank_curves(table, i, ks, budget, float)
            best = max(best, _nth_smallest(lambda j, n: offsets[j] + _least_time(curves[j], n),
                                           len(curves), len(members)))
    return best * (1 - 1e-9)  # sums in another order than evaluate's must not prune a tie


def _layer_groups(table: PriceTable, allowed: list[list[int]]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """Layers that price alike and allow the same strategies, keyed by (first layer, strategies)."""
    rows: dict[tuple, list[int]] = {}
    for i, ks in enumerate(allowed):
        rows.setdefault(_group_key(table, i, ks), []).append(i)
    return {(members[0], tuple(allowed[members[0]])): members for members in rows.values()}


def _group_key(table: PriceTable, i: int, ks: list[int]) -> tuple:
    """Layers alike for the rank bounds: one cost class and the same strategies (by value: a
    row extended for a pin may give another strategy the same index)."""
    return table.graph.cost_classes[i], tuple(table.strategies[i][k] for k in ks)


_Curve = list[tuple[int, list[tuple[int, float]]]]  # (room in bytes, strategy frontier) per buffer choice
EXACT_WORK = 4096  # most count combinations tried for one rank's least time (beyond: the LP's bound)


def _rank_curves(table: PriceTable, i: int, ks: list[int] | tuple[int, ...], budget: int,
                 time_of: Any) -> list[_Curve]:
    """Per pipeline rank, what :func:`_least_time` needs for layer ``i``'s strategies ``ks``:
    for each choice of FSDP2 buffers the rank holds (none, reduce-scatter, both), the room
    left after workspace and buffers, and the (memory, time) frontier of the strategies that choice allows.
    ``time_of`` maps seconds to the unit of the result (the model's integer units, or none)."""
    c = table.config
    buffers = [table.zero_buffer_bytes(z) for z in ({0}, {1}, {3})]
    need = [(table.strategies[i][k].zero >= 1) + (table.strategies[i][k].zero == 3) for k in ks]
    curves = []
    for j in range(c.pp):
        room = budget - table.rank_workspace_bytes(j)
        curve = []
        for mode, buffer in enumerate(buffers):
            points = [(table.memory_coefficient(i, k, j), time_of(table.prices[i][k].time_mb_s))
                      for k, q in zip(ks, need) if q <= mode]
            if points and room - buffer >= 0:
                curve.append((room - buffer, _frontier(points)))
        curves.append(curve)
    return curves


def _rank_p2p_floor(table: PriceTable, cuts_ok: list[int], time_of: Any = float) -> list[float]:
    """Per pipeline rank, the least time its stages' boundaries add (each cut: one send, charged
    to the ranks on both sides), at the thinnest cut allowed."""
    c = table.config
    floor = [0.0] * c.pp
    if c.stages <= 1 or not cuts_ok:
        return floor
    thinnest = min(time_of(table.p2p_s(q)) for q in cuts_ok)
    for s in range(1, c.stages):
        floor[c.rank_of_stage(s - 1)] += thinnest
        floor[c.rank_of_stage(s)] += thinnest
    return floor


def _frontier(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The (memory, time) points no other beats on both, by memory ascending (time descending)."""
    front: list[tuple[int, float]] = []
    for m, t in sorted(points):
        if not front or t < front[-1][1]:
            front.append((m, t))
    return front


def _lower_convex_hull(points: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The vertices of the lower convex hull of (x, y) points, by x ascending. Of (memory, time)
    points: the least mean time of a fractional mix whose mean memory is at most some amount."""
    hull: list[tuple[Any, Any]] = []
    for x, y in sorted(points):
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                  >= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append((x, y))
    return hull


def _least_time(curve: _Curve, n: int) -> float:
    """g(n): the least time n layers take on a rank (each on one strategy, the best choice of
    buffers) in its room; inf if they cannot fit. 0 for none."""
    if n <= 0:
        return 0.0
    return min((_least_time_in(front, room, n) for room, front in curve), default=math.inf)


def _least_time_in(front: list[tuple[int, float]], room: int, n: int) -> float:
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
    hull, per_layer = _lower_convex_hull(front), room / n
    for (m0, t0), (m1, t1) in zip(hull, hull[1:]):
        if per_layer < m1:
            return n * (t0 + (t1 - t0) * (per_layer - m0) / (m1 - m0))
    return n * hull[-1][1]


def _least_integer_time(front: list[tuple[int, float]], room: int, n: int) -> float:
    """:func:`_least_time_in` by enumerating the counts of the middle strategies; with two left,
    the fastest takes as many layers as the room allows."""
    (m_small, t_small), (m_fast, t_fast) = front[0], front[-1]
    if n * m_small > room:
        return math.inf
    if len(front) == 1 or n * m_fast <= room:
        return n * t_fast
    if len(front) == 2:
        fast = min(n, (room - n * m_small) // (m_fast - m_small))
        return fast * t_fast + (n - fast) * t_small
    (m_mid, t_mid), rest = front[1], [front[0], *front[2:]]
    best = math.inf
    for x in range(n + 1):
        left = room - x * m_mid
        if left < (n - x) * m_small:
            break  # each more middle layer takes more room than a small one saves
        best = min(best, x * t_mid + _least_integer_time(rest, left, n - x))
    return best


def _nth_smallest(g: Any, ranks: int, n_layers: int) -> float:
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


# ---------------------------------------------------------------- CP-SAT model


class _Units:
    """Seconds → integer units: the largest coefficient becomes TIME_RESOLUTION."""

    def __init__(self, largest_s: float):
        self.unit_s = max(largest_s, 1e-12) / TIME_RESOLUTION

    def __call__(self, seconds: float) -> int:
        return int(round(seconds / self.unit_s))


@dataclass
class _Model:
    model: cp_model.CpModel
    cuts: list[Any]
    counts: dict[tuple[int, int, int], Any]
    objective: Any
    peak_memory: Any | None
    scale: int  # objective = scale × step time in units


def _build_model(table: PriceTable, allowed: list[list[int]], runs: list[tuple[int, int]],
                 layer_pins: list[dict], cuts_ok: list[int], budget: int | None,
                 units: _Units) -> _Model:
    """The CP-SAT model of one configuration (budget None: minimise peak memory instead)."""
    model = cp_model.CpModel()
    c = table.config
    cuts = _add_cuts(model, table, layer_pins, cuts_ok)
    counts = _add_counts(model, runs, allowed, cuts, c)
    peak = None
    obj_t, rank_t, obj_x, memory = _add_rank_terms(model, table, allowed, runs, cuts, counts, units)
    objective, scale = None, 1
    if budget is not None and c.pp > 1:  # one rank: its memory constraint says as much, and faster
        model.Add(obj_t >= _add_rank_floors(model, table, allowed, runs, counts, budget, cuts_ok, units))
    if budget is None:
        peak = model.NewIntVar(0, 2**60, "peak_memory")
        for j, mem in enumerate(memory):
            model.Add(peak >= mem).WithName(f"peak_memory_{j}")
        model.Minimize(peak)
    else:
        for j, mem in enumerate(memory):
            model.Add(mem <= budget).WithName(f"memory_{j}")
        objective, scale = _step_objective(model, table, obj_t, rank_t, obj_x)
        model.Minimize(objective)
    _hint(model, table, cuts, cuts_ok)
    return _Model(model, cuts, counts, objective, peak, scale)


def _step_objective(model: cp_model.CpModel, table: PriceTable, T: Any, rank_t: list[Any],
                    X: Any) -> tuple[Any, int]:
    """The step of :meth:`PriceTable.pipeline_s` plus the tail X, times ``scale`` to stay integral.

    Without core sharing it is linear: (m − w)·T + w·S + X. With it, a
    variable P ≥ the critical path / σ and P ≥ each node's work term stands
    for the max, and the objective is P + X.
    """
    m, w = table.config.microbatches, table.bubble_weight
    S = sum(rank_t)
    sigma, k = table.core_sharing
    if sigma == 1:
        return (m * w.denominator - w.numerator) * T + w.numerator * S + w.denominator * X, w.denominator
    c_t, c_s, c_work = (m - w) / sigma, w / sigma, Fraction(m, k)
    scale = math.lcm(c_t.denominator, c_s.denominator, c_work.denominator)
    P = model.NewIntVar(0, 2**55, "pipeline")
    model.Add(P >= int(c_t * scale) * T + int(c_s * scale) * S).WithName("pipeline_critical_path")
    for g in range(0, len(rank_t), k):
        model.Add(P >= int(c_work * scale) * sum(rank_t[g:g + k])).WithName(f"pipeline_node_work_{g // k}")
    return P + scale * X, scale


def _add_cuts(model: cp_model.CpModel, table: PriceTable, layer_pins: list[dict],
              cuts_ok: list[int]) -> list[Any]:
    """cut_0 = 0 < cut_1 < … < cut_S = L, cuts only where allowed, stage pins respected."""
    n_layers, stages = len(table.graph), table.config.stages
    domain = cp_model.Domain.FromValues(cuts_ok) if cuts_ok else cp_model.Domain(0, 0)
    cuts: list[Any] = [0]
    for s in range(1, stages):
        cuts.append(model.NewIntVarFromDomain(domain, f"cut_{s}"))
    cuts.append(n_layers)
    for s in range(1, stages):
        model.Add(cuts[s + 1] >= cuts[s] + 1).WithName(f"contiguity_{s}")
    for i, pin in enumerate(layer_pins):
        if "stage" in pin:
            s = pin["stage"]
            if s >= stages:
                model.AddBoolOr([]).WithName(f"stage_pin_{i}")  # infeasible by construction
                continue
            model.Add(cuts[s] <= i).WithName(f"stage_pin_{i}_lo")
            model.Add(cuts[s + 1] >= i + 1).WithName(f"stage_pin_{i}_hi")
    return cuts


def _add_counts(model: cp_model.CpModel, runs: list[tuple[int, int]], allowed: list[list[int]],
                cuts: list[Any], config: MeshConfig) -> dict[tuple[int, int, int], Any]:
    """n_{r,j,k}: layers of run r on pipeline rank j using strategy k.

    Costs depend only on what each rank holds, so strategies are counted per
    rank, not per stage: stages of one rank are interchangeable, and counting
    per stage would hand CP-SAT symmetric copies of every solution.
    """
    n_layers, stages = cuts[-1], config.stages
    held: dict[tuple[int, int], list[Any]] = {}
    in_stage: dict[int, list[Any]] = {c: [] for c in range(stages)}
    for r, (a, b) in enumerate(runs):
        for c in range(stages):
            # stage c can only hold layers c .. L-S+c (every stage holds at least one)
            if b <= c or a > n_layers - stages + c:
                continue
            if stages == 1:
                cnt: Any = b - a
            else:
                lo = model.NewIntVar(0, n_layers, f"lo_{r}_{c}")
                hi = model.NewIntVar(0, n_layers, f"hi_{r}_{c}")
                model.AddMaxEquality(lo, [a, cuts[c]])
                model.AddMinEquality(hi, [b, cuts[c + 1]])
                cnt = model.NewIntVar(0, b - a, f"layers_{r}_{c}")
                model.AddMaxEquality(cnt, [hi - lo, 0])
            held.setdefault((r, config.rank_of_stage(c)), []).append(cnt)
            in_stage[c].append(cnt)
    # Redundant but tightening: every stage holds exactly its interval.
    for c, cnts in in_stage.items():
        model.Add(sum(cnts) == cuts[c + 1] - cuts[c]).WithName(f"stage_size_{c}")
    counts: dict[tuple[int, int, int], Any] = {}
    for (r, j), cnts in held.items():
        a, b = runs[r]
        vs = [model.NewIntVar(0, b - a, f"n_{r}_{j}_{k}") for k in allowed[a]]
        model.Add(sum(vs) == sum(cnts)).WithName(f"strategy_count_{r}_{j}")
        counts.update({(r, j, k): v for k, v in zip(allowed[a], vs)})
    for r, (a, b) in enumerate(runs):
        model.Add(sum(v for (rr, _, _), v in counts.items() if rr == r) == b - a).WithName(f"run_total_{r}")
    return counts


def _add_rank_terms(model, table, allowed, runs, cuts, counts, units):
    """T ≥ every pipeline rank's time t_j, tail X ≥ x_j; the t_j and each rank's memory expression."""
    c = table.config
    p2p_table = [units(table.p2p_s(q)) for q in range(len(table.graph) + 1)]
    sends: dict[int, Any] = {}
    for s in range(1, c.stages):
        v = model.NewIntVar(0, max(p2p_table), f"p2p_{s}")
        model.AddElement(cuts[s], p2p_table, v)
        sends[s] = v
    big = sum(units(max(p.time_mb_s for p in ps)) for ps in table.prices) + 2 * sum(p2p_table) + 1
    T = model.NewIntVar(0, big, "rank_time")
    X = model.NewIntVar(0, 2**50, "tail")
    memory, rank_t = [], []
    for j in range(c.pp):
        t_terms, x_terms, m_terms = [], [], []
        for (r, jj, k), var in counts.items():
            if jj != j:
                continue
            a = runs[r][0]
            price = table.prices[a][k]
            t_terms.append(units(price.time_mb_s) * var)
            x_terms.append(units(price.tail_s) * var)
            m_terms.append(table.memory_coefficient(a, k, j) * var)
        for s in range(1, c.stages):
            if c.rank_of_stage(s - 1) == j:
                t_terms.append(sends[s])
            if c.rank_of_stage(s) == j:
                t_terms.append(sends[s])
        model.Add(T >= sum(t_terms)).WithName(f"rank_time_{j}")
        rank_t.append(sum(t_terms))
        model.Add(X >= sum(x_terms)).WithName(f"tail_{j}")
        memory.append(sum(m_terms) + table.rank_workspace_bytes(j)
                      + _zero_buffers(model, table, runs, counts, j))
    return T, rank_t, X, memory


def _add_rank_floors(model: cp_model.CpModel, table: PriceTable, allowed: list[list[int]],
                     runs: list[tuple[int, int]], counts: dict[tuple[int, int, int], Any],
                     budget: int, cuts_ok: list[int], units: _Units) -> int:
    """Redundant: the layers of one alike group on rank j take at least g_j(how many there are),
    the least time that many can take in the rank's own memory (:func:`_rank_curves`); and the
    slowest rank at least what :func:`_rank_time_bound_s` finds from them, which is returned.

    The LP relaxation spreads a rank's FSDP2 buffer booleans thin (a rank using ZeRO on a few of
    a run's layers pays a few run-lengths' share of the buffer), so without this it lets the
    first ranks of a deep pipeline skip recomputation their memory cannot; the bound then
    stalls far below the best plan and the search cannot close the gap.
    """
    offsets = _rank_p2p_floor(table, cuts_ok, units)
    slowest = 0
    by_group: dict[tuple, list[int]] = {}
    for r, (a, _) in enumerate(runs):
        by_group.setdefault(_group_key(table, a, allowed[a]), []).append(r)
    for members in by_group.values():
        first = runs[members[0]][0]
        ks = allowed[first]
        size = sum(runs[r][1] - runs[r][0] for r in members)
        if size < 2 or min(units(table.prices[first][k].time_mb_s) for k in ks) <= 0:
            continue
        curves = _rank_curves(table, first, ks, budget, units)
        floors = [_floor_table(curve, size) for curve in curves]
        slowest = max(slowest, _nth_smallest(
            lambda j, n: offsets[j] + (floors[j][n] if n < len(floors[j]) else math.inf), len(curves), size))
        for j, floor in enumerate(floors):
            held = [(units(table.prices[first][k].time_mb_s), v) for (r, jj, k), v in counts.items()
                    if jj == j and r in members]
            if not held:
                continue
            count = model.NewIntVar(0, len(floor) - 1, f"group_{first}_count_{j}")
            model.Add(count == sum(v for _, v in held))
            least = model.NewIntVar(0, floor[-1], f"group_{first}_floor_{j}")
            model.AddElement(count, floor, least)
            time_j = sum(t * v for t, v in held)
            model.Add(time_j >= least).WithName(f"group_{first}_time_{j}")
            for (n0, f0), (n1, f1) in zip(hull := _lower_convex_hull(list(enumerate(floor))), hull[1:]):
                # the LP sees the element only through these: time ≥ the chord through (n0, f0), (n1, f1)
                model.Add((n1 - n0) * time_j >= (f1 - f0) * count + f0 * n1 - f1 * n0)
    return int(slowest) if not math.isinf(slowest) else 0


def _floor_table(curve: _Curve, size: int) -> list[int]:
    """floor[n]: the least time of n layers on a rank (:func:`_least_time`), rounded down to
    model units, for n = 0 up to the most that fit (at most ``size``)."""
    floor = [0]
    for n in range(1, size + 1):
        least = _least_time(curve, n)
        if math.isinf(least):
            break
        floor.append(max(0, math.floor(least - 1e-6)))
    return floor


def _zero_buffers(model: cp_model.CpModel, table: PriceTable, runs: list[tuple[int, int]],
                  counts: dict[tuple[int, int, int], Any], j: int) -> Any:
    """FSDP2's reduce-scatter and prefetch buffers on rank j, each held once if any layer there
    needs it: a boolean per buffer, forced on by the count of every strategy that needs it."""
    terms: list[Any] = []
    for name, size, needs in (("rs", table.reduce_scatter_buffer_bytes, lambda z: z >= 1),
                              ("ag", table.prefetch_buffer_bytes, lambda z: z == 3)):
        users = [(var, runs[r][1] - runs[r][0]) for (r, jj, k), var in counts.items()
                 if jj == j and needs(table.strategies[runs[r][0]][k].zero)]
        if size <= 0 or not users:
            continue
        held = model.NewBoolVar(f"{name}_buffer_{j}")
        for var, most in users:
            model.Add(var <= most * held)
        terms.append(size * held)
    return sum(terms)


def _hint(model: cp_model.CpModel, table: PriceTable, cuts: list[Any], cuts_ok: list[int]) -> None:
    """Start the search from evenly spaced cuts."""
    stages = table.config.stages
    if stages > 1 and len(cuts_ok) >= stages - 1:
        picks = [cuts_ok[round(i * (len(cuts_ok) - 1) / max(stages - 2, 1))] for i in range(stages - 1)]
        if len(set(picks)) == stages - 1:
            for s, q in enumerate(picks, start=1):
                model.AddHint(cuts[s], q)


def _extract(solver: cp_model.CpSolver, built: _Model, table: PriceTable,
             runs: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[Strategy, ...]]:
    cuts = [solver.Value(x) if not isinstance(x, int) else x for x in built.cuts]
    stages = [0] * len(table.graph)
    for s in range(len(cuts) - 1):
        for i in range(cuts[s], cuts[s + 1]):
            stages[i] = s
    strategies: list[Strategy | None] = [None] * len(table.graph)
    for (r, j, k) in sorted(built.counts):
        a, b = runs[r]
        layers = [i for i in range(a, b) if strategies[i] is None
                  and table.config.rank_of_stage(stages[i]) == j]
        for i in layers[:solver.Value(built.counts[(r, j, k)])]:
            strategies[i] = table.strategies[a][k]
    return tuple(stages), tuple(strategies)  # type: ignore[arg-type]


# ---------------------------------------------------------------- search


def solve(graph: LayerGraph, world_size: int, cluster: ClusterSpec, training: TrainingSpec, *,
          pins: Pins | None = None, memory_budget_bytes: int | None = None,
          options: SolverOptions | None = None) -> Solution:
    """The fastest plan under the memory budget, by branch and bound over configurations."""
    start = time.perf_counter()
    options = options or SolverOptions()
    pins = pins or Pins()
    budget = cluster.memory_budget_bytes if memory_budget_bytes is None else memory_budget_bytes
    layer_pins = pins.resolve_layers([layer.name for layer in graph])
    cuts_ok = cut_positions(graph)
    # Configurations in order of a cheap bound (fastest strategy per layer, balanced),
    # priced in full only when that bound could still beat the best plan so far.
    candidates = []
    for config in enumerate_configs(graph, world_size, cluster, training, pins):
        table = PriceTable(graph, config, cluster, training)
        fastest = table.fastest_time_mb_s()
        cheap = _balanced_step_s(table, sum(fastest), max(fastest))
        candidates.append((cheap, config, table))
    candidates.sort(key=lambda x: (x[0], x[1]))
    search, priced = _Search(), []
    for index, (cheap, config, table) in enumerate(candidates):
        if search.best is not None and cheap >= search.best[0]:
            break
        remaining = options.time_limit_s - (time.perf_counter() - start)
        if remaining <= 0:
            search.open_bounds += [b for b, *_ in candidates[index:]]
            break
        allowed = _allowed(table, layer_pins)
        if any(not ks for ks in allowed):
            continue
        priced.append((cheap, config, table, allowed))
        bound = lower_bound_s(table, allowed, budget, cuts_ok)
        if math.isinf(bound) or (search.best is not None and bound >= search.best[0]):
            continue
        _solve_config(search, table, allowed, layer_pins, cuts_ok, budget, remaining, options)
    wall = time.perf_counter() - start
    if search.best is None:
        if not priced:
            raise PinError("no tensor-parallel degree the pins allow is admitted by the pinned layer styles")
        _raise_infeasible(priced, layer_pins, cuts_ok, budget, options)
    step, config, stages, strategies, prediction, table = search.best
    bound = min([step] + search.open_bounds)
    gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
    return Solution(config, stages, strategies, prediction, table,
                    "OPTIMAL" if gap <= 1e-9 else "FEASIBLE", gap, wall,
                    len(candidates), search.solved, budget)


def _solver(time_limit_s: float, options: SolverOptions) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = options.workers
    solver.parameters.random_seed = options.seed
    solver.parameters.max_deterministic_time = max(time_limit_s, 0.05)
    solver.parameters.max_time_in_seconds = max(3 * time_limit_s, 0.1)
    solver.parameters.log_search_progress = options.log
    return solver


def _solve_config(search: _Search, table: PriceTable, allowed, layer_pins, cuts_ok, budget,
                  time_limit_s: float, options: SolverOptions) -> None:
    runs = _runs(table, allowed, layer_pins)
    largest = max(max(p.time_mb_s, p.tail_s) for ps in table.prices for p in ps)
    units = _Units(max(largest, max(table.p2p_s(q) for q in range(len(table.graph) + 1))))
    built = _build_model(table, allowed, runs, layer_pins, cuts_ok, budget, units)
    if search.best is not None:  # prune: only plans that can beat the best so far (with rounding slack)
        d = built.scale
        slack = 4 * (len(table.graph) + table.config.stages) * (table.config.microbatches * d + table.config.pp)
        built.model.Add(built.objective <= int(search.best[0] * d / units.unit_s) + slack)
    solver = _solver(time_limit_s, options)
    status = solver.Solve(built.model)
    search.solved += 1
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.UNKNOWN:
            search.open_bounds.append(lower_bound_s(table, allowed, budget, cuts_ok))
        return
    stages, strategies = _extract(solver, built, table, runs)
    prediction = evaluate(table, stages, strategies)
    if status == cp_model.FEASIBLE:
        search.open_bounds.append(solver.BestObjectiveBound() * units.unit_s / built.scale)
    if search.best is None or prediction.step_time_s < search.best[0]:
        search.best = (prediction.step_time_s, table.config, stages, strategies, prediction, table)


def _raise_infeasible(candidates, layer_pins, cuts_ok, budget: int, options: SolverOptions) -> None:
    """No configuration fits: find the least memory any plan needs and say so.

    Branch and bound again, on memory: configurations in order of a lower bound
    on their peak memory, each solved for its least peak, until the bound
    reaches the least found (or the time limit ends the search).
    """
    start = time.perf_counter()
    best: tuple[int, MeshConfig] | None = None
    by_memory = sorted(((_memory_lower_bound(x[2], x[3]), x) for x in candidates), key=lambda y: y[0])
    for bound, (_, config, table, allowed) in by_memory:
        remaining = options.time_limit_s - (time.perf_counter() - start)
        if (best is not None and bound >= best[0]) or remaining <= 0:
            break
        runs = _runs(table, allowed, layer_pins)
        built = _build_model(table, allowed, runs, layer_pins, cuts_ok, None, _Units(1.0))
        solver = _solver(remaining, options)
        if solver.Solve(built.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            need = int(solver.ObjectiveValue())
            if best is None or need < best[0]:
                best = (need, config)
    if best is None:
        raise InfeasibleError("no plan satisfies the pins (stage pins and pipeline cuts conflict)",
                              binding="pins")
    need, config = best
    raise InfeasibleError(
        f"no plan fits in memory: needs {format_bytes(need)} per rank at best "
        f"({config.describe()}), budget {format_bytes(budget)}; use more devices, a smaller "
        f"batch, or more memory (--memory-gb)",
        binding="memory", min_memory_bytes=need,
    )


def _memory_lower_bound(table: PriceTable, allowed: list[list[int]]) -> float:
    """A lower bound on the least peak memory of a configuration, rank by rank.

    For each group of N alike layers, h_j(n), the least rank j can hold n of
    them in, is its workspace plus, for the best choice of FSDP2 buffers (none;
    reduce-scatter, allowing ZeRO-1/2; both, allowing ZeRO-3), the buffers and
    n times the layer's least memory under the strategies that choice allows.
    h_j grows with n and the ranks hold the N layers between them, so the peak
    is at least the N-th smallest of all h_j(n) (:func:`_nth_smallest`); the
    largest over the groups is kept.
    """
    c = table.config
    modes = [(table.zero_buffer_bytes(zeros), most) for zeros, most in (({0}, 0), ({1}, 2), ({3}, 3))]
    workspace = [table.rank_workspace_bytes(j) for j in range(c.pp)]
    best = 0.0
    for (i, _), members in _layer_groups(table, allowed).items():
        per_rank = []  # per rank: (buffers, least memory of one layer) for each buffer choice
        for j in range(c.pp):
            choices = []
            for buffers, most in modes:
                fits = [table.memory_coefficient(i, k, j) for k in allowed[i] if table.strategies[i][k].zero <= most]
                if fits:
                    choices.append((buffers, min(fits)))
            per_rank.append(choices)

        def least_held(j: int, n: int) -> float:
            return workspace[j] + min(buffers + n * least for buffers, least in per_rank[j])

        best = max(best, _nth_smallest(least_held, c.pp, len(members)))
    return best
