"""The rank programme (:mod:`autopar.planning.rank_dp`) against brute force: its bound never exceeds a
configuration's best plan, and its plan fits, keeps the model's rules, is priced as :func:`evaluate` prices it
and, given to CP-SAT as its hint (:func:`autopar.planning.model.hint_plan`), is a solution of the model."""

from __future__ import annotations

import math

import pytest
from brute_force import config_best, configs_and_root_stages, tiny_cluster
from ortools.sat.python import cp_model
from synthetic import transformer_graph

from autopar.pins import Pins
from autopar.planning.bounds import lower_bound_s
from autopar.planning.choices import allowed_choices
from autopar.planning.configs import cut_positions
from autopar.planning.configuration import TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.model import SolverOptions, cp_solver, hint_plan
from autopar.planning.pricing import PriceTable
from autopar.planning.rank_dp import _keeps_rules, rank_dp
from autopar.planning.solves import prepare

CASES = [
    # (blocks, hidden, seq, world, gpus per node, batch, memory GiB)
    (3, 1024, 1024, 4, 2, 8, 3),  # spans two nodes, tight
    (4, 512, 256, 8, 4, 8, 80),  # ample memory
    (4, 2048, 2048, 4, 4, 8, 8),  # tight
    (6, 1024, 1024, 4, 4, 8, 4),  # eight layers over two, four or eight stages, tight
]


@pytest.mark.parametrize("blocks,hidden,seq,world,gpus,batch,mem", CASES)
def test_the_programme_s_bound_and_plan_against_brute_force(blocks, hidden, seq, world, gpus, batch, mem):
    graph = transformer_graph(blocks, hidden, seq, vocab=8192, heads=16)
    cluster = tiny_cluster(mem, gpus).for_world_size(world)
    training = TrainingSpec(batch, "bf16")
    budget, cuts_ok = cluster.memory_budget_bytes, cut_positions(graph)
    free = Pins().resolve_layers([layer.name for layer in graph])
    best: dict = {}
    for config, root_zero in configs_and_root_stages(graph, world, cluster, training):
        if config.mesh.pp > 1:
            table = PriceTable(graph, config, cluster, training)
            best[config, config.schedule] = min(best.get((config, config.schedule), (math.inf,))[0],
                                                config_best(table, root_zero, budget)), table
    bounded = planned = tighter = 0
    for (config, _), (step, table) in best.items():
        allowed = allowed_choices(table, free)
        found = rank_dp(table, allowed, budget, cuts_ok, free)
        assert found.bound_s <= step * (1 + 1e-9), config  # a bound: never past the brute-forced best
        bounded += math.isfinite(found.bound_s) and math.isfinite(step)
        tighter += found.bound_s > lower_bound_s(table, allowed, budget, cuts_ok) * (1 + 1e-6)
        if (plan := found.plan()) is not None:
            stages, choices, prediction = plan
            assert max(prediction.memory_per_rank_bytes) <= budget, config
            assert _keeps_rules(table, list(stages), list(choices), cuts_ok), config
            assert prediction.step_time_s == pytest.approx(evaluate(table, stages, choices).step_time_s, rel=1e-12)
            assert prediction.step_time_s >= step * (1 - 1e-9), config  # no plan beats the best
            if prediction.step_time_s <= found.bound_s:  # proved without a solve: then it is the best
                assert prediction.step_time_s == pytest.approx(step, rel=1e-9)
            # the hint is a solution of the configuration's CP-SAT model, at the step evaluate gives it
            prepared = prepare(table, allowed, free, cuts_ok, budget)
            hint_plan(prepared.built, table, prepared.runs, stages, choices)
            solver = cp_solver(5.0, SolverOptions())
            solver.parameters.fix_variables_to_their_hinted_value = True
            assert solver.Solve(prepared.built.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE), config
            objective = solver.ObjectiveValue() * prepared.units.unit_s / prepared.built.scale
            assert objective == pytest.approx(prediction.step_time_s, rel=1e-4), config
            planned += 1
    assert bounded and planned  # the programme bounded and planned configurations that have plans
    assert tighter or mem >= 80  # and where memory binds, bounded some tighter than the search's bound
