"""The bounds branch and bound skips configurations by: never above what a configuration's own optimum is."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model
from test_solver_properties import layer_graphs

from autopar.cost_models.hardware import PRESETS, GiB
from autopar.pins import Pins
from autopar.planning import solver as search
from autopar.planning.bounds import lower_bound_s, pooled_bound_s
from autopar.planning.choices import allowed_choices
from autopar.planning.configs import cut_positions, enumerate_configs
from autopar.planning.configuration import TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.model import SolverOptions, cp_solver, extract
from autopar.planning.order import BoundOrder


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=layer_graphs(), preset=st.sampled_from(["a100-40g", "h100-80g", "cpu"]),
       world=st.sampled_from([2, 4, 8]), memory_gib=st.floats(1, 80))
def test_bounds_never_exceed_a_configurations_optimum(graph, preset, world, memory_gib):
    """Every configuration solved to optimality on its own: its step is at least its pooled bound (the key
    that orders the search, with the exposed data-parallel tail in it) and its full bound (which skips it)."""
    cluster = PRESETS[preset].for_world_size(world)
    training, budget, cuts = TrainingSpec(world * 2, "bf16"), int(memory_gib * GiB), cut_positions(graph)
    layer_pins = [{} for _ in graph]
    for config in enumerate_configs(graph, world, cluster, training, Pins())[:12]:
        table = search.PriceTable(graph, config, cluster, training)
        allowed = allowed_choices(table, layer_pins)
        if any(not ks for ks in allowed):
            continue
        prepared = search._prepare(table, allowed, layer_pins, cuts, budget)
        solver = cp_solver(10.0, SolverOptions())
        status = solver.Solve(prepared.built.model)
        pooled, full = pooled_bound_s(table, allowed, budget, cuts), lower_bound_s(table, allowed, budget, cuts)
        if status == cp_model.INFEASIBLE:
            continue
        assert status == cp_model.OPTIMAL
        step = evaluate(table, *extract(solver, prepared.built, table, prepared.runs)).step_time_s
        assert pooled <= step * (1 + 1e-6) and full <= step * (1 + 1e-6), (config, pooled, full, step)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=layer_graphs(), world=st.sampled_from([2, 4, 8, 16]), memory_gib=st.floats(1, 80))
def test_configurations_come_best_bound_first(graph, world, memory_gib):
    """The order yields every configuration some strategy runs, once each, by nondecreasing pooled bound."""
    cluster = PRESETS["h100-80g"].for_world_size(world)
    training, budget, cuts = TrainingSpec(world * 2, "bf16"), int(memory_gib * GiB), cut_positions(graph)
    layer_pins = [{} for _ in graph]
    configs = enumerate_configs(graph, world, cluster, training, Pins())
    keys = [(key, config) for key, config, table, allowed in
            BoundOrder(graph, configs, cluster, training, layer_pins, budget, cuts)]
    assert all(a[0] <= b[0] for a, b in zip(keys, keys[1:]))
    assert sorted(c for _, c in keys) == sorted(configs)
    for key, config in keys:
        table = search.PriceTable(graph, config, cluster, training)
        assert math.isclose(key, max(key, pooled_bound_s(table, allowed_choices(table, layer_pins), budget, cuts)))
