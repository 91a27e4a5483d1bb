"""torch.compile per block (issue 24's first slice): compiled training matches eager, compiles once,
is priced as compiled, says so in the plan, and is refused for lowerings it does not run yet."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from distributed import every_rank

import autopar
from autopar.errors import CompileError
from autopar.plan import Plan
from autopar.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
GPT = str(ROOT / "examples/gpt.py") + ":gpt_tiny"
EXACT = 1e-5


@pytest.fixture(scope="module")
def graph():
    import gpt

    model, inputs = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="meta")
    return model, inputs, autopar.capture(model, inputs)


# ------------------------------------------------------------------ W = 2, inductor on CPU


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(["ddp", "zero3"], module="compile_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ddp", "zero3"])
def test_compiled_blocks_train_as_one_eager_device(w2: dict, case: str) -> None:
    for m in every_rank(w2[case]):
        assert m["plan_compiled"] and m["compiled"] == ["blocks.0", "blocks.1"]
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
    assert w2["ddp"]["zero"] == [0] and w2["zero3"]["zero"] == [3]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ddp", "zero3"])
def test_the_blocks_share_one_graph_and_later_steps_compile_nothing(w2: dict, case: str) -> None:
    for m in every_rank(w2[case]):
        assert m["graphs"] == [1] * len(m["graphs"]), m
        assert m["guard_failures"] == [] and m["graph_breaks"] == {}


# ------------------------------------------------------------------ the plan says it


def test_a_compiled_solve_offers_no_expert_parallelism_the_compiled_runtime_refuses() -> None:
    """A mixture of experts would take ep on 4 ranks; compiled, the search keeps every axis the compiled
    runtime does not run at 1, so train time never meets a CompileError for what the planner chose."""
    import moe_cases  # tests/ is on the path (conftest)

    g = autopar.capture(*moe_cases.hf_mixtral())
    plan = autopar.solve(g, 4, cluster="cpu", global_batch=8, dtype="fp32", compiled=True, pins=["dp=4"])
    assert (plan.mesh.ep, plan.mesh.cp, plan.mesh.tp, plan.mesh.pp) == (1, 1, 1, 1)
    assert {"ep=1", "cp=1"} <= set(plan.pins)
    assert autopar.solve(g, 4, cluster="cpu", global_batch=8, dtype="fp32", pins=["dp=4", "ep=2"]).mesh.ep == 2


def test_a_compiled_plan_round_trips_and_old_plans_load_eager(graph) -> None:
    _, _, g = graph
    plan = autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True)
    assert plan.training.compiled and Plan.from_json(plan.to_json()) == plan
    assert {"tp=1", "pp=1", "ep=1", "cp=1", "recompute=none"} <= set(plan.pins)
    assert "blocks under torch.compile" in plan.summary().splitlines()[0]
    old = json.loads(plan.to_json())
    del old["training"]["compiled"]  # a plan written before the field
    assert Plan.from_json(json.dumps(old)).training.compiled is False
    old["training"]["compiled"] = "yes"
    with pytest.raises(autopar.PlanError, match="compiled"):
        Plan.from_json(json.dumps(old))


def test_compiled_pricing_fuses_memory_bound_ops_only(graph) -> None:
    from autopar.cost_models.compute import COMPILED_MEMORY_BOUND_FRACTION
    from autopar.cost_models.hardware import load_cluster
    from autopar.planning.layer_compute import layer_compute

    _, _, g = graph
    block = g.layer("blocks.0")
    device = load_cluster("h100-80g").device
    eager = layer_compute(block, None, 1, 2, device, "bf16")
    fused = layer_compute(block, None, 1, 2, device, "bf16", compiled=True)
    assert fused.fwd_s < eager.fwd_s and fused.bwd_s < eager.bwd_s
    memory_only = dataclasses.replace(block, ops=tuple(o for o in block.ops if o.kind.value == "memory"),
                                      flops_per_sample=0.0)
    m_eager = layer_compute(memory_only, None, 1, 2, device, "bf16")
    m_fused = layer_compute(memory_only, None, 1, 2, device, "bf16", compiled=True)
    assert m_fused.fwd_s == pytest.approx(COMPILED_MEMORY_BOUND_FRACTION * m_eager.fwd_s)
    # the plan: only the blocks are compiled, so only their compute is cheaper
    kwargs = dict(cluster="h100-80g", global_batch=4, pins=["tp=1", "pp=1", "recompute=none", "dp=2"])
    a = autopar.solve(g, 2, **kwargs)
    b = autopar.solve(g, 2, **kwargs, compiled=True)
    assert b.predicted.breakdown.compute_s < a.predicted.breakdown.compute_s
    # a device without an op model prices layers by FLOPs alone: compiled is priced as eager
    cpu = dict(kwargs, cluster="cpu")
    assert autopar.solve(g, 2, **cpu, compiled=True).predicted.step_time_s == autopar.solve(g, 2, **cpu) \
        .predicted.step_time_s


# ------------------------------------------------------------------ refused, not run


def test_compile_refuses_what_it_does_not_run(graph) -> None:
    model, inputs, g = graph
    with pytest.raises(CompileError, match="does not run tensor parallelism.*tp pinned to both 2 and 1"):
        autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True, pins=["tp=2"])
    with pytest.raises(CompileError, match="or recompute yet.*recompute=none for every layer but blocks"):
        autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True, pins=["blocks.*:recompute=full"])
    tp = autopar.solve(g, 2, cluster="cpu", global_batch=4, pins=["tp=2", "pp=1", "blocks.*:tp=megatron"])
    tp_compiled = dataclasses.replace(tp, training=dataclasses.replace(tp.training, compiled=True))
    with pytest.raises(CompileError, match=r"tensor parallelism \(tp=2\).*drop --compile"):
        autopar.compile(model, 2, inputs, graph=g, plan=tp_compiled)
    with pytest.raises(CompileError, match="priced eager"):  # what runs is what was priced
        autopar.compile(model, 2, inputs, graph=g, plan=tp, torch_compile=True)
    pp = autopar.solve(g, 2, cluster="cpu", global_batch=4, pins=["pp=2", "microbatches=2"])
    pp_compiled = dataclasses.replace(pp, training=dataclasses.replace(pp.training, compiled=True))
    with pytest.raises(CompileError, match=r"a pipeline \(pp=2\)"):
        autopar.compile(model, 2, inputs, graph=g, plan=pp_compiled)


def test_cli_verify_compile_refuses_a_tensor_parallel_plan_in_one_line(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "tp.json"
    assert main(["plan", GPT, "--world-size", "2", "--cluster", "cpu", "--pin", "tp=2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["verify", GPT, "--world-size", "2", "--plan", str(plan), "--compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "priced eager" in err
    assert main(["verify", GPT, "--world-size", "2", "--compile", "--pin", "tp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not run tensor parallelism" in err


def test_run_compile_reaches_the_scripts_compile_through_the_environment(monkeypatch) -> None:
    from autopar.runtime.compiled import COMPILE_ENV, requested

    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert requested(None) is None and requested(False) is False
    monkeypatch.setenv(COMPILE_ENV, "1")  # what `autopar run --compile` sets for its ranks
    assert requested(None) is True and requested(False) is False  # an explicit argument wins
