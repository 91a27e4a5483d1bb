"""The CP-SAT model of one configuration, in phases: cuts, counts, rank terms, bounds, objective.

See :mod:`autopar.planning.solver` for the mathematical model; each
constraint group is added by the function its docstring names. Times become
integers in one place (:class:`Units`); memory is integral bytes already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ortools.sat.python import cp_model

from autopar import contract
from autopar.choice import LayerChoice
from autopar.contract import Buffers
from autopar.planning import edges
from autopar.planning.bounds import (
    floor_table,
    group_key,
    lower_convex_hull,
    nth_smallest,
    rank_curves,
    rank_p2p_floor,
)
from autopar.planning.configuration import Configuration
from autopar.planning.pricing import PriceTable

TIME_RESOLUTION = 10**7  # the largest time coefficient of a configuration, in integer units


@dataclass(frozen=True)
class SolverOptions:
    """CP-SAT parameters, from one place."""

    time_limit_s: float = 30.0
    workers: int = 1
    seed: int = 0
    log: bool = False
    # LP cuts at every search node, not only at the root: with three recompute kinds a hard
    # configuration's plans trade time against memory rank by rank, and CP-SAT's default (1) spent
    # 20 of its 25 s on GPT-1T × 4,096 finding what its bound nearly proved (FEASIBLE at the 30 s
    # limit there, OPTIMAL in 25 s with 2; GPT-3 175B and GPT-1T × 512 unchanged)
    linearization_level: int = 2
    # No probing in presolve: each configuration's model is small (hundreds of variables) and solved
    # once, and CP-SAT's probing took most of its presolve — about half of every refutation's
    # wall time. Measured on the plain GPT-3 175B × 1,024 plan: 6.6 → 5.4 s of solving, and GPT-1T ×
    # 4,096: 25 → 18 s, the same plans, OPTIMAL (benchmarks/plan_time.py).
    probing_level: int = 0
    # One configuration's CP-SAT solve runs in a thread while the next one is priced, bounded and built
    # (planning/solves.py ``InFlight``); the search decides as the sequential one does. False: sequential.
    overlap: bool = True
    # CP-SAT deterministic seconds of a configuration's first solve on the way to the chosen plan: one that
    # runs out is solved again once the search has better plans to hold it to (solves.solve_deferred)
    first_solve_s: float = 0.5
    # Probing where a configuration is solved again: those are the hard models, and there it pays. The proof
    # that DeepSeek-V3 × 1,024's pp=8 × ep=8 plan is best: 3.46 deterministic seconds without, 0.62 at level 1
    # (2.82 at CP-SAT's default, 2)
    again_probing_level: int = 1
    # CP-SAT's inclusion detection in presolve. OR-Tools 9.15.6755's presolve refutes some feasible models
    # (google/or-tools#5274, fixed after that release): one of ours, with no compute, was "INFEASIBLE" under a
    # budget its own least-memory plan fits, and solves without it. Off everywhere, DeepSeek-V3 × 1,024's
    # search took 22.9 s instead of 17.2, so it is turned off only where a search finds no plan although one
    # fits (solver.solve searches again).
    presolve_inclusion: bool = True


class Units:
    """Seconds → integer units: the largest coefficient becomes TIME_RESOLUTION."""

    def __init__(self, largest_s: float):
        self.unit_s = max(largest_s, 1e-12) / TIME_RESOLUTION

    def __call__(self, seconds: float) -> int:
        return int(round(seconds / self.unit_s))


@dataclass
class BuiltModel:
    model: cp_model.CpModel
    cuts: list[Any]
    counts: dict[tuple[int, int, int], Any]
    objective: Any
    peak_memory: Any | None
    scale: int  # objective = scale × step time in units


def build_model(table: PriceTable, allowed: list[list[int]], runs: list[tuple[int, int]],
                 layer_pins: list[dict], cuts_ok: list[int], budget: int | None,
                 units: Units) -> BuiltModel:
    """The CP-SAT model of one configuration (budget None: minimise peak memory instead)."""
    model = cp_model.CpModel()
    c = table.config
    cuts = _add_cuts(model, table, layer_pins, cuts_ok)
    counts = _add_counts(model, runs, allowed, cuts, c)
    peak = None
    obj_t, rank_t, obj_x, memory = _add_rank_terms(model, table, allowed, runs, cuts, counts, units)
    objective, scale = None, 1
    if budget is not None and c.mesh.pp > 1:  # one rank: its memory constraint says as much, and faster
        model.Add(obj_t >= add_rank_floors(model, table, allowed, runs, counts, budget, cuts_ok, units))
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
    _add_sharded_plan(model, table, runs, counts)
    _add_root_stage(model, table, runs, counts)
    _hint(model, table, cuts, cuts_ok)
    return BuiltModel(model, cuts, counts, objective, peak, scale)


def _add_sharded_plan(model: cp_model.CpModel, table: PriceTable, runs: list[tuple[int, int]],
                      counts: dict[tuple[int, int, int], Any]) -> None:
    """A sharded configuration's plan shards some layer (else it lowers as a replicated plan):
    implied by the root units' ZeRO stage where a root unit holds parameters."""
    c = table.config
    if not c.data_parallel.sharded or contract.wrapping(table.graph, c.mesh.pp).root_params:
        return
    sharded = [v for (r, _, k), v in counts.items() if table.choices[runs[r][0]][k].zero >= 1
               and table.graph[runs[r][0]].param_count]
    model.Add(sum(sharded) >= 1).WithName("sharded_plan_shards_a_layer")


def _add_root_stage(model: cp_model.CpModel, table: PriceTable, runs: list[tuple[int, int]],
                    counts: dict[tuple[int, int, int], Any]) -> None:
    """Where a sharded configuration leaves the root units' ZeRO stage to the solver, every
    root-unit layer takes the one stage z whose flag r_z is set (the contract: one stage for
    every root unit): n_{r,j,k} ≤ |r|·r_{zero(k)} for root runs, Σ_z r_z = 1."""
    c = table.config
    if not c.data_parallel.sharded or c.data_parallel.root_zero:
        return
    root = contract.wrapping(table.graph, c.mesh.pp).root
    users: dict[int, list[tuple[Any, int]]] = {}
    for (r, _, k), var in counts.items():
        a, b = runs[r]
        if root[a]:
            users.setdefault(table.choices[a][k].zero, []).append((var, b - a))
    if not users:
        return
    flags = {z: model.NewBoolVar(f"root_zero_{z}") for z in sorted(users)}
    model.AddExactlyOne(flags.values()).WithName("root_stage")
    for z, held in users.items():
        for var, most in held:
            model.Add(var <= most * flags[z])


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
                cuts: list[Any], config: Configuration) -> dict[tuple[int, int, int], Any]:
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
    p2p_tables = {s: [units(table.p2p_s(q, s)) for q in range(len(table.graph) + 1)] for s in range(1, c.stages)}
    sends: dict[int, Any] = {}
    for s, p2p_table in p2p_tables.items():  # a boundary between nodes sends over the NICs
        v = model.NewIntVar(0, max(p2p_table), f"p2p_{s}")
        model.AddElement(cuts[s], p2p_table, v)
        sends[s] = v
    dearest = [max(col) for col in zip(*p2p_tables.values())] if p2p_tables else [0]
    regions = sum(units(c.schedule.chunks * max(table.sequence_region_s(i, k) for k in range(len(ps))))
                  for i, ps in enumerate(table.prices))
    big = sum(units(max(p.time_mb_s for p in ps)) for ps in table.prices) + 2 * sum(dearest) + regions + 1
    T = model.NewIntVar(0, big, "rank_time")
    X = model.NewIntVar(0, 2**50, "tail")
    memory, rank_t = [], []
    edge = _edge_exposure(model, table, runs, counts, units)
    for j in range(c.mesh.pp):
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
        t_terms += _sequence_regions(model, table, runs, counts, j, units)
        model.Add(T >= sum(t_terms)).WithName(f"rank_time_{j}")
        rank_t.append(sum(t_terms))
        model.Add(X >= sum(x_terms) + edge).WithName(f"tail_{j}")
        memory.append(sum(m_terms) + table.rank_workspace_bytes(j)
                      + _zero_buffers(model, table, runs, counts, j))
    return T, rank_t, X, memory


def add_rank_floors(model: cp_model.CpModel, table: PriceTable, allowed: list[list[int]],
                     runs: list[tuple[int, int]], counts: dict[tuple[int, int, int], Any],
                     budget: int, cuts_ok: list[int], units: Units) -> int:
    """Redundant: the layers of one alike group on rank j take at least g_j(how many there are),
    the least time that many can take in the rank's own memory (:func:`rank_curves`); and the
    slowest rank at least what :func:`_rank_time_bound_s` finds from them, which is returned.

    The LP relaxation spreads a rank's FSDP2 buffer booleans thin (a rank using ZeRO on a few of
    a run's layers pays a few run-lengths' share of the buffer), so without this it lets the
    first ranks of a deep pipeline skip recomputation their memory cannot; the bound then
    stalls far below the best plan and the search cannot close the gap.
    """
    offsets = rank_p2p_floor(table, cuts_ok, units)
    slowest = 0
    by_group: dict[tuple, list[int]] = {}
    for r, (a, _) in enumerate(runs):
        by_group.setdefault(group_key(table, a, allowed[a]), []).append(r)
    for members in by_group.values():
        first = runs[members[0]][0]
        ks = allowed[first]
        size = sum(runs[r][1] - runs[r][0] for r in members)
        if size < 2 or min(units(table.prices[first][k].time_mb_s) for k in ks) <= 0:
            continue
        curves = rank_curves(table, first, ks, budget, units)
        floors = [floor_table(curve, size) for curve in curves]
        slowest = max(slowest, nth_smallest(
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
            for (n0, f0), (n1, f1) in zip(hull := lower_convex_hull(list(enumerate(floor))), hull[1:]):
                # the LP sees the element only through these: time ≥ the chord through (n0, f0), (n1, f1)
                model.Add((n1 - n0) * time_j >= (f1 - f0) * count + f0 * n1 - f1 * n0)
    return int(slowest) if not math.isinf(slowest) else 0


def _sequence_regions(model: cp_model.CpModel, table: PriceTable, runs: list[tuple[int, int]],
                      counts: dict[tuple[int, int, int], Any], j: int, units: Units) -> list[Any]:
    """Rank j's sequence-parallel regions (:func:`autopar.planning.sequence.sequence_regions`): per
    cost class, a boolean forced on by the count of every sequence-parallel strategy of its runs
    on j, paying one region's entry and exit per model chunk."""
    chunks = table.config.schedule.chunks
    by_class: dict[int, list[tuple[Any, int, float]]] = {}
    for (r, jj, k), var in counts.items():
        a, b = runs[r]
        if jj == j and table.choices[a][k].sp:
            by_class.setdefault(table.graph.cost_classes[a], []).append((var, b - a, table.sequence_region_s(a, k)))
    terms: list[Any] = []
    for cls, users in by_class.items():
        flag = model.NewBoolVar(f"sequence_region_{j}_{cls}")
        for var, most, _ in users:
            model.Add(var <= most * flag)
        terms.append(units(chunks * max(cost for _, _, cost in users)) * flag)
    return terms


def _zero_buffers(model: cp_model.CpModel, table: PriceTable, runs: list[tuple[int, int]],
                  counts: dict[tuple[int, int, int], Any], j: int) -> Any:
    """FSDP2's reduce-scatter and prefetch buffers on rank j, each held once if any layer there
    needs it: a boolean per buffer, forced on by the count of every strategy that needs it."""
    terms: list[Any] = []
    for name, size, held in (("rs", table.reduce_scatter_buffer_bytes, Buffers.REDUCE_SCATTER),
                             ("ag", table.prefetch_buffer_bytes, Buffers.PREFETCH)):
        users = [(var, runs[r][1] - runs[r][0]) for (r, jj, k), var in counts.items()
                 if jj == j and table.buffers_needed(runs[r][0], k) >= held]
        if size <= 0 or not users:
            continue
        flag = model.NewBoolVar(f"{name}_buffer_{j}")
        for var, most in users:
            model.Add(var <= most * flag)
        terms.append(size * flag)
    return sum(terms)


def _edge_exposure(model: cp_model.CpModel, table: PriceTable, runs: list[tuple[int, int]],
                   counts: dict[tuple[int, int, int], Any], units: Units) -> Any:
    """What the first and last FSDP2 unit expose, at the plan's highest ZeRO stage
    (:mod:`autopar.planning.edges`): a boolean per ZeRO level, forced on by the count of every
    strategy running a unit at that level or above on any rank, each adding its level's
    increment over the one below."""
    terms: list[Any] = []
    for z, extra_s in edges.edge_increments_s(table).items():
        users = [(var, runs[r][1] - runs[r][0]) for (r, _, k), var in counts.items()
                 if edges.edge_level(table, runs[r][0], k) >= z]
        if units(extra_s) <= 0 or not users:
            continue
        flag = model.NewBoolVar(f"edge_zero{z}")
        for var, most in users:
            model.Add(var <= most * flag)
        terms.append(units(extra_s) * flag)
    return sum(terms)


def _hint(model: cp_model.CpModel, table: PriceTable, cuts: list[Any], cuts_ok: list[int]) -> None:
    """Start the search from evenly spaced cuts."""
    stages = table.config.stages
    if stages > 1 and len(cuts_ok) >= stages - 1:
        picks = [cuts_ok[round(i * (len(cuts_ok) - 1) / max(stages - 2, 1))] for i in range(stages - 1)]
        if len(set(picks)) == stages - 1:
            for s, q in enumerate(picks, start=1):
                model.AddHint(cuts[s], q)


def extract(solver: cp_model.CpSolver, built: BuiltModel, table: PriceTable,
             runs: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[LayerChoice, ...]]:
    cuts = [solver.Value(x) if not isinstance(x, int) else x for x in built.cuts]
    stages = [0] * len(table.graph)
    for s in range(len(cuts) - 1):
        for i in range(cuts[s], cuts[s + 1]):
            stages[i] = s
    strategies: list[LayerChoice | None] = [None] * len(table.graph)
    # a run's sequence-parallel layers on a rank first, side by side: one region, as priced
    def order(rjk: tuple[int, int, int]) -> tuple:
        r, j, k = rjk
        return (r, j, not table.choices[runs[r][0]][k].sp, k)

    for (r, j, k) in sorted(built.counts, key=order):
        a, b = runs[r]
        layers = [i for i in range(a, b) if strategies[i] is None
                  and table.config.rank_of_stage(stages[i]) == j]
        for i in layers[:solver.Value(built.counts[(r, j, k)])]:
            strategies[i] = table.choices[a][k]
    return tuple(stages), tuple(strategies)  # type: ignore[arg-type]


def cp_solver(time_limit_s: float, options: SolverOptions, again: bool = False) -> cp_model.CpSolver:
    """A CP-SAT solver with the options' parameters (``again``: for a configuration solved again)."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = options.workers
    solver.parameters.random_seed = options.seed
    solver.parameters.max_deterministic_time = max(time_limit_s, 0.05)
    solver.parameters.max_time_in_seconds = max(3 * time_limit_s, 0.1)
    solver.parameters.log_search_progress = options.log
    solver.parameters.linearization_level = options.linearization_level
    solver.parameters.cp_model_probing_level = options.again_probing_level if again else options.probing_level
    if not options.presolve_inclusion:
        solver.parameters.presolve_inclusion_work_limit = 0
    return solver


def hint_plan(built: BuiltModel, table: PriceTable, runs: list[tuple[int, int]], stages: tuple[int, ...],
              choices: tuple[LayerChoice, ...]) -> None:
    """Start the search from a whole plan (its cuts and each run's strategy counts per rank) instead of
    evenly spaced cuts: a plan found another way (:mod:`.rank_dp`)."""
    built.model.ClearHints()
    for s in range(1, table.config.stages):
        if not isinstance(built.cuts[s], int):
            built.model.AddHint(built.cuts[s], stages.index(s))
    held: dict[tuple[int, int, int], int] = {}
    for r, (a, b) in enumerate(runs):
        for i in range(a, b):
            key = (r, table.config.rank_of_stage(stages[i]), table.index_of(i, choices[i]))
            held[key] = held.get(key, 0) + 1
    for key, var in built.counts.items():
        built.model.AddHint(var, held.get(key, 0))
