"""The memory screen (``planning/memory_floor.py``): the least memory a configuration's pipeline ranks hold
together, read from the functions pricing prices memory with, its times unpriced. On Hugging Face Llama and
Mixtral captured on the meta device, over configurations with cp inside pipeline stages, tp (sequence
parallel too), every ZeRO stage, every recompute and ep: it equals what the priced rows give, no plan's
memory is below it, and the search with it chooses what the search without it chooses, runners-up and
infeasible messages alike."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cost_models.presets import PRESETS
from autopar.errors import InfeasibleError
from autopar.pins import Pins
from autopar.planning import solver
from autopar.planning.choices import allowed_choices, runs_of
from autopar.planning.configs import enumerate_configs
from autopar.planning.configuration import TrainingSpec
from autopar.planning.memory_floor import memory_floor_bytes
from autopar.planning.model import SolverOptions, Units, build_model, cp_solver
from autopar.planning.pricing import PriceTable
from autopar.planning.shared_prices import SharedPrices

S = 256


def _capture(cls: str, config: str, **cfg):
    import transformers

    cfg = getattr(transformers, config)(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=256, max_position_embeddings=S,
                                        use_cache=False, tie_word_embeddings=False, **cfg)
    with torch.device("meta"):
        model = getattr(transformers, cls)(cfg)
    return autopar.capture(model, (torch.zeros(1, S, dtype=torch.long, device="meta"),))


@pytest.fixture(scope="module")
def llama():
    return _capture("LlamaForCausalLM", "LlamaConfig")


@pytest.fixture(scope="module")
def mixtral():
    return _capture("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)


def _pooled_least(table: PriceTable) -> int:
    """What the priced rows give: each layer at its least memory over every priced choice, on the rank
    with the fewest microbatches in flight, and every rank's workspace (the knapsack bound's test)."""
    pp = table.config.mesh.pp
    rank = min(range(pp), key=lambda j: table.in_flight[j])
    least = [min(table.memory_coefficient(i, k, rank) for k in range(len(row))) for i, row in enumerate(table.choices)]
    return (sum(least)
            + sum(table.rank_workspace_bytes(j) for j in range(pp)))


def _least_peak(table: PriceTable) -> int:
    """The least peak memory of any plan of the configuration: its CP-SAT model solved for memory (as
    ``planning.infeasible`` does), counting FSDP2's buffers and every rank's own layers."""
    free = [{}] * len(table.graph)
    allowed = allowed_choices(table, free)
    built = build_model(table, allowed, runs_of(table, allowed, free), free, solver.cut_positions(table.graph),
                        None, Units(1.0))
    cp = cp_solver(10.0, SolverOptions())
    assert cp.Solve(built.model) == 4  # OPTIMAL
    return int(cp.ObjectiveValue())


CASES = [("llama", 8, ["pp=2"]), ("llama", 8, ["pp=1"]), ("mixtral", 8, ["pp=2"]), ("mixtral", 8, ["pp=1", "tp=1"])]


@pytest.mark.slow
def test_the_floor_is_the_priced_rows_least_and_no_plan_holds_less(llama, mixtral) -> None:
    graphs = {"llama": llama, "mixtral": mixtral}
    seen = set()
    for name, world, pins in CASES:
        graph, cluster = graphs[name], PRESETS["h100-80g"].for_world_size(world)
        training, shared = TrainingSpec(8, dtype="bf16"), SharedPrices()
        configs = enumerate_configs(graph, world, cluster, training, Pins.parse(pins))
        for n, config in enumerate(configs):
            floor = memory_floor_bytes(PriceTable(graph, config, cluster, training, shared))
            own = PriceTable(graph, config, cluster, training)  # priced on its own, no screen's memo shared
            assert floor == _pooled_least(own), config
            if n % 7 == 0:  # CP-SAT's least peak on a sample: pp ranks at that peak hold at least the floor
                assert config.mesh.pp * _least_peak(own) >= floor, config
            m = config.mesh
            seen |= {k for k, on in [("cp×pp", m.cp > 1 and m.pp > 1), ("tp", m.tp > 1), ("ep", m.ep > 1),
                                     ("zero", config.data_parallel.sharded),
                                     ("interleaved", config.schedule.chunks > 1),
                                     ("sp", any(c.sp for row in own.choices for c in row)),
                                     ("recompute", any(len({c.recompute for c in row}) > 2 for row in own.choices))]
                     if on}
    assert seen == {"cp×pp", "tp", "ep", "zero", "interleaved", "sp", "recompute"}


def _solve(graph, world: int, pins: list[str], budget: int, screen: bool, monkeypatch) -> tuple:
    """The search's answer, with or without the screen, and how many configurations the screen dropped."""
    dropped = []
    real = solver._Screen.__call__

    def call(self, cheap, table) -> bool:
        fits = real(self, cheap, table) if screen else True
        dropped.append(not fits)
        return fits

    monkeypatch.setattr(solver._Screen, "__call__", call)
    # without the host's per-op term: these tiny layers are host-bound on an H100, where many choices then cost
    # alike and CP-SAT may return either of two equal plans; the screen's sameness is asked of the choices
    preset = PRESETS["h100-80g"]
    cluster = replace(preset, device=replace(preset.device, op_model=replace(preset.device.op_model, host_op_s=0.0)))
    cluster = cluster.for_world_size(world)
    try:
        # the runners-up's share of the time limit is wall-clock: a long limit lets them all finish
        s = solver.solve(graph, world, cluster, TrainingSpec(8, dtype="bf16"), pins=Pins.parse(pins),
                         memory_budget_bytes=budget, options=SolverOptions(time_limit_s=600.0))
    except InfeasibleError as exc:
        return str(exc), sum(dropped)
    return ((s.config, s.stages, s.choices, s.prediction.step_time_s, s.status, s.configs_total,
             [(r.config, r.step_time_s) for r in s.runners_up]), sum(dropped))


@pytest.mark.parametrize("name, pins, mib", [("llama", ["pp=2"], 6), ("llama", ["cp=2", "pp=2"], 6), ("llama", [], 10),
                                             ("mixtral", [], 20), ("llama", ["model.layers.*:recompute=full"], 10),
                                             ("llama", [], 1)])
@pytest.mark.slow
def test_the_search_with_the_screen_chooses_what_it_chooses_without(llama, mixtral, name, pins, mib,
                                                                    monkeypatch) -> None:
    graph = {"llama": llama, "mixtral": mixtral}[name]
    with_screen, dropped = _solve(graph, 8, pins, mib << 20, True, monkeypatch)
    without, none_dropped = _solve(graph, 8, pins, mib << 20, False, monkeypatch)
    assert with_screen == without and none_dropped == 0
    assert (dropped > 0) == (not any(":" in p for p in pins))  # a layer pin: no screen
    if mib == 1:
        assert with_screen.startswith("no plan fits in memory")
