"""One configuration's CP-SAT solve, and what the search keeps between solves.

:class:`Search` holds the best plan of each distinct configuration found so far and what must be beaten to
enter them; :func:`prepare` builds a configuration's model, :func:`bound_objective` holds it to what it must
beat, and :func:`finish` offers its plan. A first solve that runs out is solved again later
(:func:`solve_deferred`), and :class:`InFlight` runs the chosen plan's solves in a thread beside the search's
Python. The search itself, and why it goes as it does, is :mod:`autopar.planning.solver`'s.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from autopar.choice import LayerChoice
from autopar.mesh import Mesh
from autopar.planning.bounds import lower_bound_s
from autopar.planning.choices import runs_of
from autopar.planning.configuration import Configuration
from autopar.planning.evaluate import Evaluation, evaluate
from autopar.planning.model import BuiltModel, SolverOptions, Units, build_model, cp_solver, extract
from autopar.planning.pricing import PriceTable


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
class Search:
    """The best plan of each distinct configuration found so far (:func:`distinct_key`), of which
    the best ``keep`` matter, and what the search left open."""

    keep: int = 1
    kept: dict[tuple, Candidate] = field(default_factory=dict)
    open_bounds: list[float] = field(default_factory=list)
    solved: int = 0
    # the best plan found of each distinct configuration and pipeline schedule (its kind and chunks), kept or
    # not: what the chosen plan's schedule beat on its own mesh (schedule_runner_up)
    schedules: dict[tuple, Candidate] = field(default_factory=dict)

    def schedule_runner_up(self, chosen: Candidate) -> Candidate | None:
        """The best plan found on ``chosen``'s distinct configuration under another pipeline schedule (None:
        none was solved to a plan: their bounds were no better, or nothing fit)."""
        key = distinct_key(chosen.config)
        others = [c for (k, schedule), c in self.schedules.items() if k == key and schedule != chosen.config.schedule]
        return min(others, key=lambda c: c.step_time_s, default=None)

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

    def prove(self, config: Configuration) -> None:
        """Mark the plan kept for ``config`` proved best for it: a solve held to it found nothing faster (a plan
        offered before its configuration was solved: :mod:`.rank_dp`)."""
        own = self.kept.get(key := distinct_key(config))
        if own is not None and own.config == config and not own.optimal:
            self.kept[key] = replace(own, optimal=True)

    def offer(self, candidate: Candidate) -> None:
        own = self.kept.get(distinct_key(candidate.config))
        if candidate.optimal and own is not None and own.step_time_s <= candidate.step_time_s:
            self.prove(candidate.config)  # the solve's optimum is no faster than the plan held
        by_schedule = (distinct_key(candidate.config), candidate.config.schedule)
        if by_schedule not in self.schedules or candidate.step_time_s < self.schedules[by_schedule].step_time_s:
            self.schedules[by_schedule] = candidate
        if candidate.step_time_s < self.threshold(candidate.config):
            key = distinct_key(candidate.config)
            self.kept.pop(key, None)  # re-inserted: the order of finding breaks ties
            self.kept[key] = candidate
            for dropped in self.ranked()[self.keep:]:
                del self.kept[distinct_key(dropped.config)]


@dataclass
class Prepared:
    """One configuration's CP-SAT model, built; its objective not yet bounded by the search."""

    table: PriceTable
    allowed: list[list[int]]
    runs: list[tuple[int, int]]
    units: Units
    built: BuiltModel
    budget: int | None
    cuts_ok: list[int]


def prepare(table: PriceTable, allowed, layer_pins, cuts_ok, budget) -> Prepared:
    runs = runs_of(table, allowed, layer_pins)
    largest = max(max(p.time_mb_s, p.tail_s) for ps in table.prices for p in ps)
    units = Units(max(largest, table.p2p_largest_s()))
    built = build_model(table, allowed, runs, layer_pins, cuts_ok, budget, units)
    return Prepared(table, allowed, runs, units, built, budget, cuts_ok)


def bound_objective(search: Search, prepared: Prepared, runner_up: bool, held: float = math.inf) -> None:
    """Only plans the search could keep (with rounding slack): what the configuration must beat now, or
    ``held`` if less."""
    table, built = prepared.table, prepared.built
    must_beat = min(held, search.threshold(table.config))
    if not runner_up and search.best is not None:
        must_beat = min(must_beat, search.best.step_time_s)
    if not math.isinf(must_beat):
        bound = int(must_beat * built.scale / prepared.units.unit_s) + _slack(prepared)
        if bound < _NO_BOUND:  # past it the bound cuts nothing (and CP-SAT takes no coefficient past int64)
            built.model.Add(built.objective <= bound)


# an objective bound this large constrains no plan: the model's variables stay below 2**50 units each
_NO_BOUND = 2**62


def _slack(prepared: Prepared) -> int:
    """What rounding the times to integer units may move the objective by, in objective units."""
    c = prepared.table.config
    return 4 * (len(prepared.table.graph) + c.stages) * (c.microbatches * prepared.built.scale + c.mesh.pp)


def finish(search: Search, prepared: Prepared, solver: cp_model.CpSolver, status: int, runner_up: bool,
            defer: tuple[list[Deferred], tuple] | None = None, again: bool = False) -> bool:
    """Offer a solved configuration's plan to the search; whether there was one. ``defer``: where a
    solve that ran out its time goes to be solved again (with the entry it came with), its bound
    open until then; ``again``: this is such a solve (the configuration was counted the first time)."""
    table, built, units = prepared.table, prepared.built, prepared.units
    search.solved += not again
    cp_bound = solver.BestObjectiveBound() * units.unit_s / built.scale
    if defer is not None and status in (cp_model.FEASIBLE, cp_model.UNKNOWN):
        cheap, config, _, allowed, bound = defer[1]
        sound = max(bound, (solver.BestObjectiveBound() - _slack(prepared)) * units.unit_s / built.scale)
        defer[0].append(Deferred(sound, (cheap, config, table, allowed, sound), prepared))
    if status == cp_model.INFEASIBLE and not runner_up and search.best is not None \
            and search.best.config == table.config:
        search.prove(table.config)  # held to the best plan, its own: nothing beats it
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


def _ruled_out(search: Search, item: Deferred) -> bool:
    """Whether a deferred configuration's bound proves it cannot be chosen (it may still be a runner-up)."""
    best = search.best
    return item.bound >= search.threshold(item.entry[1]) or (best is not None and item.bound >= best.step_time_s)


@dataclass
class Deferred:
    """A configuration whose solve ran out its time before proving its plan best, or none better than the
    search's: its model (with the cutoffs it had) and a sound lower bound on its step time (CP-SAT's, less
    the rounding slack, or the search's bound if higher). The plan found is not given to the next solve as a
    hint: the proof that DeepSeek-V3 × 1,024's pp=8 × ep=8 plan is best took 3.6 deterministic seconds with
    it, 0.66 without."""

    bound: float
    entry: tuple  # (cheap bound, configuration, price table, allowed choices, bound): as the runners-up keep it
    prepared: Prepared


def solve_deferred(search: Search, deferred: list[Deferred], later: list, start: float,
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
            bound_objective(search, item.prepared, runner_up=False)
            alone = not deferred and all(_ruled_out(search, other) for other in current[n + 1:])
            solver = cp_solver(remaining if alone else min(remaining, limit), options, again=True)
            if not finish(search, item.prepared, solver, solver.Solve(model), runner_up=False,
                           defer=(deferred, item.entry), again=True):
                later.append(item.entry)


class InFlight:
    """The chosen plan's CP-SAT solve in flight: at most one, in ``pool``'s thread (CP-SAT releases the
    GIL while it searches, so the next configuration's Python runs beside it), landed (its plan offered
    to the search, or its configuration kept for the runners-up) before the search is read again.
    Without a pool each solve lands as it is submitted: the sequential search."""

    def __init__(self, pool: ThreadPoolExecutor | None, deferred: list[Deferred]):
        self.pool = pool
        self.deferred = deferred
        self.job: tuple | None = None

    def submit(self, search: Search, later: list, prepared: Prepared, time_limit_s: float,
               options: SolverOptions, entry: tuple) -> None:
        bound_objective(search, prepared, runner_up=False)
        solver = cp_solver(min(time_limit_s, options.first_solve_s), options)
        if self.pool is None:
            self._land(search, later, solver, solver.Solve(prepared.built.model), prepared, entry)
        else:
            self.job = (self.pool.submit(solver.Solve, prepared.built.model), solver, prepared, entry)

    def land(self, search: Search, later: list) -> None:
        if self.job is not None:
            future, solver, prepared, entry = self.job
            self.job = None
            self._land(search, later, solver, future.result(), prepared, entry)

    def _land(self, search: Search, later: list, solver: cp_model.CpSolver, status: int, prepared: Prepared,
              entry: tuple) -> None:
        if not finish(search, prepared, solver, status, runner_up=False, defer=(self.deferred, entry)):
            later.append(entry)  # nothing beats the best: a runner-up?


@contextlib.contextmanager
def overlap_pool(options: SolverOptions) -> Iterator[ThreadPoolExecutor | None]:
    if not options.overlap:
        yield None
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-cp-sat") as pool:
        yield pool
