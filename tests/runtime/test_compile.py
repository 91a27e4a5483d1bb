"""torch.compile per block (issue 24's first slice): compiled training matches eager (DDP, ZeRO, recompute,
pipelines), compiles once, is priced as compiled, says so in the plan, and is refused for lowerings it does
not run yet."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
from distributed import every_rank

import autopar
from autopar.errors import CompileError, PinError
from autopar.plan import Plan
from autopar.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
GPT = str(ROOT / "examples/gpt.py") + ":gpt_tiny"
EXACT = 1e-5


def _backend(default: str) -> list[str]:
    """The backends a case compiled with: its own, or every case's from $AUTOPAR_TEST_COMPILE_BACKEND."""
    from compile_cases import BACKEND_ENV

    return [os.environ.get(BACKEND_ENV, default)]


@pytest.fixture(scope="module")
def graph():
    import gpt

    model, inputs = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="meta")
    return model, inputs, autopar.capture(model, inputs)


# ------------------------------------------------------------------ W = 2: inductor on CPU (ddp, zero3_selective),
# aot_eager for the rest (compile_cases.Backend: the same graphs, breaks and partition, no code generated)


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(["ddp", "zero3", "zero3_full", "zero3_selective", "hf_llama_zero3", "hf_qwen2_ddp",
                         "hf_llama_zero3_selective"], module="compile_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ddp", "zero3"])
def test_compiled_blocks_train_as_one_eager_device(w2: dict, case: str) -> None:
    for m in every_rank(w2[case]):
        assert m["plan_compiled"] and m["compiled"] == ["blocks.0", "blocks.1"]
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
    assert w2["ddp"]["zero"] == [0] and w2["zero3"]["zero"] == [3]
    assert (w2["ddp"]["backend"], w2["zero3"]["backend"]) == (_backend("inductor"), _backend("aot_eager"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["zero3_full", "zero3_selective"])
def test_recomputed_blocks_compile_with_their_checkpoint_and_train_as_one_eager_device(w2: dict, case: str) -> None:
    """Under ZeRO-3 on 2 ranks: both blocks compiled with their checkpoint inside, ln_f checkpointed
    eagerly (full case), 3 SGD steps within 1e-5 of one eager process."""
    kind = case.removeprefix("zero3_")
    for m in every_rank(w2[case]):
        assert m["plan_compiled"] and m["compiled"] == ["blocks.0", "blocks.1"] and m["zero"] == [3]
        want = {"blocks.0": kind, "blocks.1": kind} | ({"ln_f": "full"} if kind == "full" else {})
        assert m["recompute"] == want, m["recompute"]
        assert m["checkpointed"] == {"blocks.0": kind, "blocks.1": kind}, m["checkpointed"]
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
    sel = w2["zero3_selective"]
    # the selective policy ran inside the compiled region (asked while tracing) and kept matmul outputs
    assert sel["policy_asked"] > 0 and {"aten::mm", "aten::addmm"} & set(sel["policy_kept"]), sel["policy_kept"]
    assert w2["zero3_full"]["policy_asked"] == 0
    assert sel["backend"] == _backend("inductor")  # the policy inside inductor's partitioner (zero3_full: aot_eager's)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["hf_llama_zero3", "hf_qwen2_ddp", "hf_llama_zero3_selective"])
def test_hugging_face_decoder_layers_compile_one_by_one_and_train_as_one_eager_device(w2: dict, case: str) -> None:
    """A tiny LlamaForCausalLM (ZeRO-3, and with selective recompute) and Qwen2ForCausalLM (DDP),
    built from configs: each decoder layer compiled, 3 SGD steps within 1e-5 of one eager process."""
    for m in every_rank(w2[case]):
        assert m["plan_compiled"] and m["compiled"] == ["model.layers.0", "model.layers.1"], m
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
    assert w2["hf_llama_zero3"]["zero"] == [3] and w2["hf_qwen2_ddp"]["zero"] == [0]
    sel = w2["hf_llama_zero3_selective"]
    assert {sel["recompute"][f"model.layers.{i}"] for i in (0, 1)} == {"selective"}
    assert sel["checkpointed"] == {"model.layers.0": "selective", "model.layers.1": "selective"}
    assert w2["hf_llama_zero3"]["checkpointed"] == {}
    assert sel["policy_asked"] > 0 and "aten::mm" in sel["policy_kept"], sel["policy_kept"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ddp", "zero3", "zero3_full", "zero3_selective", "hf_llama_zero3", "hf_qwen2_ddp",
                                  "hf_llama_zero3_selective"])
def test_the_blocks_share_one_graph_and_later_steps_compile_nothing(w2: dict, case: str) -> None:
    for m in every_rank(w2[case]):
        assert m["graphs"] == [1] * len(m["graphs"]), m
        assert m["guard_failures"] == [] and m["graph_breaks"] == {}


# ------------------------------------------------------------------ tensor parallelism: blocks traced under the rules

TENSOR_PARALLEL = ["tp2_gpt", "tp2_sp_gpt", "hf_llama_tp2", "hf_llama_tp2_sp"]


@pytest.fixture(scope="module")
def tensor_parallel(ranks) -> dict[str, dict]:
    """tp = 2 with and without sequence parallelism on 2 ranks, and tp = 2 × dp = 2 (ZeRO-3) on 4."""
    return (ranks(2).run([*TENSOR_PARALLEL, "tp2_sp_selective_gpt", "tp2_untraceable_gpt"], module="compile_cases")
            | ranks(4).run(["dp2_tp2_gpt", "pp2_tp2_full_gpt"], module="compile_cases"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", [*TENSOR_PARALLEL, "dp2_tp2_gpt"])
def test_tensor_parallel_blocks_compile_once_and_train_as_one_eager_device(tensor_parallel: dict,
                                                                           case: str) -> None:
    """Each tensor-parallel block is traced once under the sharding rules and that graph compiled
    (runtime/sharded_trace.py), the project's GPT and a Hugging Face Llama, with and without sequence
    parallelism and beside dp with ZeRO-3: 3 SGD steps within 1e-5 of one eager process on every rank,
    one graph the two blocks share on the first step and none after it over 10 steps, no graph break,
    no guard failure, no block fallen back to eager."""
    res = tensor_parallel[case]
    blocks = ["model.layers.0", "model.layers.1"] if case.startswith("hf_") else ["blocks.0", "blocks.1"]
    for m in every_rank(res):
        assert m["plan_compiled"] and m["mesh"][2] == 2 and m["compiled"] == blocks, m
        assert m["sharded_traces"] == blocks and set(blocks) <= set(m["tp_layers"]), m
        assert m["sp"] == (blocks if "_sp" in case else []), m["sp"]
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
        assert m["graphs"] == [1] * 10, m
        assert m["guard_failures"] == [] and m["graph_breaks"] == {} and m["notes"] == [], m
    assert tensor_parallel["dp2_tp2_gpt"]["mesh"] == [1, 2, 2] and tensor_parallel["dp2_tp2_gpt"]["zero"] == [3]
    # the tensor-parallel collectives' custom ops inside inductor's generated code (the others: aot_eager)
    assert res["backend"] == _backend("inductor" if case == "hf_llama_tp2_sp" else "aot_eager"), res["backend"]


@pytest.mark.distributed
def test_recomputed_tensor_parallel_blocks_and_tp_inside_pipeline_stages_compile_and_keep_less(
        tensor_parallel: dict) -> None:
    """A recomputed tensor-parallel block is traced without its checkpoint, which then wraps the traced
    graph inside the compiled region: tp = 2 with sp and selective recompute on 2 ranks, and tp = 2 inside
    each stage of a pp = 2 1F1B pipeline with full recompute on 4 ranks. Each matches one eager process
    within 1e-5 over 3 SGD steps and compiles one graph over 10 steps; and the checkpoint survives: the
    first block saves for backward less than the same block unrecomputed (selective, against tp2_sp_gpt),
    and, recomputed in full, less than twice its inputs (a block that kept its activations saves ~10× more)."""
    sel, plain = tensor_parallel["tp2_sp_selective_gpt"], tensor_parallel["tp2_sp_gpt"]
    pp = tensor_parallel["pp2_tp2_full_gpt"]
    for case, kind in (("tp2_sp_selective_gpt", "selective"), ("pp2_tp2_full_gpt", "full")):
        for m in every_rank(tensor_parallel[case]):
            assert m["plan_compiled"] and m["sharded_traces"] == m["compiled"], m
            assert m["checkpointed"] == {p: kind for p in m["compiled"]}, m["checkpointed"]
            assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
            assert m["graphs"] == [1] * 10, m
            assert m["guard_failures"] == [] and m["graph_breaks"] == {} and m["notes"] == [], m
    assert sel["sp"] == ["blocks.0", "blocks.1"] and sel["policy_asked"] > 0 and "aten::mm" in sel["policy_kept"]
    assert all(a["saved_bytes"] < b["saved_bytes"] for a, b in zip(every_rank(sel), every_rank(plain)))
    # the backward re-runs forward collectives (the compiled graph's custom ops, counted in step 2): all-gathers
    # the recomputed ops need again; pricing charges every forward collective again (an overcount)
    assert all(a["tp_collectives"]["all_gather"] > b["tp_collectives"]["all_gather"]
               for a, b in zip(every_rank(sel), every_rank(plain))), [m["tp_collectives"] for m in every_rank(sel)]
    ranks = every_rank(pp)
    assert pp["mesh"] == [2, 1, 2] and pp["schedule"] == "1f1b" and pp["tracer"] == "fx-layers"
    assert sorted(p for m in ranks for p in m["compiled"]) == ["blocks.0", "blocks.0", "blocks.1", "blocks.1"]
    inputs = 8 * 16 * 32 * 4  # a step's block inputs on a rank: global batch 8 (2 microbatches), seq 16, width 32
    assert all(0 < m["saved_bytes"] < 2 * inputs for m in ranks), [m["saved_bytes"] for m in ranks]
    # a block unrecomputed all-reduces twice forward and twice backward a microbatch (2): recomputed, more
    assert all(m["tp_collectives"]["all_reduce"] > 2 * 4 for m in ranks), [m["tp_collectives"] for m in ranks]


@pytest.mark.distributed
def test_a_tensor_parallel_block_make_fx_cannot_trace_runs_eagerly_once_said_and_as_eager(
        tensor_parallel: dict) -> None:
    """Blocks that branch in Python on a tensor's value (compile_cases.clamp_outliers) cannot be traced
    on fake tensors: each runs eagerly under the sharding rules instead of crashing the step, its full
    recompute kept (it saves its input alone), with one note a block over 10 steps naming it and the
    reason in one line, and the eager model's numbers."""
    for m in every_rank(tensor_parallel["tp2_untraceable_gpt"]):
        assert m["plan_compiled"] and m["sharded_traces"] == ["blocks.0", "blocks.1"], m
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
        assert m["graphs"] == [0] * 10 and m["graph_breaks"] == {}, m  # nothing compiled behind the notes
        assert [n.split(" runs eagerly")[0] for n in m["notes"]] == ["torch.compile: block 'blocks.0'",
                                                                     "torch.compile: block 'blocks.1'"], m["notes"]
        assert all("make_fx could not trace it under the sharding rules (GuardOnDataDependentSymNode" in n
                   and "\n" not in n for n in m["notes"]), m["notes"]
        assert m["checkpointed"] == {"blocks.0": "full", "blocks.1": "full"}
        assert m["tp_collectives"] == {}, m  # the eager runtime's collectives, none of the compiled graph's ops
        assert 0 < m["saved_bytes"] < 2 * 4 * 16 * 32 * 4, m["saved_bytes"]  # its input: batch 4, seq 16, width 32


def test_a_compiled_solve_offers_tensor_parallelism_with_recompute_and_beside_pipelines(graph) -> None:
    """Tensor parallelism runs compiled, so a compiled search may choose tp > 1 (and sp), recompute on
    its blocks (their checkpoint wraps the traced graph) and tp beside a pipeline."""
    from autopar.admission import compiled_refusals

    _, _, g = graph
    kwargs = dict(cluster="cpu", global_batch=64, dtype="fp32", compiled=True)
    plan = autopar.solve(g, 2, **kwargs, pins=["tp=2", "pp=1", "blocks.*:tp=megatron"])
    assert plan.training.compiled and plan.mesh.tp == 2 and "tp=1" not in plan.pins
    assert not compiled_refusals(plan, g)
    # what the search may choose for a block: tp with recompute, eagerly and compiled
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.cost_models.presets import load_cluster
    from autopar.mesh import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    config = Configuration(Mesh(tp=2), 1, Schedule(ScheduleKind.NONE))
    cluster = load_cluster("cpu").for_world_size(2)
    i = g.layer("blocks.0").index
    rows = {c: PriceTable(g, config, cluster, TrainingSpec(4, compiled=c)).choices[i] for c in (False, True)}
    assert rows[True] == rows[False] and any(s.tp is not None and s.recompute for s in rows[True])
    both = autopar.solve(g, 2, **kwargs, pins=["tp=2", "pp=1", "blocks.*:tp=megatron", "blocks.*:recompute=full"])
    assert {str(lp.choice.recompute) for lp in both.layers if lp.name.startswith("blocks.")} == {"full"}
    assert not compiled_refusals(both, g)
    staged = autopar.solve(g, 4, cluster="cpu", global_batch=8, compiled=True, pins=["tp=2", "pp=2", "microbatches=2"])
    assert (staged.mesh.tp, staged.mesh.pp) == (2, 2) and staged.training.compiled
    assert not compiled_refusals(staged, g)


# ------------------------------------------------------------------ context parallelism: the attention mode compiled


def test_a_compiled_solve_offers_context_parallelism_but_not_beside_tp(graph) -> None:
    """cp runs compiled, so a compiled solve pinned to cp = 2 plans it (it raised CompileError before), with
    no cp pin of its own; cp beside tp is not offered compiled: pinning both is one CompileError line."""
    from autopar.admission import compiled_refusals

    _, _, g = graph
    kwargs = dict(cluster="cpu", global_batch=4, dtype="fp32", compiled=True)
    for method in ("allgather", "ulysses", "ring"):
        plan = autopar.solve(g, 2, **kwargs, pins=["cp=2", f"cp_attention={method}"])
        assert plan.training.compiled and plan.mesh.cp == 2 and str(plan.cp_attention) == method
        assert not any(p.startswith(("cp=1", "ep=1")) for p in plan.pins)
        assert not compiled_refusals(plan, g)
    with pytest.raises(CompileError, match=r"context parallelism \(cp=2\) beside tp=2: pin pp=1 for a refused"):
        autopar.solve(g, 4, **kwargs, pins=["cp=2", "tp=2", "pp=1"])


# ------------------------------------------------------------------ pipelines: blocks compiled inside their stages

PIPELINES = ["pp_1f1b", "pp_1f1b_full", "pp_gpipe_selective", "pp_interleaved", "hf_llama_pp_1f1b",
             "hf_llama_pp_selective"]


@pytest.fixture(scope="module")
def pipelines(ranks) -> dict[str, dict]:
    """The pipeline cases: pp = 2 on 2 ranks, and pp = 2 × dp = 2 (ZeRO-3) on 4."""
    return (ranks(2).run(PIPELINES, module="compile_cases")
            | ranks(4).run(["pp2_dp2_zero3"], module="compile_cases"))


@pytest.mark.distributed
@pytest.mark.parametrize("case", [*PIPELINES, "pp2_dp2_zero3"])
def test_pipeline_stages_run_their_blocks_compiled_as_one_eager_device_and_compile_once(pipelines: dict,
                                                                                         case: str) -> None:
    """Each rank compiles the blocks of its own stages, inside the stage modules the pipeline lowering
    built (the schedule stays eager): 3 SGD steps within 1e-5 of one eager process on every rank, one
    graph on the first step and none after it over 10 steps, no graph break, no guard failure."""
    res = pipelines[case]
    hf = case.startswith("hf_")
    blocks = ["model.layers.0", "model.layers.1"] if hf else ["blocks.0", "blocks.1"]
    ranks = every_rank(res)
    assert sorted(p for m in ranks for p in m["compiled"]) == sorted(blocks * (len(ranks) // 2)), ranks
    for m in ranks:
        assert m["plan_compiled"] and m["mesh"][0] == 2 and len(m["compiled"]) == 1, m
        assert m["tracer"] == ("export-layers" if hf else "fx-layers"), m["tracer"]
        assert m["loss_rel"] < EXACT and m["grad_rel"] < EXACT and m["param_rel"] < EXACT, m
        assert m["graphs"] == [1] * len(m["graphs"]) and len(m["graphs"]) == 10, m
        assert m["guard_failures"] == [] and m["graph_breaks"] == {}, m
        kind = {"full": "full", "selective": "selective"}.get(case.rsplit("_", 1)[-1])
        assert m["checkpointed"] == ({m["compiled"][0]: kind} if kind else {}), m["checkpointed"]
    schedules = {c: pipelines[c]["schedule"] for c in ("pp_1f1b", "pp_gpipe_selective", "pp_interleaved")}
    assert schedules == {"pp_1f1b": "1f1b", "pp_gpipe_selective": "gpipe", "pp_interleaved": "interleaved_1f1b"}
    assert pipelines["pp2_dp2_zero3"]["mesh"] == [2, 2, 1] and pipelines["pp2_dp2_zero3"]["zero"] == [3]
    assert pipelines["pp_gpipe_selective"]["policy_asked"] > 0


def test_a_compiled_solve_offers_pipelines_but_not_where_no_stage_calls_a_block(graph) -> None:
    """Pipelines run compiled, so a compiled search may choose pp > 1; a model whose export graph lost
    its layers' module calls has stages that call no block, so there a compiled search keeps pp = 1
    and a pinned pipeline is refused in one line (priced compiled, it would run eager)."""
    from autopar.cost_models.presets import load_cluster
    from autopar.graph import LayerGraph
    from autopar.pins import Pins
    from autopar.planning.configs import enumerate_configs
    from autopar.planning.configuration import TrainingSpec

    _, _, g = graph
    plan = autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True, pins=["pp=2", "microbatches=2"])
    assert plan.training.compiled and plan.mesh.pp == 2 and "pp=1" not in plan.pins
    exported = LayerGraph.from_dict({**g.to_dict(), "tracer": "export"})
    cluster = load_cluster("cpu").for_world_size(4)
    free = {c.mesh.pp for c in enumerate_configs(g, 4, cluster, TrainingSpec(8, compiled=True), Pins.from_any(None))}
    assert free > {1}
    kept = {c.mesh.pp for c in enumerate_configs(exported, 4, cluster, TrainingSpec(8, compiled=True),
                                                 Pins.from_any(None))}
    assert kept == {1}
    assert {c.mesh.pp for c in enumerate_configs(exported, 4, cluster, TrainingSpec(8), Pins.from_any(None))} > {1}
    with pytest.raises(CompileError, match="single ATen graphs.*pin pp=1"):
        autopar.solve(exported, 2, cluster="cpu", global_batch=4, compiled=True, pins=["pp=2"])


@pytest.mark.slow
def test_hugging_face_decoder_layers_are_the_compiled_blocks() -> None:
    """A Hugging Face decoder's first layer is charged the rotary cos/sin its siblings share, so its
    cost class is its own; it is still a block of the stack, compiled and priced compiled (were it
    not, a compiled plan of Llama would compile nothing and run eager)."""
    from cut_cases import qwen2
    from equivalence_cases import hf_llama

    for build in (hf_llama, qwen2):
        g = autopar.capture(*build())
        assert [l.name for l, b in zip(g.layers, g.blocks) if b] == ["model.layers.0", "model.layers.1"]


# ------------------------------------------------------------------ the plan says it


@pytest.mark.slow
def test_a_compiled_solve_offers_expert_and_context_parallelism_it_now_runs(graph) -> None:
    """Compiled, the search offers ep on a mixture of experts and cp on a long sequence (it skipped both
    before), prices an MoE block under ep with its memory-bound ops unfused (its experts run eagerly in the
    exchange the block compiles around) and the same block without ep fused."""
    import moe_cases  # tests/ is on the path (conftest)

    from autopar.choice import CpAttention
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.plan import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    g = autopar.capture(*moe_cases.hf_mixtral())
    plan = autopar.solve(g, 4, cluster="cpu", global_batch=8, dtype="fp32", compiled=True, pins=["dp=4", "ep=2"])
    assert plan.training.compiled and plan.mesh.ep == 2 and (plan.mesh.tp, plan.mesh.pp) == (1, 1)
    # its MoE blocks compile around the eager dispatch with fullgraph=False: the plan says what that lets by
    assert any("with fullgraph=False, so a graph break in the model's own code" in n for n in plan.notes)
    whole = autopar.solve(g, 4, cluster="cpu", global_batch=8, dtype="fp32", compiled=True, pins=["dp=4", "ep=1"])
    assert not any("fullgraph=False" in n for n in whole.notes)
    moe = next(layer for layer in g if layer.moe and g.blocks[layer.index])
    cluster = autopar.planning.api.resolve_cluster("cpu", 4)
    tables = {ep: PriceTable(g, Configuration(Mesh(dp=4, ep=ep), 1, Schedule(ScheduleKind.NONE)), cluster,
                             TrainingSpec(8, compiled=True)) for ep in (1, 2)}
    assert tables[1].compiled_ops(moe) and not tables[2].compiled_ops(moe)
    _, _, long = graph  # cp on the GPT: a compiled search with cp pinned solves it, all-gather and Ulysses
    for method in (CpAttention.ALL_GATHER, CpAttention.ULYSSES):
        cp = autopar.solve(long, 2, cluster="cpu", global_batch=4, compiled=True, pins=["cp=2",
                                                                                      f"cp_attention={method}"])
        assert cp.training.compiled and cp.mesh.cp == 2 and cp.cp_attention is method
        assert not any("fullgraph=False" in n for n in cp.notes)  # they trace whole


def test_a_compiled_plan_round_trips_and_old_plans_load_eager(graph) -> None:
    _, _, g = graph
    plan = autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True)
    assert plan.training.compiled and Plan.from_json(plan.to_json()) == plan
    assert not {"ep=1", "cp=1", "tp=1", "pp=1", "recompute=none"} & set(plan.pins)  # nothing pinned away
    assert "blocks under torch.compile" in plan.summary().splitlines()[0]
    old = json.loads(plan.to_json())
    del old["training"]["compiled"]  # a plan written before the field
    assert Plan.from_json(json.dumps(old)).training.compiled is False
    old["training"]["compiled"] = "yes"
    with pytest.raises(autopar.PlanError, match="compiled"):
        Plan.from_json(json.dumps(old))


def test_compiled_pricing_fuses_memory_bound_ops_only(graph) -> None:
    from autopar.cost_models.gpu_figures import COMPILED_HOST_SHARE
    from autopar.cost_models.hardware import COMPILED_MEMORY_BOUND_FRACTION
    from autopar.cost_models.presets import load_cluster
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
    assert m_fused.device_fwd_s == pytest.approx(COMPILED_MEMORY_BOUND_FRACTION * m_eager.device_fwd_s)
    # the host issues a compiled block's launches at its measured share of eager's dispatches
    assert m_fused.host_fwd_s == pytest.approx(COMPILED_HOST_SHARE * m_eager.host_fwd_s)
    # a calibrated device prices them at its own measured fraction (autopar calibrate's fused chain)
    measured = dataclasses.replace(device, op_model=dataclasses.replace(device.op_model,
                                                                        compiled_memory_bound_fraction=0.3))
    assert layer_compute(memory_only, None, 1, 2, measured, "bf16", compiled=True).device_fwd_s == pytest.approx(
        0.3 * m_eager.device_fwd_s)
    # the plan: only the blocks are compiled, so only their compute is cheaper
    kwargs = dict(cluster="h100-80g", global_batch=4, pins=["tp=1", "pp=1", "recompute=none", "dp=2"])
    a = autopar.solve(g, 2, **kwargs)
    b = autopar.solve(g, 2, **kwargs, compiled=True)
    assert b.predicted.breakdown.compute_s < a.predicted.breakdown.compute_s
    # a device without an op model prices layers by FLOPs alone: compiled is priced as eager
    cpu = dict(kwargs, cluster="cpu")
    assert autopar.solve(g, 2, **cpu, compiled=True).predicted.step_time_s == autopar.solve(g, 2, **cpu) \
        .predicted.step_time_s


def test_a_compiled_solve_offers_recompute_where_memory_asks_and_the_runtime_takes_it(graph) -> None:
    """Recompute runs compiled, so a compiled search may choose it: under a budget the unrecomputed
    plan exceeds, it does, and the plan passes the compiled runtime's check."""
    from autopar.admission import compiled_refusals

    _, _, g = graph
    kwargs = dict(cluster="cpu", global_batch=64, dtype="fp32", compiled=True)
    # one loss throughout (the whole logits): unpinned, the loss is chosen by price and moves the peak
    kept = autopar.solve(g, 1, **kwargs, pins=["dp=1", "microbatches=1", "recompute=none", "loss=full"])
    budget = max(kept.predicted.memory_per_rank_bytes) * 0.9 / 2**30
    with pytest.raises(autopar.InfeasibleError):
        autopar.solve(g, 1, **kwargs, pins=["dp=1", "microbatches=1", "recompute=none", "loss=full"], memory_gb=budget)
    tight = autopar.solve(g, 1, **kwargs, pins=["dp=1", "microbatches=1", "loss=full"], memory_gb=budget)
    assert tight.training.compiled and any(l.choice.recompute for l in tight.layers), tight.summary()
    assert any(l.choice.recompute for l in tight.layers if l.name.startswith("blocks."))
    assert not compiled_refusals(tight)  # a refused recompute would be named


def test_compiled_recompute_reruns_what_the_compiled_forward_runs(graph) -> None:
    """A compiled block's full recompute re-runs its compiled forward, and selective re-runs its
    memory-bound ops fused as that forward runs them; what is kept is priced as eager."""
    from autopar.choice import LayerChoice, Recompute
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.cost_models.presets import load_cluster
    from autopar.mesh import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    _, _, g = graph
    preset = load_cluster("h100-80g")  # the kernels' side: the host's (a re-run issued again) is priced apart
    cluster = dataclasses.replace(preset, device=dataclasses.replace(
        preset.device, op_model=dataclasses.replace(preset.device.op_model, host_op_s=0.0))).for_world_size(2)
    config = Configuration(Mesh(dp=2), 1, Schedule(ScheduleKind.NONE))
    block = g.layer("blocks.0")
    tables = {c: PriceTable(g, config, cluster, TrainingSpec(4, compiled=c)) for c in (False, True)}

    def price(compiled: bool, kind: Recompute):
        return tables[compiled]._price(block, LayerChoice(recompute=kind))

    for compiled in (False, True):
        none, full = price(compiled, Recompute.NONE), price(compiled, Recompute.FULL)
        assert full.compute_mb_s - none.compute_mb_s == pytest.approx(none.forward_mb_s)
    rerun = {c: price(c, Recompute.SELECTIVE).compute_mb_s - price(c, Recompute.NONE).compute_mb_s
             for c in (False, True)}
    assert 0 < rerun[True] < rerun[False]
    assert price(True, Recompute.SELECTIVE).activation_mb_bytes == price(False, Recompute.SELECTIVE) \
        .activation_mb_bytes
    # compiled around the eager ring (cp = 2): full recompute offered alone, its eager checkpoint re-running the
    # compiled forward and the ring's forward transfers, keeping the block's input
    from autopar.choice import CpAttention
    from autopar.planning.choices import allowed_choices

    ring = PriceTable(g, Configuration(Mesh(cp=2), 1, Schedule(ScheduleKind.NONE), cp_attention=CpAttention.RING),
                      cluster, TrainingSpec(4, compiled=True))
    none, full = (ring._price(block, LayerChoice(recompute=kind)) for kind in (Recompute.NONE, Recompute.FULL))
    assert full.compute_mb_s - none.compute_mb_s == pytest.approx(none.forward_mb_s)
    assert full.cp_comm_mb_s > none.cp_comm_mb_s > 0 and full.activation_mb_bytes < none.activation_mb_bytes
    offered = {ring.choices[block.index][k].recompute for k in allowed_choices(ring, [{}] * len(g))[block.index]}
    assert Recompute.FULL in offered and Recompute.SELECTIVE not in offered


@pytest.mark.parametrize("kind", ["full", "selective", "alternate_mm"])
@pytest.mark.slow
def test_recomputed_blocks_compile_in_one_process_keep_less_and_match_eager(kind: str) -> None:
    """One process: a compiled block checkpointed full keeps less for backward than a compiled
    block not recomputed, selective keeps between the two (so the checkpoint runs inside the
    compiled forward), and 3 SGD steps match the eager model within 1e-5, compiling once. Selective
    compiles with inductor (its policy inside inductor's partitioner: the quick loop's inductor case),
    the others with aot_eager (the same graph and partition, no code generated: compile_cases.Backend)."""
    import torch
    from compile_cases import compiled_one_process

    backend = "inductor" if kind == "selective" else "aot_eager"
    m = compiled_one_process(kind, backend)
    assert m["backend"] == _backend(backend), m["backend"]
    assert m["compiled"] == ["blocks.0", "blocks.1"], m
    assert m["grad_rel"] < EXACT and m["param_rel"] < EXACT and m["loss_rel"] < EXACT, m
    assert m["graphs"] == [1] * len(m["graphs"]) and m["graph_breaks"] == {}, m
    assert m["saved"] < m["saved_none"], m
    if kind == "full":  # the block's input alone (b·s·d floats, and a few bytes for the RNG state)
        assert m["saved"] < 2 * m["input_bytes"], m
    assert torch.is_grad_enabled()


def test_a_block_that_breaks_the_graph_runs_eagerly_and_the_plan_says_so() -> None:
    """A block whose own code forces a graph break is not run half compiled behind the plan's back:
    it compiles whole or runs eagerly from its first call, with one warning naming the block and the
    break, a note on ``pm.plan``, and the eager model's numbers."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc(x))
            torch._dynamo.graph_break()  # the user's code forces it
            return x + h

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model, eager = Net(), Net()
    eager.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    loss_fn = nn.functional.mse_loss
    torch._dynamo.reset()
    pm = autopar.compile(model, 1, (x,), loss_fn=loss_fn, torch_compile=True, global_batch=4, dtype="fp32",
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert list(pm.compiled) == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.warns(UserWarning, match=r"block 'blocks.0' runs eagerly \(the plan priced it compiled\)"):
        loss = pm.train_step(x, y)
    notes = [n for n in pm.plan.notes if n.startswith("torch.compile:")]
    assert len(notes) == 3 and "'blocks.1' runs eagerly" in notes[1] and "graph_break" in notes[0], notes
    want = loss_fn(eager(x), y)
    assert abs(loss - want.item()) <= EXACT * abs(want.item())
    torch._dynamo.reset()


# ------------------------------------------------------------------ refused, not run


def test_compile_refuses_what_it_does_not_run(graph) -> None:
    model, inputs, g = graph
    with pytest.raises(CompileError, match=r"context parallelism \(cp=2\) beside tp=2: .*ep or cp beside dp alone"):
        autopar.solve(g, 4, cluster="cpu", global_batch=4, compiled=True, pins=["cp=2", "tp=2"])
    # a block compiled around the eager ring recomputes in full only (the checkpoint eager around the compiled
    # block); a selective policy would not see the compiled ops: not offered, and refused in a compiled plan
    ring = ["cp=2", "cp_attention=ring"]
    full = autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True, pins=ring + ["blocks.*:recompute=full"])
    assert full.training.compiled and {str(lp.choice.recompute) for lp in full.layers
                                       if lp.name.startswith("blocks.")} == {"full"}
    with pytest.raises(PinError, match="selective or alternate-mm recompute meets a block compiled around an eager"):
        autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True, pins=ring + ["blocks.*:recompute=selective"])
    plain = autopar.solve(g, 2, cluster="cpu", global_batch=4, pins=ring + ["blocks.*:recompute=selective"])
    forced = dataclasses.replace(plain, training=dataclasses.replace(plain.training, compiled=True))
    with pytest.raises(CompileError, match=r"recompute of blocks.0 \(selective\), blocks.1 \(selective\) in a "
                                           r"block compiled around an eager ring \(cp\), whose compiled ops an "
                                           r"op-level policy cannot see \(pin recompute=full there\)"):
        autopar.compile(model, 2, inputs, graph=g, plan=forced)
    recomputed = autopar.solve(g, 2, cluster="cpu", global_batch=4, compiled=True, pins=["blocks.*:recompute=full"])
    assert {str(lp.choice.recompute) for lp in recomputed.layers if lp.name.startswith("blocks.")} == {"full"}
    tp = autopar.solve(g, 2, cluster="cpu", global_batch=4, pins=["tp=2", "pp=1", "blocks.*:tp=megatron"])
    with pytest.raises(CompileError, match="priced eager"):  # what runs is what was priced
        autopar.compile(model, 2, inputs, graph=g, plan=tp, torch_compile=True)
    # a pipeline whose stages call no block module (an export graph without its layers' calls)
    from autopar.graph import LayerGraph

    exported = LayerGraph.from_dict({**g.to_dict(), "tracer": "export"})
    pp = autopar.solve(exported, 2, cluster="cpu", global_batch=4, pins=["pp=2", "microbatches=2"])
    pp_compiled = dataclasses.replace(pp, training=dataclasses.replace(pp.training, compiled=True))
    with pytest.raises(CompileError, match=r"a pipeline \(pp=2\) of .*call no block module"):
        autopar.compile(model, 2, inputs, graph=exported, plan=pp_compiled)


@pytest.mark.slow
def test_cli_verify_compile_refuses_an_eager_plan_and_context_beside_tensor_parallelism_in_one_line(tmp_path: Path,
                                                                                      capsys) -> None:
    plan = tmp_path / "tp.json"
    assert main(["plan", GPT, "--world-size", "2", "--cluster", "cpu", "--pin", "tp=2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["verify", GPT, "--world-size", "2", "--plan", str(plan), "--compile"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "priced eager" in err
    assert main(["verify", GPT, "--world-size", "4", "--compile", "--pin", "cp=2", "--pin", "tp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not run context parallelism (cp=2) beside tp=2" in err


def test_run_compile_reaches_the_scripts_compile_through_the_environment(monkeypatch) -> None:
    from autopar.runtime.compiled import COMPILE_ENV, requested

    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert requested(None) is None and requested(False) is False
    monkeypatch.setenv(COMPILE_ENV, "1")  # what `autopar run --compile` sets for its ranks
    assert requested(None) is True and requested(False) is False  # an explicit argument wins
