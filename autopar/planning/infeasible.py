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


def raise_infeasible(candidates, layer_pins, cuts_ok, budget: int, options: SolverOptions) -> None:
    """No configuration fits: find the least memory any plan needs and say so.

    Branch and bound again, on memory: configurations in order of a lower bound
    on their peak memory, each solved for its least peak, until the bound
    reaches the least found (or the time limit ends the search).
    """
    start = time.perf_counter()
    best: tuple[int, Configuration] | None = None
    by_memory = sorted(((memory_lower_bound(x[2], x[3]), x) for x in candidates), key=lambda y: y[0])
    for bound, (_, config, table, allowed) in by_memory:
        remaining = options.time_limit_s - (time.perf_counter() - start)
        if (best is not None and bound >= best[0]) or remaining <= 0:
            break
        runs = runs_of(table, allowed, layer_pins)
        built = build_model(table, allowed, runs, layer_pins, cuts_ok, None, Units(1.0))
        solver = cp_solver(remaining, options)
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
