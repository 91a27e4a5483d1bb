"""Infeasibility: when nothing fits, find the least memory any plan needs and say so."""

from __future__ import annotations

import time

from ortools.sat.python import cp_model

from autopar.errors import InfeasibleError
from autopar.planning.bounds import memory_lower_bound
from autopar.planning.choices import runs_of
from autopar.planning.configuration import Configuration
from autopar.planning.model import SolverOptions, Units, build_model, cp_solver
from autopar.units import format_bytes

FIRST_SOLVE_S = 5.0  # the least-memory solve of the first configuration, when the time limit is spent


def raise_infeasible(candidates, layer_pins, cuts_ok, budget: int, options: SolverOptions,
                     unexamined: int = 0, timed_out: bool = False) -> None:
    """No configuration fits: find the least memory any plan needs and say so.

    Branch and bound again, on memory: configurations in order of a lower bound
    on their peak memory, each solved for its least peak, until the bound
    reaches the least found (or the time limit ends the search). The first is
    solved even when the time limit is spent (bounding a thousand
    configurations of a 3,072-GPU world takes seconds), and pins are blamed
    only when every configuration was proved to have no plan at all (none
    left ``unexamined`` by the search for the fastest): a search the time
    limit cut short says so. The least memory is claimed only where this search proved it (its bound reached
    the least found); a least-memory plan within the budget means the search for the fastest missed it: the
    time limit (``timed_out``: binding "time") or the solver (binding "solver": :func:`~autopar.planning.solver.
    solve` searches again without the presolve step that refutes feasible models).
    """
    start = time.perf_counter()
    best: tuple[int, Configuration] | None = None
    by_memory = sorted(((memory_lower_bound(x[2], x[3]), x) for x in candidates), key=lambda y: y[0])
    refuted = 0  # configurations proved to have no plan under the pins and cuts
    proved = True  # every configuration solved or bounded past the least found
    for bound, (_, config, table, allowed) in by_memory:
        remaining = options.time_limit_s - (time.perf_counter() - start)
        if best is not None and bound >= best[0]:
            break
        if remaining <= 0:
            if best is not None or refuted:
                proved = False
                break
            remaining = FIRST_SOLVE_S
        runs = runs_of(table, allowed, layer_pins)
        built = build_model(table, allowed, runs, layer_pins, cuts_ok, None, Units(1.0))
        solver = cp_solver(remaining, options)
        status = solver.Solve(built.model)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            need = int(solver.ObjectiveValue())
            if best is None or need < best[0]:
                best = (need, config)
        elif status in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID):
            refuted += 1
    if best is None and refuted == len(by_memory) and not unexamined:
        raise InfeasibleError("no plan satisfies the pins (stage pins and pipeline cuts conflict)",
                              binding="pins")
    if best is None:
        raise InfeasibleError(
            f"no plan found under the budget of {format_bytes(budget)} per rank, and the time limit "
            f"({options.time_limit_s:g} s) ended before the least memory any plan needs was found "
            f"({len(by_memory) - refuted + unexamined} of {len(by_memory) + unexamined} configurations left "
            "open); use a longer time limit (--time-limit), more devices, a smaller batch or more memory "
            "(--memory-gb)",
            binding="time",
        )
    need, config = best
    if need <= budget:
        raise InfeasibleError(
            f"no plan found, though {config.describe()} has one in {format_bytes(need)} per rank, within the "
            f"budget of {format_bytes(budget)}: " + (
                f"the time limit ({options.time_limit_s:g} s) ended first; use a longer one (--time-limit)"
                if timed_out else "the solver refuted it"),
            binding="time" if timed_out else "solver", min_memory_bytes=need)
    if not proved or unexamined:
        left = f" with {unexamined} configurations unexamined" if unexamined else ""
        raise InfeasibleError(
            f"no plan found under the budget of {format_bytes(budget)} per rank; the least memory found, "
            f"{format_bytes(need)} ({config.describe()}), is not proved least: the time limit "
            f"({options.time_limit_s:g} s) ended first{left}; use a longer one (--time-limit), more devices, a "
            "smaller batch or more memory (--memory-gb)", binding="time", min_memory_bytes=need)
    raise InfeasibleError(
        f"no plan fits in memory: needs {format_bytes(need)} per rank at best "
        f"({config.describe()}), budget {format_bytes(budget)}; use more devices, a smaller "
        f"batch, or more memory (--memory-gb)",
        binding="memory", min_memory_bytes=need,
    )
