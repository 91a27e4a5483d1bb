"""The solver finds the cheapest plan of the cost model: checked against brute force (``tests/brute_force.py``).

The brute force shares only the price table and `evaluate` with the solver: it
enumerates every configuration, every placement of pipeline cuts and every
strategy (dominated or not) of every layer — where the solver chooses the root
units' one ZeRO stage, each stage in turn (the contract runs every root unit at
one stage) — and keeps the fastest plan whose every rank fits in the budget.
"""

from __future__ import annotations

import math

import pytest
from brute_force import brute_force, config_best, configs_and_root_stages, tiny_cluster
from ortools.sat.python import cp_model
from synthetic import transformer_graph

from autopar.cost_models.hardware import GiB
from autopar.cost_models.presets import PRESETS
from autopar.errors import InfeasibleError, PinError
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.planning.bounds import lower_bound_s
from autopar.planning.choices import allowed_choices
from autopar.planning.configuration import TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.pricing import PriceTable
from autopar.planning.solver import SolverOptions, cut_positions, enumerate_configs, solve

CASES = [
    # (blocks, hidden, seq, world, gpus per node, batch, memory GiB, cores per node)
    (2, 1024, 512, 2, 2, 4, 80, 0),  # ample memory
    (2, 2048, 1024, 4, 4, 8, 6, 0),  # tight: needs sharding or recompute
    (3, 1024, 1024, 4, 2, 8, 3, 0),  # spans two nodes, tight
    (4, 512, 256, 8, 4, 8, 80, 0),  # six layers, world 8
    (4, 2048, 2048, 8, 8, 8, 2.5, 0),  # six layers, very tight
    (4, 512, 256, 8, 8, 8, 80, 2),  # 8 ranks sharing 2 cores: waiting pipeline ranks lend them
    (3, 1024, 1024, 4, 4, 8, 3, 2),  # 4 ranks sharing 2 cores, tight
]


@pytest.mark.parametrize("blocks,hidden,seq,world,gpus,batch,mem,cores", CASES)
@pytest.mark.slow
def test_solver_matches_brute_force(blocks, hidden, seq, world, gpus, batch, mem, cores):
    graph = transformer_graph(blocks, hidden, seq, vocab=8192, heads=16)
    cluster = tiny_cluster(mem, gpus, cores).for_world_size(world)
    training = TrainingSpec(batch, "bf16")
    budget = cluster.memory_budget_bytes
    expected = brute_force(graph, world, cluster, training, budget)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            solve(graph, world, cluster, training)
        return
    solution = solve(graph, world, cluster, training, options=SolverOptions(time_limit_s=60))
    assert solution.status == "OPTIMAL"
    assert solution.prediction.step_time_s == pytest.approx(expected, rel=1e-5)
    assert max(solution.prediction.memory_per_rank_bytes) <= budget


@pytest.mark.parametrize("blocks,hidden,seq,world,gpus,batch,mem,cores", CASES[1:4])
@pytest.mark.slow
def test_each_configuration_s_bound_is_at_most_its_best_plan(blocks, hidden, seq, world, gpus, batch, mem, cores,
                                                            monkeypatch):
    """The bounds the search prunes by (the tail's knapsack among them) never exceed what a configuration's
    best plan takes, the zero-bubble schedules' (w simulated) among them: an unsound bound would prune the
    optimum where brute force finds it."""
    from autopar.planning import configs

    monkeypatch.setattr(configs, "SEARCH_SPLIT_BACKWARD", True)  # searched by default; held so here
    monkeypatch.setattr(configs, "split_proven", lambda mesh: True)  # on tp meshes too, as a pin plans them
    graph = transformer_graph(blocks, hidden, seq, vocab=8192, heads=16)
    cluster = tiny_cluster(mem, gpus, cores).for_world_size(world)
    training = TrainingSpec(batch, "bf16")
    budget, cuts_ok, free = cluster.memory_budget_bytes, cut_positions(graph), Pins().resolve_layers(
        [layer.name for layer in graph])
    best: dict = {}
    for config, root_zero in configs_and_root_stages(graph, world, cluster, training):
        table = PriceTable(graph, config, cluster, training)
        key = config, config.schedule  # configurations equal but for the schedule compare equal
        best[key] = min(best.get(key, (math.inf, table))[0], config_best(table, root_zero, budget)), table
    fit, split = 0, 0
    for (config, _), (step, table) in best.items():
        bound = lower_bound_s(table, allowed_choices(table, free), budget, cuts_ok)
        assert bound <= step * (1 + 1e-9), config  # nan fails here too: a heap keyed by it loses its order
        fit += math.isfinite(step)
        split += math.isfinite(step) and config.schedule.split_backward
    assert fit and split  # configurations with a plan were compared, the split-backward schedules' among them


def test_same_inputs_same_plan():
    graph = transformer_graph(8, 2048, 1024, vocab=32768, heads=16)
    cluster = PRESETS["a100-40g"].for_world_size(32)
    runs = [solve(graph, 32, cluster, TrainingSpec(64)) for _ in range(2)]
    assert runs[0].config == runs[1].config
    assert runs[0].stages == runs[1].stages and runs[0].choices == runs[1].choices


@pytest.mark.parametrize("blocks,hidden,seq,world,batch,preset", [
    (32, 8192, 2048, 64, 128, "a100-40g"), (16, 4096, 2048, 32, 64, "a100-40g"),
    (40, 8192, 4096, 128, 256, "a100-40g")])
@pytest.mark.slow
def test_overlapped_solves_decide_as_the_sequential_search(blocks, hidden, seq, world, batch, preset):
    """The next configuration is prepared while a solve runs in a thread; the plan and how many configurations
    were solved are the sequential search's (runners-up, solved in what wall time is left, are left out)."""
    graph = transformer_graph(blocks, hidden, seq, vocab=32768, heads=32)
    cluster = PRESETS[preset].for_world_size(world)
    runs = [solve(graph, world, cluster, TrainingSpec(batch, "bf16"), options=SolverOptions(overlap=overlap),
                  runners_up=0) for overlap in (False, True)]
    sequential, overlapped = runs
    assert sequential.configs_solved > 1  # more than one configuration went through CP-SAT
    assert (overlapped.config, overlapped.stages, overlapped.choices) == \
        (sequential.config, sequential.stages, sequential.choices)
    assert overlapped.configs_solved == sequential.configs_solved


@pytest.mark.slow
def test_the_search_solves_best_first_and_only_what_could_beat_the_plan(monkeypatch):
    """A configuration goes to CP-SAT only when its full bound is the least key the search holds: the bounds
    it solves at come in rising order, each below the plan chosen (a higher one can only be a runner-up;
    that the plan is the cheapest is test_solver_matches_brute_force's)."""
    from autopar.planning import solves as solves_module

    graph = transformer_graph(40, 8192, 4096, vocab=32768, heads=32)  # its search solves several configurations
    cluster = PRESETS["a100-40g"].for_world_size(128)
    bounds = []
    real = solves_module.InFlight.submit

    def submit(self, search, later, prepared, time_limit_s, options, entry):
        bounds.append(entry[4])
        return real(self, search, later, prepared, time_limit_s, options, entry)

    monkeypatch.setattr(solves_module.InFlight, "submit", submit)
    plan = solve(graph, 128, cluster, TrainingSpec(256, "bf16"), runners_up=0)
    assert len(bounds) > 1 and bounds == sorted(bounds)
    assert all(b < plan.prediction.step_time_s * (1 + 1e-9) for b in bounds)


@pytest.mark.slow
def test_solves_that_run_out_are_solved_again_until_the_plan_is_proved(monkeypatch):
    """Every configuration's first solve starved (it stops before CP-SAT can prove anything): each is solved
    again, held to the plans found since (solves.solve_deferred), until proved or ruled out by its bound,
    so the plan is the one the plain search proves, and it is OPTIMAL."""
    from autopar.planning import solves as solves_module

    graph = transformer_graph(32, 8192, 2048, vocab=32768, heads=64)
    cluster = PRESETS["a100-40g"].for_world_size(64)
    plain = solve(graph, 64, cluster, TrainingSpec(128, "bf16"), runners_up=0)
    real, seconds = solves_module.cp_solver, []

    def starved(time_limit_s, options, again=False):
        solver = real(time_limit_s, options, again)
        seconds.append(again)
        if not again:
            solver.parameters.max_deterministic_time = 1e-9
        return solver

    monkeypatch.setattr(solves_module, "cp_solver", starved)
    cut = solve(graph, 64, cluster, TrainingSpec(128, "bf16"), runners_up=0)
    assert plain.config.mesh.pp > 1 and plain.status == cut.status == "OPTIMAL"
    assert cut.prediction.step_time_s == pytest.approx(plain.prediction.step_time_s, rel=1e-9)
    assert any(seconds)  # configurations were solved a second time


def test_a_plan_cp_sat_presolve_refutes_is_found_by_searching_again() -> None:
    """OR-Tools 9.15.6755's presolve calls some feasible models infeasible (google/or-tools#5274). This graph,
    found by test_solver_properties.py, is one: no compute, a pipeline cut, FSDP2 buffers and the root units'
    one ZeRO stage, and every configuration "INFEASIBLE" under a budget its own least-memory plan fits. The
    search, finding no plan where one fits, searches again without presolve's inclusion detection."""
    from dataclasses import replace

    from autopar.graph import Layer
    from autopar.pins import Pins
    from autopar.planning.model import cp_solver
    from autopar.planning.solves import prepare
    from autopar.tp_style import TPStyle

    style = TPStyle("megatron", divisors=(1,), sharded_params=0, sharded_flops_per_sample=0.0,
                    sharded_activation_elems_per_sample=0.0, fwd_allreduce_elems=0.0, fwd_allreduce_count=2,
                    bwd_allreduce_elems=0.0, bwd_allreduce_count=2, sequence=(), sequence_linked=True)
    shapes = [(0, 456_320_082.0, False, ()), (309_899, 0.0, False, (style,)), (18_154, 809_998_107.0, True, (style,)),
              (226, 0.0, False, (style,)), (1_218_930_998, 0.0, False, ()), (0, 0.0, False, ())]
    graph = LayerGraph([Layer(f"layer{i}", i, "Block", flops_per_sample=0.0, param_count=n, param_bytes=2 * n,
                              activation_bytes_per_sample=act, input_bytes_per_sample=0.0,
                              boundary_bytes_per_sample=0.0, can_cut_after=cut, tp_styles=styles)
                        for i, (n, act, cut, styles) in enumerate(shapes)], model_name="random", example_batch=1,
                       dtype_bytes=2)
    base = PRESETS["a100-40g"]
    cluster = replace(base, device=replace(base.device, memory_bytes=29_527_900_160),  # the budget it was found at
                      allocator_overhead_fraction=0.10).for_world_size(16)
    training = TrainingSpec(16, "fp32")
    # 1F1B pinned: the configuration presolve refutes (the search now also weighs the zero-bubble schedules,
    # whose least-time plan here, pp=2 × dp=8 under interleaved_zb, presolve does not refute)
    plan = solve(graph, 16, cluster, training, pins=Pins.parse(["schedule=1f1b"]))
    assert max(plan.prediction.memory_per_rank_bytes) <= cluster.memory_budget_bytes
    # the configuration it plans, solved with presolve as it is: refuted, though the plan above fits
    table = PriceTable(graph, plan.config, cluster, training)
    prepared = prepare(table, allowed_choices(table, [{}] * len(graph)), [{}] * len(graph), cut_positions(graph),
                       cluster.memory_budget_bytes)
    refuted = cp_solver(20, SolverOptions()).Solve(prepared.built.model)
    assert refuted == cp_model.INFEASIBLE, "OR-Tools presolve now solves it: SolverOptions.presolve_inclusion may go"


def test_rediscovers_data_parallel_when_memory_is_ample():
    graph = transformer_graph(4, 512, 256, vocab=8192, heads=8)  # a small model on big GPUs
    cluster = PRESETS["a100-80g"].for_world_size(8)
    solution = solve(graph, 8, cluster, TrainingSpec(64))
    assert (solution.config.mesh.pp, solution.config.mesh.tp) == (1, 1)
    assert solution.config.mesh.dp == 8


def test_shards_when_memory_is_tight():
    graph = transformer_graph(24, 4096, 2048, vocab=50304, heads=32)  # ~5B parameters
    cluster = PRESETS["a100-40g"].for_world_size(16)
    solution = solve(graph, 16, cluster, TrainingSpec(32))
    # Plain DP would need 16 bytes per parameter (~80 GB): the plan must shard states.
    assert any(s.zero >= 1 or s.tp for s in solution.choices) or solution.config.mesh.pp > 1
    assert max(solution.prediction.memory_per_rank_bytes) <= cluster.memory_budget_bytes


@pytest.mark.slow
def test_tensor_parallel_stays_inside_a_node():
    graph = transformer_graph(8, 8192, 2048, vocab=50304, heads=64)
    cluster = PRESETS["a100-80g"].for_world_size(64)
    solution = solve(graph, 64, cluster, TrainingSpec(64))
    assert cluster.gpus_per_node % solution.config.mesh.tp == 0


def test_pins_are_obeyed():
    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    cluster = PRESETS["a100-80g"].for_world_size(8)
    pins = Pins.parse(["pp=2", "tp=2", "microbatches=4", "schedule=1f1b", "blocks.*:zero=3",
                       "blocks.0:stage=0", "head:recompute=on"])
    solution = solve(graph, 8, cluster, TrainingSpec(16), pins=pins)
    c = solution.config
    assert (c.mesh.pp, c.mesh.dp, c.mesh.tp, c.microbatches, c.schedule.name) == (2, 2, 2, 4, "1f1b")
    names = [l.name for l in graph]
    for name, s in zip(names, solution.choices):
        if name.startswith("blocks."):
            assert s.zero == 3
    assert solution.stages[names.index("blocks.0")] == 0
    assert solution.choices[names.index("head")].recompute


def test_everything_pinned_prices_the_hand_made_plan():
    graph = transformer_graph(2, 1024, 512, vocab=8192, heads=16)
    cluster = PRESETS["a100-80g"].for_world_size(4)
    pins = Pins.parse(["pp=1", "dp=4", "tp=1", "microbatches=1", "zero=0", "recompute=none"])
    solution = solve(graph, 4, cluster, TrainingSpec(8), pins=pins)
    table = solution.table
    again = evaluate(table, solution.stages, solution.choices)
    assert again.step_time_s == solution.prediction.step_time_s
    assert all(s.zero == 0 and not s.recompute and s.tp is None for s in solution.choices)


def test_infeasible_names_memory_and_the_least_that_fits():
    graph = transformer_graph(4, 4096, 2048, vocab=50304, heads=32)
    cluster = PRESETS["a100-80g"].for_world_size(2)
    with pytest.raises(InfeasibleError) as err:
        solve(graph, 2, cluster, TrainingSpec(2), memory_budget_bytes=1 * GiB)
    assert err.value.binding == "memory"
    assert err.value.min_memory_bytes > 1 * GiB
    assert "per rank at best" in str(err.value) and "budget 1.00 GiB" in str(err.value)
    # and the reported minimum does fit
    solution = solve(graph, 2, cluster, TrainingSpec(2), memory_budget_bytes=err.value.min_memory_bytes)
    assert max(solution.prediction.memory_per_rank_bytes) <= err.value.min_memory_bytes


@pytest.mark.parametrize("pins,message", [
    (["tp=3"], "not a multiple"),
    (["pp=2", "dp=2", "tp=1"], "world size is 8"),
    (["pp=8"], "pipeline stages"),
    (["dp=8", "microbatches=3"], "does not divide"),
    (["nosuch.*:zero=1"], "names no layer"),
    (["zero=3", "blocks.*:zero=1"], "contradict"),
    (["blocks.1:stage=0", "blocks.0:stage=1"], "backwards"),
    (["blocks.0:tp=colwise", "tp=2"], "no tensor-parallel style"),
    (["pp=1", "schedule=1f1b"], "contradict"),
])
def test_bad_pins_are_named(pins, message):
    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    cluster = PRESETS["a100-80g"].for_world_size(8)
    with pytest.raises(PinError, match=message):
        solve(graph, 8, cluster, TrainingSpec(16), pins=Pins.parse(pins))


def test_reprice_keeps_every_choice_and_prices_on_another_cluster():
    import autopar
    from autopar.errors import PlanError

    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=16)
    plan = autopar.solve(graph, 8, cluster="a100-80g", global_batch=32)
    same = autopar.reprice(graph, plan)
    assert same.predicted == plan.predicted and same.layers == plan.layers
    slower = autopar.reprice(graph, plan, "v100-16g", memory_gb=80)
    assert (slower.mesh, slower.layers, slower.microbatches) == (plan.mesh, plan.layers, plan.microbatches)
    assert slower.cluster.name == "v100-16g"
    assert slower.predicted.step_time_s > plan.predicted.step_time_s  # a slower device
    pinned = [f"pp={plan.mesh.pp}", f"dp={plan.mesh.dp}", f"tp={plan.mesh.tp}",
              f"microbatches={plan.microbatches}", f"schedule={plan.schedule.value}"] + [
        f"{l.name}:stage={l.stage}" for l in plan.layers] + [
        f"{l.name}:tp={l.choice.tp or 'none'}" for l in plan.layers] + [
        f"{l.name}:zero={l.choice.zero}" for l in plan.layers] + [
        f"{l.name}:recompute={'on' if l.choice.recompute else 'off'}" for l in plan.layers]
    resolved = autopar.solve(graph, 8, cluster="v100-16g", global_batch=32, pins=pinned, memory_gb=80)
    assert resolved.predicted.step_time_s == pytest.approx(slower.predicted.step_time_s)
    with pytest.raises(PlanError):
        autopar.reprice(transformer_graph(2, 1024, 512, vocab=8192, heads=16), plan)


def test_memory_bound_never_exceeds_the_least_peak_a_configuration_reaches():
    from ortools.sat.python import cp_model

    from autopar.planning.bounds import memory_lower_bound as _memory_lower_bound
    from autopar.planning.choices import allowed_choices as _allowed
    from autopar.planning.choices import runs_of as _runs
    from autopar.planning.model import Units as _Units
    from autopar.planning.model import build_model as _build_model
    from autopar.planning.model import cp_solver as _solver

    graph = transformer_graph(4, 1024, 1024, vocab=8192, heads=16)
    cluster, training = tiny_cluster(2, 4).for_world_size(8), TrainingSpec(8, "bf16")
    no_pins = [{} for _ in graph]
    checked = 0
    for config in enumerate_configs(graph, 8, cluster, training, Pins()):
        table = PriceTable(graph, config, cluster, training)
        allowed = _allowed(table, no_pins)
        built = _build_model(table, allowed, _runs(table, allowed, no_pins), no_pins, cut_positions(graph), None,
                             _Units(1.0))
        solver = _solver(10, SolverOptions())
        assert solver.Solve(built.model) == cp_model.OPTIMAL
        assert _memory_lower_bound(table, allowed) <= solver.ObjectiveValue(), config.describe()
        checked += 1
    assert checked >= 10


def test_however_short_the_time_limit_a_plan_that_fits_is_returned():
    """The search is best first, so its first solve may come late; with no plan by half the time limit each
    configuration it examines is solved at once: a spent limit still returns a plan, FEASIBLE unless proved."""
    graph = transformer_graph(4, 1024, 512, vocab=8192, heads=8)
    cluster = PRESETS["a100-80g"].for_world_size(8)
    plan = solve(graph, 8, cluster, TrainingSpec(16), options=SolverOptions(time_limit_s=1e-9))
    assert plan.status in ("FEASIBLE", "OPTIMAL") and plan.configs_solved >= 1
    assert max(plan.prediction.memory_per_rank_bytes) <= cluster.memory_budget_bytes
    full = solve(graph, 8, cluster, TrainingSpec(16))
    assert full.status == "OPTIMAL" and full.prediction.step_time_s <= plan.prediction.step_time_s * (1 + 1e-9)


def test_a_spent_time_limit_never_blames_pins_that_were_not_given():
    """Megatron's 1T row without tensor parallelism: bounding its thousand configurations spent the
    time limit, no solve ran, and the unpinned search said the pins conflict. However short the
    limit, the least memory is still found for the most promising configuration, and said to be the least
    found, not the least there is (configurations were left unexamined); given the time, it is proved."""
    graph = transformer_graph(4, 4096, 2048, vocab=50304, heads=32)
    cluster = PRESETS["a100-80g"].for_world_size(2)
    with pytest.raises(InfeasibleError) as err:
        solve(graph, 2, cluster, TrainingSpec(2), memory_budget_bytes=1 * GiB,
              options=SolverOptions(time_limit_s=1e-9))
    assert err.value.binding == "time", str(err.value)
    assert "pins" not in str(err.value) and err.value.min_memory_bytes > 1 * GiB
    assert "is not proved least" in str(err.value) and "--time-limit" in str(err.value)
    with pytest.raises(InfeasibleError) as proved:
        solve(graph, 2, cluster, TrainingSpec(2), memory_budget_bytes=1 * GiB)
    assert proved.value.binding == "memory" and "at best" in str(proved.value)
    assert proved.value.min_memory_bytes <= err.value.min_memory_bytes
