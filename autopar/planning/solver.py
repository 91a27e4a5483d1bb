"""The planner: choose mesh, microbatches, schedule and per-layer strategies.

Search, in two levels:

1. **Configurations** (:func:`enumerate_configs`): every mesh of the declared
   axes (:mod:`autopar.mesh`: pp × dp × tp = world size, each degree dividing
   what its axis splits, tp within a node unless pinned), microbatch count m dividing the
   per-replica batch, schedule (GPipe only where 1F1B cannot run, since
   under this cost model 1F1B has GPipe's time and never more memory;
   interleaved 1F1B with 2 or 4 chunks per rank), and data-parallel mode
   (replicated, or sharded with the root units at ZeRO-1, 2 or 3: the
   contract's, :mod:`autopar.contract`), in :mod:`.configs`; each layer's
   strategies the pins allow in :mod:`.choices`. Each configuration has a
   lower bound on its step time (fastest strategy per layer, perfectly
   balanced stages); configurations are solved in order of that bound and
   the search stops when the bound reaches the best plan found (branch and
   bound), so the answer is optimal over the whole space when every inner
   solve is. Before a configuration is solved, a bound with its memory terms
   (:func:`.bounds.lower_bound_s`: a knapsack over all ranks' memory, and rank
   by rank with in-flight activations and FSDP2's buffers) may skip it; one whose
   least memory over every choice its rows offer exceeds the ranks' budgets
   (:func:`.memory_floor.memory_floor_bytes`, the knapsack's own test) is dropped
   before its rows are priced (most of a long-sequence search cannot fit). A
   configuration's first solve is short (``SolverOptions.first_solve_s``); one
   that runs out is solved again, held to the better plans found since, after
   the others (:func:`_solve_deferred`). When
   nothing fits, :mod:`.infeasible` names the least memory a plan needs.

2. **Per configuration, a CP-SAT model** (:func:`.model.build_model`) over runs of
   identical consecutive layers (a run r = layers [a_r, b_r), all pricing
   alike), S = pp·v virtual stages, strategies k of each run:

   Variables
     cut_c ∈ allowed cut positions, c = 1..S−1       stage c = layers [cut_c, cut_{c+1})
     cnt_{r,c} = |[a_r, b_r) ∩ [cut_c, cut_{c+1})|   layers of run r in stage c
     n_{r,c,k} ∈ [0, |r|],  Σ_k n_{r,c,k} = cnt_{r,c}  how many of them use strategy k
     T, X                                              critical rank time, tail

   Constraints (each group names the function of :mod:`.model` that adds it)
     contiguity     cut_{c+1} ≥ cut_c + 1 and stage pins       (_add_cuts)
     counts         cnt via min/max of interval ends          (_add_counts)
     rank time      T ≥ Σ_{c on j} Σ n·t + p2p at j's cuts     (_add_rank_terms)
     tail           X ≥ Σ_{c on j} Σ n·(exposed dp comm + optimizer) + Σ_z e_z·f_z
                    f_z ∈ {0,1}: some rank runs an FSDP2 unit at ZeRO ≥ z; e_z what a rank's first
                    and last unit expose over level z − 1 (planning.edges)      (_edge_exposure)
     memory         Σ n·mem_{r,k,j} + workspace_j + rs·u_j + ag·v_j ≤ budget   (memory_j)
                    u_j, v_j ∈ {0,1}: rank j has a ZeRO ≥ 1 / ZeRO-3 layer (FSDP2's buffers)
     rank floors    (redundant) time of a group of alike layers on j ≥ g_j(their count), the least
                    that many can take in j's own memory; T ≥ the bound they give  (add_rank_floors)
     sharded plan   a sharded mode's plan shards some layer (Σ n over ZeRO ≥ 1 ≥ 1), where no
                    root unit holds parameters to imply it              (_add_sharded_plan)

   Objective (× den(w), to stay integral): minimise (m − w)·T + w·S + X with
   S = Σ_j t_j, i.e. step = m·T + w·(S − T) + X, the model of :mod:`autopar.planning.pricing`.
   Where ranks share cores: P + X, with P ≥ that critical path / σ and P ≥ each
   node's work term (:func:`_step_objective`).

Times become integers in one place (:class:`.model.Units`); memory is integral
bytes already. Runs with 1 worker and a deterministic time limit, so the same
inputs give the same plan.

Runners-up. The search keeps the best plan of each *distinct configuration*
(the mesh, and whether data parallelism is sharded; microbatches and
schedule are details within one) until it holds the best ``RUNNERS_UP + 1`` of
them, so a plan can say what came next without solving again
(``autopar explain``). Branch and bound then prunes against the last of those
instead of the best alone: a configuration is skipped, or its CP-SAT model
bounded, by what it must beat to enter the list (:meth:`_Search.threshold`).
Pruning against the best would leave no runner-up whenever the first
configuration solved wins. The chosen plan is the same optimum: a
configuration whose bound is no better than the best plan so far can only be
a runner-up, so its CP-SAT solve is short (``RUNNER_UP_SOLVE_S``
deterministic seconds; its candidate says whether it was proved optimal) and
leaves the chosen plan's gap alone. Runners-up are solved after the chosen plan
is proved, not on the way: a configuration that can only be a runner-up waits
until every one that could be chosen is done, and the runners-up then get what
is left of the time limit, at most :data:`RUNNER_UP_SHARE` of it (1.5 s of 30; GPT-1T on
4,096 GPUs: the runners-up's short solves, taken on the way, once spent 24 of
its 30 s and left the optimum unproved). ``runners_up=0`` is the plain search.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from autopar.choice import LayerChoice
from autopar.cost_models.hardware import ClusterSpec
from autopar.errors import PinError
from autopar.graph import LayerGraph
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.planning.bounds import balanced_step_s, lower_bound_s
from autopar.planning.choices import allowed_choices, check_recompute_pins, check_sp_pins, runs_of
from autopar.planning.configs import cut_positions, enumerate_configs
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.cut_checks import check_stage_pins
from autopar.planning.evaluate import Evaluation, evaluate
from autopar.planning.infeasible import raise_infeasible
from autopar.planning.memory_floor import memory_floor_bytes
from autopar.planning.model import BuiltModel, SolverOptions, Units, build_model, cp_solver, extract
from autopar.planning.pricing import PriceTable
from autopar.planning.shared_prices import SharedPrices

__all__ = ["Candidate", "RUNNERS_UP", "Solution", "SolverOptions", "cut_positions", "distinct_key",
           "enumerate_configs", "solve"]

RUNNERS_UP = 3  # distinct configurations a plan records after its own: enough to see what came next
# CP-SAT deterministic seconds for a configuration that can only be a runner-up, and the most wall time
# the runners-up may take after the chosen plan is proved, as a share of the time limit. Runners-up say
# what came next; one not proved best for its mesh says so (Candidate.optimal). At 0.25 s and 5% they
# took more time than finding and proving the chosen plan (Llama 3 70B × 512: 1.9 of 2.4 s of CP-SAT),
# and at 0.1 s and 3% the first two runners-up of Llama 3 70B × 512 and GPT-3 175B × 1,024 kept their
# meshes and step times (to 0.1%), the third another mesh, 2-3% slower
RUNNER_UP_SOLVE_S = 0.1
RUNNER_UP_SHARE = 0.03


@dataclass(frozen=True)
class Candidate:
    """The best assignment the search found for one configuration, priced by :func:`evaluate`."""

    config: Configuration
    stages: tuple[int, ...]
    choices: tuple[LayerChoice, ...]
    prediction: Evaluation
    table: PriceTable
    optimal: bool = True  # False: CP-SAT's time ran out first (a runner-up's solve is short)

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time_s


def distinct_key(config: Configuration) -> tuple[Mesh, bool, str]:
    """What makes two configurations different plans to a reader: the mesh, whether data
    parallelism is sharded and cp's attention method (microbatches, schedule and the root's ZeRO
    stage are details)."""
    return config.mesh, config.data_parallel.sharded, str(config.cp_attention)


@dataclass
class Solution:
    """The chosen assignment, its prediction, and how the search went."""

    config: Configuration
    stages: tuple[int, ...]
    choices: tuple[LayerChoice, ...]
    prediction: Evaluation
    table: PriceTable
    status: str
    gap: float
    wall_s: float
    configs_total: int
    configs_solved: int
    memory_budget_bytes: int
    runners_up: tuple[Candidate, ...] = ()  # the next distinct configurations, fastest first


@dataclass
class _Search:
    """The best plan of each distinct configuration found so far (:func:`distinct_key`), of which
    the best ``keep`` matter, and what the search left open."""

    keep: int = RUNNERS_UP + 1
    kept: dict[tuple, Candidate] = field(default_factory=dict)
    open_bounds: list[float] = field(default_factory=list)
    solved: int = 0

    def ranked(self) -> list[Candidate]:
        """The kept plans, fastest first (on a tie, the first found)."""
        order = {key: n for n, key in enumerate(self.kept)}
        return sorted(self.kept.values(), key=lambda c: (c.step_time_s, order[distinct_key(c.config)]))

    @property
    def best(self) -> Candidate | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    @property
    def cutoff(self) -> float:
        """What any configuration must beat to matter: the last of the ``keep`` best (∞ until full)."""
        ranked = self.ranked()
        return ranked[self.keep - 1].step_time_s if len(ranked) >= self.keep else math.inf

    def threshold(self, config: Configuration) -> float:
        """What a plan of ``config`` must beat to be kept: its own configuration's best, if that
        is among the ``keep`` best, else the cutoff."""
        own = self.kept.get(distinct_key(config))
        return min(self.cutoff, own.step_time_s if own is not None else math.inf)

    def offer(self, candidate: Candidate) -> None:
        if candidate.step_time_s < self.threshold(candidate.config):
            key = distinct_key(candidate.config)
            self.kept.pop(key, None)  # re-inserted: the order of finding breaks ties
            self.kept[key] = candidate
            for dropped in self.ranked()[self.keep:]:
                del self.kept[distinct_key(dropped.config)]


def solve(graph: LayerGraph, world_size: int, cluster: ClusterSpec, training: TrainingSpec, *,
          pins: Pins | None = None, memory_budget_bytes: int | None = None,
          options: SolverOptions | None = None, runners_up: int = RUNNERS_UP) -> Solution:
    """The fastest plan under the memory budget, by branch and bound over configurations, and the
    best plans of the next ``runners_up`` distinct configurations (0: the shortest search)."""
    start = time.perf_counter()
    options = options or SolverOptions()
    pins = pins or Pins()
    budget = cluster.memory_budget_bytes if memory_budget_bytes is None else memory_budget_bytes
    layer_pins = pins.resolve_layers([layer.name for layer in graph])
    check_recompute_pins(graph, pins)
    check_sp_pins(graph, pins)
    check_stage_pins(graph, layer_pins)
    cuts_ok = cut_positions(graph)
    # Configurations in order of a cheap bound (fastest strategy per layer, balanced),
    # priced in full only when that bound could still beat the best plan so far.
    candidates, shared = [], SharedPrices()
    for config in enumerate_configs(graph, world_size, cluster, training, pins):
        table = PriceTable(graph, config, cluster, training, shared)
        fastest = table.fastest_time_mb_s()
        cheap = balanced_step_s(table, sum(fastest), max(fastest))
        candidates.append((cheap, config, table))
    candidates.sort(key=lambda x: (x[0], x[1]))
    search, priced = _Search(keep=1 + max(0, runners_up)), []
    # configurations no plan of which fits (memory_floor: what the bound would find), dropped before pricing;
    # a pin outside the search space may extend a row with a choice holding less: no screen then
    screened: list[tuple[float, Configuration, PriceTable]] = []
    fits = _Screen(budget if not any(layer_pins) else None, screened)
    # 1. the chosen plan: every configuration that could beat the best so far, solved in full; those
    #    that cannot (a runner-up at most) wait, so runners-up never take the time the optimum needs
    later: list[tuple[float, Configuration, PriceTable, list[list[int]] | None, float]] = []
    rest, unexamined = len(candidates), 0
    deferred: list[_Deferred] = []  # configurations whose first, short solve ran out: solved again below
    with _overlap_pool(options) as pool:
        flight = _InFlight(pool, deferred)
        for index, (cheap, config, table) in enumerate(candidates):
            # what this configuration needs is prepared while the previous one's CP-SAT solve runs;
            # every decision below is taken after that solve has landed, as the sequential search takes it
            ahead = _look_ahead(search, cheap, table, layer_pins, budget, cuts_ok, fits) if flight.job else None
            flight.land(search, later)
            best = search.best
            if _stops(search, cheap):
                rest = index
                break
            remaining = options.time_limit_s - (time.perf_counter() - start)
            # else: price one, never blame the pins (a configuration the screen dropped was examined: it cannot fit)
            if remaining <= 0 and (priced or screened or search.best is not None):
                search.open_bounds += [b for b, *_ in candidates[index:]]
                unexamined = len(candidates) - index
                rest = len(candidates)
                break
            if not (ahead or fits(cheap, table)):
                continue
            allowed = ahead.allowed if ahead else allowed_choices(table, layer_pins)
            if any(not ks for ks in allowed):
                continue
            priced.append((cheap, config, table, allowed))
            enough = search.threshold(config)
            bound = ahead.bound if ahead and ahead.enough == enough else \
                lower_bound_s(table, allowed, budget, cuts_ok, enough=enough)
            if math.isinf(bound) or bound >= enough:
                continue
            if best is not None and bound >= best.step_time_s:  # cannot be chosen: a runner-up at most
                later.append((cheap, config, table, allowed, bound))
                continue
            prepared = ahead.prepared if ahead and ahead.prepared else \
                _prepare(table, allowed, layer_pins, cuts_ok, budget)
            flight.submit(search, later, prepared, remaining, options, (cheap, config, table, allowed, bound))
        flight.land(search, later)
    _solve_deferred(search, deferred, later, start, options)
    later.sort(key=lambda item: (item[0], item[1]))
    # 2. runners-up, in what time is left: short solves of configurations that cannot be chosen
    if search.best is not None and runners_up > 0:
        later += [(cheap, config, table, None, math.nan) for cheap, config, table in candidates[rest:]]
        until = min(options.time_limit_s, time.perf_counter() - start + RUNNER_UP_SHARE * options.time_limit_s)
        for cheap, config, table, allowed, bound in later:
            remaining = until - (time.perf_counter() - start)
            if remaining <= 0 or cheap >= search.cutoff:
                break
            if allowed is None:
                if not fits(cheap, table):
                    continue
                allowed = allowed_choices(table, layer_pins)
                if any(not ks for ks in allowed):
                    continue
                bound = lower_bound_s(table, allowed, budget, cuts_ok, enough=search.threshold(config))
            if math.isinf(bound) or bound >= search.threshold(config):
                continue
            _solve_config(search, table, allowed, layer_pins, cuts_ok, budget,
                          min(remaining, RUNNER_UP_SOLVE_S), options, runner_up=True)
    wall = time.perf_counter() - start
    if search.best is None:
        priced = _with_screened(priced, screened, layer_pins)
        if not priced:
            degrees = ", ".join(f"tp={t}" for t in sorted({config.mesh.tp for _, config, _ in candidates}))
            raise PinError(f"no configuration the pins allow can run every layer: the pinned tensor-parallel "
                           f"styles admit none of the degrees the pins leave ({degrees}), or the pinned ZeRO "
                           "stages cannot run (inside an export-captured model's pipeline stages every layer "
                           "is replicated), or under cp a pinned style holds key/value projections whole on "
                           "every tp rank or pinned sp leaves S/cp tokens tp does not divide, or a pinned style "
                           "splitting experts over tp (megatron+experts) meets pp, cp or ep, which it does not "
                           "run beside, or under --compile a pinned selective or alternate-mm recompute meets a block "
                           "compiled around an eager exchange (ep's dispatch, cp's ring), which recomputes "
                           "compiled in full only")
        raise_infeasible(priced, layer_pins, cuts_ok, budget, options, unexamined)
    best, *runners_up = search.ranked()
    step = best.step_time_s
    bound = min([step] + search.open_bounds)
    gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
    return Solution(best.config, best.stages, best.choices, best.prediction, best.table,
                    "OPTIMAL" if gap <= 1e-9 else "FEASIBLE", gap, wall,
                    len(candidates), search.solved, budget, tuple(runners_up))


@dataclass
class _Screen:
    """Whether a configuration may fit in ``budget`` (None: every one may), by the least memory its pipeline
    ranks hold together (:func:`memory_floor_bytes`); one that cannot is kept in ``screened``, once."""

    budget: int | None
    screened: list[tuple[float, Configuration, PriceTable]]
    seen: set[int] = field(default_factory=set)

    def __call__(self, cheap: float, table: PriceTable) -> bool:
        if self.budget is None or memory_floor_bytes(table) <= table.config.mesh.pp * self.budget:
            return True
        if id(table) not in self.seen:
            self.seen.add(id(table))
            self.screened.append((cheap, table.config, table))
        return False


def _with_screened(priced: list, screened: list[tuple[float, Configuration, PriceTable]], layer_pins) -> list:
    """What the search priced and the configurations the memory screen dropped, priced now, in the search's
    order (its cheap bound): what the search for the least memory a plan needs is given, as before the screen."""
    out = list(priced)
    for cheap, config, table in screened:
        allowed = allowed_choices(table, layer_pins)
        if not any(not ks for ks in allowed):
            out.append((cheap, config, table, allowed))
    return sorted(out, key=lambda item: (item[0], item[1]))


def _solve_config(search: _Search, table: PriceTable, allowed, layer_pins, cuts_ok, budget,
                  time_limit_s: float, options: SolverOptions, *, runner_up: bool = False) -> bool:
    """Solve one configuration; whether it offered a plan. The chosen plan's search (not
    ``runner_up``) looks only for plans that beat the best so far, which CP-SAT refutes fast."""
    prepared = _prepare(table, allowed, layer_pins, cuts_ok, budget)
    _bound_objective(search, prepared, runner_up)
    solver = cp_solver(time_limit_s, options)
    return _finish(search, prepared, solver, solver.Solve(prepared.built.model), runner_up)


@dataclass
class _Prepared:
    """One configuration's CP-SAT model, built; its objective not yet bounded by the search."""

    table: PriceTable
    allowed: list[list[int]]
    runs: list[tuple[int, int]]
    units: Units
    built: BuiltModel
    budget: int | None
    cuts_ok: list[int]


def _prepare(table: PriceTable, allowed, layer_pins, cuts_ok, budget) -> _Prepared:
    runs = runs_of(table, allowed, layer_pins)
    largest = max(max(p.time_mb_s, p.tail_s) for ps in table.prices for p in ps)
    units = Units(max(largest, table.p2p_largest_s()))
    built = build_model(table, allowed, runs, layer_pins, cuts_ok, budget, units)
    return _Prepared(table, allowed, runs, units, built, budget, cuts_ok)


def _bound_objective(search: _Search, prepared: _Prepared, runner_up: bool) -> None:
    """Only plans the search could keep (with rounding slack): what the configuration must beat now."""
    table, built = prepared.table, prepared.built
    must_beat = search.threshold(table.config)
    if not runner_up and search.best is not None:
        must_beat = min(must_beat, search.best.step_time_s)
    if not math.isinf(must_beat):
        built.model.Add(built.objective <= int(must_beat * built.scale / prepared.units.unit_s) + _slack(prepared))


def _slack(prepared: _Prepared) -> int:
    """What rounding the times to integer units may move the objective by, in objective units."""
    c = prepared.table.config
    return 4 * (len(prepared.table.graph) + c.stages) * (c.microbatches * prepared.built.scale + c.mesh.pp)


def _finish(search: _Search, prepared: _Prepared, solver: cp_model.CpSolver, status: int, runner_up: bool,
            defer: tuple[list[_Deferred], tuple] | None = None, again: bool = False) -> bool:
    """Offer a solved configuration's plan to the search; whether there was one. ``defer``: where a
    solve that ran out its time goes to be solved again (with the entry it came with), its bound
    open until then; ``again``: this is such a solve (the configuration was counted the first time)."""
    table, built, units = prepared.table, prepared.built, prepared.units
    search.solved += not again
    cp_bound = solver.BestObjectiveBound() * units.unit_s / built.scale
    if defer is not None and status in (cp_model.FEASIBLE, cp_model.UNKNOWN):
        cheap, config, _, allowed, bound = defer[1]
        sound = max(bound, (solver.BestObjectiveBound() - _slack(prepared)) * units.unit_s / built.scale)
        defer[0].append(_Deferred(sound, (cheap, config, table, allowed, sound), prepared))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.UNKNOWN and not runner_up and defer is None:
            search.open_bounds.append(lower_bound_s(table, prepared.allowed, prepared.budget, prepared.cuts_ok))
        return defer is not None and status == cp_model.UNKNOWN
    stages, choices = extract(solver, built, table, prepared.runs)
    prediction = evaluate(table, stages, choices)
    if status == cp_model.FEASIBLE and not runner_up and defer is None:  # a runner-up's is above the chosen plan's
        search.open_bounds.append(cp_bound)
    search.offer(Candidate(table.config, stages, choices, prediction, table, status == cp_model.OPTIMAL))
    return True


def _ruled_out(search: _Search, item: _Deferred) -> bool:
    """Whether a deferred configuration's bound proves it cannot be chosen (it may still be a runner-up)."""
    best = search.best
    return item.bound >= search.threshold(item.entry[1]) or (best is not None and item.bound >= best.step_time_s)


@dataclass
class _Deferred:
    """A configuration whose solve ran out its time before proving its plan best, or none better than the
    search's: its model (with the cutoffs it had) and a sound lower bound on its step time (CP-SAT's, less
    the rounding slack, or the search's bound if higher). The plan found is not given to the next solve as a
    hint: the proof that DeepSeek-V3 × 1,024's pp=8 × ep=8 plan is best took 3.6 deterministic seconds with
    it, 0.66 without."""

    bound: float
    entry: tuple  # (cheap bound, configuration, price table, allowed choices, bound): as the runners-up keep it
    prepared: _Prepared


def _solve_deferred(search: _Search, deferred: list[_Deferred], later: list, start: float,
                    options: SolverOptions) -> None:
    """Solve again, lowest bound first and with four times the time each round (the last one open: all
    that is left), every configuration whose first solve ran out, until each is proved (its plan best,
    or none better than what it must beat), ruled out by its bound, or the time limit is reached (its
    bound then stays open: the plan is FEASIBLE).

    Why: a configuration solved early must beat only the plans found before it, and proving a slow
    configuration's own optimum can take CP-SAT most of the time limit, where proving that it cannot
    beat a good plan found later takes a fraction of a second (DeepSeek-V3 × 1,024 with ep inside
    pipeline stages: pp=4 × ep=8's own optimum, 8.12 s a step, took 18 s to prove; that no plan of it
    beats pp=8 × ep=8's 6.34 s, 0.08 s). Nothing is dropped on a heuristic: each configuration leaves
    only on a proof (CP-SAT's, or a bound at least what it must beat)."""
    limit = options.first_solve_s
    while deferred:
        limit *= 4
        current = sorted(deferred, key=lambda d: (d.bound, d.entry[1]))
        deferred.clear()
        for n, item in enumerate(current):
            config = item.entry[1]
            if item.bound >= search.threshold(config):
                continue  # proved: it cannot enter the plans kept
            if _ruled_out(search, item):
                later.append(item.entry)  # cannot be chosen: a runner-up at most
                continue
            remaining = options.time_limit_s - (time.perf_counter() - start)
            if remaining <= 0:
                search.open_bounds.append(item.bound)
                continue
            model = item.prepared.built.model
            _bound_objective(search, item.prepared, runner_up=False)
            alone = not deferred and all(_ruled_out(search, other) for other in current[n + 1:])
            solver = cp_solver(remaining if alone else min(remaining, limit), options, again=True)
            if not _finish(search, item.prepared, solver, solver.Solve(model), runner_up=False,
                           defer=(deferred, item.entry), again=True):
                later.append(item.entry)


def _stops(search: _Search, cheap: float) -> bool:
    """Whether no configuration from this cheap bound on can be kept (they come in its order)."""
    best = search.best
    return cheap >= search.cutoff or (best is not None and cheap >= best.step_time_s)


@dataclass
class _Ahead:
    """A configuration's allowed choices, bound (with the ``enough`` it was computed for) and model,
    prepared while an earlier configuration's solve ran."""

    allowed: list[list[int]]
    bound: float = math.inf
    enough: float = math.nan
    prepared: _Prepared | None = None


def _look_ahead(search: _Search, cheap: float, table: PriceTable, layer_pins, budget, cuts_ok,
                fits: _Screen) -> _Ahead | None:
    """Prepare what the search will most likely need of this configuration, judged on the search as it is
    before the solve in flight lands. That search is never ahead of the landed one (its best and thresholds
    only fall), so what it rules out stays ruled out; what it lets through is checked again after landing."""
    if _stops(search, cheap) or not fits(cheap, table):
        return None
    ahead = _Ahead(allowed_choices(table, layer_pins))
    if any(not ks for ks in ahead.allowed):
        return ahead
    ahead.enough = search.threshold(table.config)
    ahead.bound = lower_bound_s(table, ahead.allowed, budget, cuts_ok, enough=ahead.enough)
    best = search.best
    if not (math.isinf(ahead.bound) or ahead.bound >= ahead.enough
            or (best is not None and ahead.bound >= best.step_time_s)):
        ahead.prepared = _prepare(table, ahead.allowed, layer_pins, cuts_ok, budget)
    return ahead


class _InFlight:
    """The chosen plan's CP-SAT solve in flight: at most one, in ``pool``'s thread (CP-SAT releases the
    GIL while it searches, so the next configuration's Python runs beside it), landed (its plan offered
    to the search, or its configuration kept for the runners-up) before the search is read again.
    Without a pool each solve lands as it is submitted: the sequential search."""

    def __init__(self, pool: ThreadPoolExecutor | None, deferred: list[_Deferred]):
        self.pool = pool
        self.deferred = deferred
        self.job: tuple | None = None

    def submit(self, search: _Search, later: list, prepared: _Prepared, time_limit_s: float,
               options: SolverOptions, entry: tuple) -> None:
        _bound_objective(search, prepared, runner_up=False)
        solver = cp_solver(min(time_limit_s, options.first_solve_s), options)
        if self.pool is None:
            self._land(search, later, solver, solver.Solve(prepared.built.model), prepared, entry)
        else:
            self.job = (self.pool.submit(solver.Solve, prepared.built.model), solver, prepared, entry)

    def land(self, search: _Search, later: list) -> None:
        if self.job is not None:
            future, solver, prepared, entry = self.job
            self.job = None
            self._land(search, later, solver, future.result(), prepared, entry)

    def _land(self, search: _Search, later: list, solver: cp_model.CpSolver, status: int, prepared: _Prepared,
              entry: tuple) -> None:
        if not _finish(search, prepared, solver, status, runner_up=False, defer=(self.deferred, entry)):
            later.append(entry)  # nothing beats the best: a runner-up?


@contextlib.contextmanager
def _overlap_pool(options: SolverOptions) -> Iterator[ThreadPoolExecutor | None]:
    if not options.overlap:
        yield None
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-cp-sat") as pool:
        yield pool
