"""What ep refuses before any collective (passes/expert_parallel.check_expert_parallel), and the contract's
engine under ep: no process group needed."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.contract import REPLICATED, Engine, plan_engine
from autopar.errors import LoweringError
from autopar.mesh import Mesh
from autopar.passes.expert_parallel import check_expert_parallel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
import moe_cases  # noqa: E402


def _examples_moe():
    spec = importlib.util.spec_from_file_location("autopar_examples_moe_ep", ROOT / "examples" / "moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(model, inputs, ep: int, pins: tuple[str, ...] = ("zero=0",), dtype: str = "fp32"):
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, 2, cluster="cpu", dtype=dtype, global_batch=4,
                         pins=["pp=1", "dp=2", "tp=1", "recompute=none", "microbatches=1", *pins])
    return dataclasses.replace(plan, mesh=plan.mesh.replace(ep=ep)), graph


@pytest.fixture(scope="module")
def mixtral():
    torch.manual_seed(0)
    return moe_cases.hf_mixtral()


@pytest.mark.slow
def test_hf_fused_experts_pass_the_checks(mixtral) -> None:
    plan, graph = _plan(*mixtral, ep=2)
    check_expert_parallel(mixtral[0], graph, plan)  # raises nothing
    check_expert_parallel(mixtral[0], graph, dataclasses.replace(plan, mesh=Mesh(dp=4, ep=4), world_size=4))


@pytest.mark.slow
def test_ep_not_dividing_the_experts_names_the_layer(mixtral) -> None:
    plan, graph = _plan(*mixtral, ep=1)
    plan = dataclasses.replace(plan, mesh=Mesh(dp=6, ep=3), world_size=6)
    with pytest.raises(LoweringError, match=r"layer 'model.layers.0': ep=3 does not divide its 4 experts"):
        check_expert_parallel(mixtral[0], graph, plan)


@pytest.mark.slow
def test_hand_written_module_list_experts_pass_where_their_loop_is_proved_and_a_dropping_capacity_is_refused() -> None:
    """A module list run by the block's own loop (examples/moe.py's LoopMoE, the hand-written Mixtral of
    tests/moe_cases.py) passes: its loop is rerouted (passes/expert_list.py) and proved so at capture and
    here; so does a capacity block that can drop tokens (per rank, as under dp)."""
    moe = _examples_moe()
    for model, inputs in (moe.loop_moe_tiny(), moe_cases.hand_mixtral()):
        plan, graph = _plan(model, inputs, ep=2)
        assert all(m.reroute_refusal == "" and not m.ep_refusal for layer in graph for m in layer.moe)
        check_expert_parallel(model, graph, plan)  # raises nothing
    # examples/moe.py's CapacityMoE (3-D weights of its own, one-hot einsums) can drop tokens (capacity
    # factor 1.25 × top-2 < 4 experts): dp splits its batch (capacity per dp rank, batch_coupled=auto), and
    # so does ep, each rank dispatching its own tokens with its own capacity (passes/expert_capacity.py;
    # trained against the same splits in tests/runtime/test_batch_coupling.py)
    model, inputs = moe.capacity_moe_tiny()
    plan, graph = _plan(model, inputs, ep=2)
    check_expert_parallel(model, graph, plan)  # raises nothing


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.w(x) * scale


class _TwoArgumentMoE(torch.nn.Module):
    """A module-list MoE whose loop calls each expert with its rows and their router weights: not one
    [rows, hidden] tensor per call, so ep cannot reroute it."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 1
        self.gate = torch.nn.Linear(32, 4, bias=False)
        self.experts = torch.nn.ModuleList(_Scaled() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weight, chosen = torch.softmax(self.gate(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token = torch.where(chosen == e)[0]
            out = out.index_add(0, token, expert(flat[token], weight[token, None]))
        return out.reshape(x.shape)


def test_a_module_list_loop_ep_cannot_prove_is_refused_naming_the_layer_and_the_reason() -> None:
    from autopar.errors import PinError

    moe = _examples_moe()
    torch.manual_seed(0)
    model = moe.MoEGPT(**moe.TINY, make_moe=_TwoArgumentMoE)
    inputs = (torch.randint(0, moe.TINY["vocab"], (2, 16)),)
    plan, graph = _plan(model, inputs, ep=2)
    (facts,) = graph.layer("blocks.0").moe
    why = r"an expert cannot be called on one \[rows, hidden\] tensor \(TypeError: "
    assert facts.reroute_refusal.startswith("an expert cannot be called on one [rows, hidden] tensor (TypeError")
    with pytest.raises(LoweringError, match=r"layer 'blocks.0': ep cannot reroute the loop of 'blocks.0.moe' "
                                            r"\(_TwoArgumentMoE\): " + why):
        check_expert_parallel(model, graph, plan)
    with pytest.raises(PinError, match=r"cannot split every mixture-of-experts block: blocks.0.moe: " + why):
        autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=["ep=2"])


@pytest.mark.slow
def test_the_planner_offers_ep_on_a_proved_module_list_and_prices_its_all_to_alls() -> None:
    """What is priced is what runs: the hand-written Mixtral's ep all-to-alls are priced as the fused
    experts' (tokens × top-k rows each way, plus the counts), and its edp gradient sync as one bucket a
    block."""
    graph = autopar.capture(*moe_cases.hand_mixtral())
    plan = autopar.solve(graph, 4, cluster="cpu", global_batch=8, dtype="fp32", pins=["ep=2", "tp=1", "pp=1"])
    assert plan.mesh.ep == 2 and plan.predicted.breakdown.ep_comm_s > 0


def test_ep_on_a_model_without_experts_names_its_layers() -> None:
    import gpt

    model, inputs = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, device="cpu")
    plan, graph = _plan(model, inputs, ep=2)
    with pytest.raises(LoweringError, match=rf"ep=2 shards experts, but none of the model's {len(graph)} layers"):
        check_expert_parallel(model, graph, plan)


def test_a_replicated_ep_plan_runs_on_ddp_where_dp_is_the_one_axis_above_one() -> None:
    """ep folds into dp: a replicated ep plan over dp alone runs the dense weights on DDP, as without ep
    (the experts left out of it; FSDP2's replicate cost 1.08× a hand-written EP's step); beside tp or
    pp it stays FSDP2's replicate."""
    assert plan_engine(Mesh(dp=2), REPLICATED) is Engine.DDP
    assert plan_engine(Mesh(dp=2, ep=2), REPLICATED) is Engine.DDP
    assert plan_engine(Mesh(dp=2, ep=2, tp=2), REPLICATED) is Engine.REPLICATE
    assert plan_engine(Mesh(pp=2, dp=2, ep=2), REPLICATED) is Engine.REPLICATE


@pytest.mark.slow
def test_ep_pins_the_planner_refuses_in_one_line_naming_the_blocks(mixtral) -> None:
    from autopar.errors import PinError

    graph = autopar.capture(*mixtral)
    with pytest.raises(PinError, match=r"ep=3 does not divide the number of experts \(4 experts in 2 of 2 "
                                       r"mixture-of-experts blocks\)"):
        autopar.solve(graph, 6, cluster="cpu", global_batch=6, pins=["ep=3"])
    with pytest.raises(PinError, match=r"ep=4 does not divide the world size 2"):  # ep borrows dp × cp's ranks
        autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=["dp=2", "ep=4"])
    capacity = autopar.capture(*_examples_moe().capacity_moe_tiny())  # drops tokens: per rank under ep as dp
    assert autopar.solve(capacity, 2, cluster="cpu", global_batch=4, pins=["ep=2"]).mesh.ep == 2
    with pytest.raises(PinError, match=r"blocks.0.moe: capacity factor 1.25 × top-2 < 4 experts drops tokens over "
                                       r"capacity"):
        autopar.solve(capacity, 2, cluster="cpu", global_batch=4, pins=["ep=2", "batch_coupled=exact"])


@pytest.mark.slow
def test_the_planner_offers_ep_where_it_runs_and_prices_it(mixtral) -> None:
    graph = autopar.capture(*mixtral)
    plan = autopar.solve(graph, 4, cluster="cpu", global_batch=8, dtype="fp32", pins=["ep=2", "tp=1"])
    assert plan.mesh.ep == 2 and plan.mesh.dp % 2 == 0 and plan.mesh.pp == 1
    assert "ep=2" in plan.summary().splitlines()[1]
    assert "1/2 of the experts' 24,576 parameters held per rank (ep=2)" in plan.summary()


@pytest.mark.slow
def test_the_planner_offers_ep_with_pp_where_the_stages_call_the_experts(mixtral) -> None:
    """Mixtral's export keeps its layers' module calls ("export-layers"): each pipeline stage calls its
    blocks, so ep reroutes their experts there; a plan solved with ep and pp pinned gets both, its ep
    all-to-alls priced on the stages that hold the MoE blocks."""
    graph = autopar.capture(*mixtral)
    assert graph.tracer == "export-layers"
    plan = autopar.solve(graph, 4, cluster="cpu", global_batch=8, dtype="fp32", pins=["ep=2", "pp=2", "tp=1"])
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.ep) == (2, 2, 2)
    check_expert_parallel(mixtral[0], graph, plan)  # raises nothing
    assert plan.predicted.breakdown.ep_comm_s > 0
    # tp=1: a stage's blocking collectives are its MoE blocks' all-to-alls, on the stages holding them only
    moe = {lp.stage for lp in plan.layers if graph.layer(lp.name).moe}
    assert moe and all((st.forward_tp_s > 0) == (st.stage in moe) for st in plan.predicted.stages)


@pytest.mark.slow
def test_the_free_search_plans_ep_inside_pipeline_stages_where_that_is_fastest(mixtral) -> None:
    """ep with pp is searched without a pin: at 0.4 MB a rank (a budget where the 4 experts held whole, or
    every layer on one rank, cost recomputation) the free search's OPTIMAL plan is pp=2 × dp=4 × ep=4, faster
    than the best plan with either left out (each pinned away), and no note calls ep × pp unsearched."""
    from autopar.cost_models.presets import PRESETS
    from autopar.errors import InfeasibleError
    from autopar.pins import Pins
    from autopar.planning.configs import enumerate_configs
    from autopar.planning.configuration import TrainingSpec

    graph = autopar.capture(*mixtral)
    cluster = PRESETS["cpu"].for_world_size(8)
    free = enumerate_configs(graph, 8, cluster, TrainingSpec(8, "fp32"), Pins.parse([]))
    assert any(c.mesh.ep > 1 and c.mesh.pp > 1 for c in free)
    solve = functools.partial(autopar.solve, graph, 8, cluster="cpu", global_batch=8, dtype="fp32", memory_gb=4e-4)
    plan = solve()
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.ep) == (2, 4, 4) and plan.solver.status == "OPTIMAL"
    check_expert_parallel(mixtral[0], graph, plan)  # raises nothing: the lowering runs it
    assert not any("ep inside pipeline stages" in n or "pin ep" in n for n in plan.notes)
    for pin in ("ep=1", "pp=1"):
        try:
            assert solve(pins=[pin]).predicted.step_time_s > plan.predicted.step_time_s
        except InfeasibleError:
            pass  # nothing fits without it: slower still


@pytest.mark.slow
def test_ep_with_pp_stays_refused_where_the_stages_are_single_aten_graphs(mixtral) -> None:
    """A model whose export could not keep its layers' module calls (tracer "export") runs each stage as
    one ATen graph: no experts module is called there, so ep with pp is refused, with that reason, by the
    planner (pins and search alike) and by the lowering check; ep at pp=1 is still offered."""
    from autopar.contract import ep_refusal
    from autopar.errors import PinError
    from autopar.graph import LayerGraph

    graph = LayerGraph.from_dict({**autopar.capture(*mixtral).to_dict(), "tracer": "export"})
    why = ep_refusal(Mesh(pp=2, dp=2, ep=2), graph)
    assert why is not None and "single ATen graphs" in why and ep_refusal(Mesh(dp=2, ep=2), graph) is None
    with pytest.raises(PinError, match=r"ep=2 with pp=2 cannot run on MixtralForCausalLM: its pipeline stages are "
                                       r"single ATen graphs"):
        autopar.solve(graph, 4, cluster="cpu", global_batch=8, pins=["ep=2", "pp=2"])
    plan = autopar.solve(graph, 4, cluster="cpu", global_batch=8, dtype="fp32", pins=["ep=2", "tp=1"])
    assert plan.mesh.pp == 1 and plan.mesh.ep == 2
    staged = dataclasses.replace(plan, mesh=Mesh(pp=2, dp=2, ep=2))
    with pytest.raises(LoweringError, match=r"single ATen graphs"):
        check_expert_parallel(mixtral[0], graph, staged)


@pytest.mark.slow
def test_each_parts_experts_take_the_zero_stage_the_contract_gives_their_layer(mixtral) -> None:
    """The ep pass reads an MoE layer's ZeRO stage from its part's units: the whole model's, or one
    pipeline stage's (whose plan holds its own layers only), equal to the contract's effective stage
    of that layer in the whole plan, on every part."""
    from autopar.contract import effective_zero, mode_of, plan_layout
    from autopar.passes.expert_parallel import expert_zeros
    from autopar.passes.pipeline import stage_part
    from autopar.runtime.lowering import whole_model_part

    graph = autopar.capture(*mixtral)
    for pins in (["pp=1", "dp=4", "zero=3"], ["pp=1", "dp=4", "zero=1"], ["pp=2", "dp=4", "zero=3"],
                 ["pp=2", "dp=4", "zero=0"], ["pp=2", "dp=4", "model.layers.1:zero=2", "model.layers.0:zero=0"]):
        plan = autopar.solve(graph, 4 * (2 if "pp=2" in pins else 1), cluster="cpu", dtype="fp32", global_batch=8,
                             pins=[*pins, "ep=2", "tp=1", "recompute=none", "microbatches=2"])
        mode = mode_of(graph, plan.mesh.dp, tuple(lp.choice.zero for lp in plan.layers), plan.mesh.pp)
        want = {lp.name: effective_zero(graph, graph.layer(lp.name).index, lp.choice.zero, mode, plan.mesh.dp,
                                        plan.mesh.pp) for lp in plan.layers if graph.layer(lp.name).moe}
        if plan.mesh.pp == 1:
            parts = [whole_model_part(graph, plan)]
        else:
            layout = plan_layout(graph, plan)
            parts = [stage_part(graph, plan, layout, k, True) for k in range(plan.stages)]
        got = {}
        for part in parts:
            got |= expert_zeros(graph, dataclasses.replace(plan, layers=part.layers), part.units)
        assert got == want and set(want) == {"model.layers.0", "model.layers.1"}, (pins, got, want)
