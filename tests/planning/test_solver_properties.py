"""Property tests: every plan the solver returns is a valid plan within the memory budget."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cost_models.hardware import GiB
from autopar.cost_models.presets import PRESETS
from autopar.errors import InfeasibleError
from autopar.graph import Layer, LayerGraph
from autopar.planning.configuration import TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.solver import SolverOptions, cut_positions, solve
from autopar.tp_style import TPStyle


@st.composite
def layer_graphs(draw) -> LayerGraph:
    n = draw(st.integers(1, 7))
    layers = []
    for i in range(n):
        params = draw(st.integers(0, 2_000_000_000))
        flops = draw(st.floats(0, 1e12))
        styles = ()
        if params and draw(st.booleans()):
            heads = draw(st.sampled_from([1, 2, 4, 8, 12, 16]))
            styles = (TPStyle("megatron", divisors=(heads,), sharded_params=draw(st.integers(0, params)),
                              sharded_flops_per_sample=flops * draw(st.floats(0, 1)),
                              sharded_activation_elems_per_sample=draw(st.floats(0, 1e7)),
                              fwd_allreduce_elems=draw(st.floats(0, 1e7)), fwd_allreduce_count=2,
                              bwd_allreduce_elems=draw(st.floats(0, 1e7)), bwd_allreduce_count=2,
                              sequence=(2, 4, 8) if draw(st.booleans()) else (), sequence_linked=True,
                              sequence_gathers=2, sequence_gather_elems=draw(st.floats(0, 1e7)),
                              sequence_grad_sums=4, sequence_grad_sum_elems=draw(st.integers(0, 10_000)),
                              sequence_stream_elems=draw(st.floats(0, 1e7))),)
        layers.append(Layer(
            f"layer{i}", i, "Block", flops_per_sample=flops, param_count=params, param_bytes=2 * params,
            activation_bytes_per_sample=draw(st.floats(0, 1e9)),
            input_bytes_per_sample=draw(st.floats(0, 1e8)),
            boundary_bytes_per_sample=draw(st.floats(0, 1e8)) if i < n - 1 else 0.0,
            can_cut_after=i < n - 1 and draw(st.booleans()), tp_styles=styles,
        ))
    return LayerGraph(layers, model_name="random", example_batch=1, dtype_bytes=2)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=layer_graphs(), preset=st.sampled_from(["a100-40g", "h100-80g", "v100-16g", "cpu"]),
       world=st.sampled_from([1, 2, 4, 8, 16, 32]), per_rank=st.integers(1, 4),
       memory_gib=st.floats(0.5, 80), dtype=st.sampled_from(["bf16", "fp32"]))
def test_every_plan_is_valid_and_fits(graph, preset, world, per_rank, memory_gib, dtype):
    base = PRESETS[preset]
    cluster = replace(base, device=replace(base.device, memory_bytes=int(memory_gib * GiB)))
    cluster = cluster.for_world_size(world)
    training = TrainingSpec(world * per_rank, dtype)
    try:
        sol = solve(graph, world, cluster, training, options=SolverOptions(time_limit_s=20))
    except InfeasibleError as exc:
        assert exc.binding == "memory" and exc.min_memory_bytes > cluster.memory_budget_bytes
        return
    c = sol.config
    assert c.mesh.pp * c.mesh.dp * c.mesh.tp == world
    assert c.mesh.dp * c.microbatches * sol.table.microbatch_size == training.global_batch
    assert c.mesh.tp == 1 or cluster.gpus_per_node % c.mesh.tp == 0
    stages = list(sol.stages)
    assert stages[0] == 0 and stages[-1] == c.stages - 1
    assert all(b - a in (0, 1) for a, b in zip(stages, stages[1:]))  # contiguous, none skipped
    allowed = set(cut_positions(graph))
    assert all(q in allowed for q in range(1, len(stages)) if stages[q] != stages[q - 1])
    for layer, s in zip(graph, sol.choices):
        assert s.tp is None or layer.tp_style(s.tp).admits(c.mesh.tp)
        assert not s.sp or layer.tp_style(s.tp).admits_sequence(c.mesh.tp)
    again = evaluate(sol.table, sol.stages, sol.choices)
    assert again == sol.prediction
    assert max(again.memory_per_rank_bytes) <= cluster.memory_budget_bytes
    assert sol.status == "OPTIMAL" or sol.gap > 0


def test_least_integer_time_is_the_least_over_every_count_mix() -> None:
    """The bounds' exact rank time (with its early stop) against enumerating every mix of counts."""
    import itertools
    import math
    import random

    from autopar.planning.bounds import _frontier, _least_integer_time

    rng = random.Random(0)
    for _ in range(300):
        points = [(rng.randint(1, 60), rng.uniform(1.0, 10.0)) for _ in range(rng.randint(2, 6))]
        front = _frontier(points)
        n, room = rng.randint(1, 6), rng.randint(1, 400)
        best = min((sum(front[k][1] for k in mix)
                    for mix in itertools.combinations_with_replacement(range(len(front)), n)
                    if sum(front[k][0] for k in mix) <= room), default=math.inf)
        got = _least_integer_time(front, room, n)
        assert got == best or math.isclose(got, best, rel_tol=1e-12), (front, room, n)
