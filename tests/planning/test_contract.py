"""What is priced is what runs: the contract, pricing and the lowered modules agree layer by layer.

A matrix of plans (DDP, FSDP2 replicate under tp, ZeRO-1/2/3, mixed ZeRO stages,
recompute on glue layers, pipelines) is lowered for one rank of a fake 4-rank
process group in this process (collectives are no-ops; module wrapping, DTensor
sharding and stage splitting are real). For every layer the test checks that
the engine wrapping its unit, the unit's membership and resharding, the
DTensor sharding of its parameters and its checkpoint hooks are what
:func:`autopar.contract.plan_layout` says, and that pricing priced that
(:meth:`PriceTable.runs_as`, the table's engine).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import contract
from autopar.choice import LayerChoice
from autopar.contract import ROOT, Engine
from autopar.cost_models.memory import model_state_bytes
from autopar.cost_models.pipeline import Schedule
from autopar.cost_models.presets import PRESETS
from autopar.mesh import Mesh
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

WORLD = 4


class GlueGPT(nn.Module):
    """Two blocks with a parameter-free op between them written inline, and a root-level
    parameter: layers without a module of their own, as users write them."""

    def __init__(self, d: int = 32, vocab: int = 64, seq: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos
        x = self.blocks[0](x)
        x = torch.tanh(x) * 2.0  # glue: no module
        x = self.blocks[1](x)
        return self.head(x)


class Functional(nn.Module):
    """A model whose forward calls no submodule: one layer with no module of its own."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, d))
        self.w2 = nn.Parameter(torch.randn(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1) @ self.w2


def _gpt():
    return gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=8, device="meta")


def _glue():
    with torch.device("meta"):
        model = GlueGPT()
    return model, (torch.zeros(2, 8, dtype=torch.long),)


GPT_TP = ("blocks.*:tp=megatron",)
MATRIX = {
    # name: (model builder, pins, ranks to lower)
    "ddp": (_gpt, ("pp=1", "dp=4", "tp=1", "zero=0", "microbatches=1"), (0,)),
    "replicate_tp": (_gpt, ("pp=1", "dp=2", "tp=2", "zero=0", "microbatches=2") + GPT_TP, (0,)),
    "zero1": (_gpt, ("pp=1", "dp=4", "tp=1", "zero=1", "microbatches=2"), (0,)),
    "zero2": (_gpt, ("pp=1", "dp=4", "tp=1", "zero=2", "microbatches=2"), (0,)),
    "zero3_tp": (_gpt, ("pp=1", "dp=2", "tp=2", "zero=3", "microbatches=1") + GPT_TP, (0,)),
    "mixed": (_gpt, ("pp=1", "dp=4", "tp=1", "microbatches=2", "blocks.0:zero=3", "blocks.1:zero=0",
                     "tok_emb:zero=0", "lm_head:zero=2", "blocks.*:recompute=on", "ln_f:recompute=on"), (0,)),
    "glue_recompute": (_glue, ("pp=1", "dp=4", "tp=1", "zero=3", "recompute=all"), (0,)),
    "pp_zero3": (_gpt, ("pp=2", "dp=2", "tp=1", "zero=3", "microbatches=2", "schedule=1f1b"), (0, 2)),
    "pp_mixed": (_gpt, ("pp=2", "dp=2", "tp=1", "microbatches=2", "schedule=gpipe", "blocks.0:zero=0",
                        "blocks.1:zero=3", "blocks.*:recompute=on"), (0, 3)),
    "pp_replicated": (_gpt, ("pp=2", "dp=2", "tp=1", "zero=0", "microbatches=2", "schedule=1f1b"), (1, 2)),
}


@pytest.fixture
def fake_group():
    """Initialise a fake process group for one rank of WORLD; torn down after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _plan(build, pins):
    model, inputs = build()
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, WORLD, cluster="cpu", dtype="fp32", global_batch=8, pins=list(pins))
    return graph, plan


def _table(graph, plan) -> tuple[PriceTable, tuple[LayerChoice, ...]]:
    strategies = tuple(LayerChoice(lp.choice.tp, lp.choice.zero, lp.choice.recompute) for lp in plan.layers)
    mode = contract.mode_of(graph, plan.mesh.dp, tuple(s.zero for s in strategies), plan.mesh.pp)
    config = Configuration(plan.mesh, plan.microbatches, Schedule(plan.schedule, plan.chunks), mode)
    cluster = PRESETS["cpu"].for_world_size(WORLD)
    return PriceTable(graph, config, cluster, TrainingSpec(8, "fp32")), strategies


def _engine_of(module: nn.Module) -> Engine | None:
    """Which engine wraps ``module``, read from torch's composable-API registry."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule

    registry = _get_registry(module) or {}
    if "fully_shard" in registry:
        return Engine.FULLY_SHARD
    if "replicate" in registry:
        return Engine.REPLICATE if isinstance(module, FSDPModule) else Engine.DDP
    return None


def _reshards(module: nn.Module) -> bool:
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def _check_part(part: nn.Module, stage: int, graph, layout, table, strategies) -> int:
    """Every unit of the stage wrapped by its engine, resharding as its ZeRO stage says,
    holding its layers' parameters (sharded over dp from ZeRO-1 on), every recompute hooked.
    Returns the number of layers checked."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.tensor import DTensor

    units = layout.stage_units(stage)
    unit_paths = {u.path for u in units}
    checked = 0
    for unit in units:
        module = part.get_submodule(unit.path)
        assert _engine_of(module) is unit.engine, (stage, unit)
        if unit.engine is Engine.FULLY_SHARD:
            assert _reshards(module) == (unit.zero == 3), unit
    # no module is wrapped that the contract did not name
    wrapped = {name for name, m in part.named_modules() if _engine_of(m) is not None}
    assert wrapped == unit_paths, (stage, wrapped, unit_paths)
    dp_axis = 0
    for i, (layer, role) in enumerate(zip(graph, layout.layers)):
        if role.stage != stage:
            continue
        runs = table.runs_as(i, strategies[i])
        assert (runs.zero, runs.recompute) == (role.zero, role.recompute), layer.name  # priced as run
        hooked = bool(layer.module_path) and "checkpoint" in (_get_registry(part.get_submodule(layer.module_path))
                                                               or {})
        assert hooked == role.recompute, layer.name
        for name in layer.param_names:
            param = part.get_parameter(name)
            if role.unit is None:
                continue
            assert role.unit in unit_paths
            # the parameter lives in its unit's subtree and in no deeper unit's
            deeper = [p for p in unit_paths if p != role.unit and name.startswith(p + ".")
                      and (role.unit == ROOT or p.startswith(role.unit + "."))]
            assert name.startswith(role.unit + ".") or role.unit == ROOT, (name, role.unit)
            assert not deeper, (name, role.unit, deeper)
            if role.engine is Engine.DDP:
                assert not isinstance(param, DTensor)
                continue
            assert isinstance(param, DTensor), name
            dp_place = param.placements[dp_axis]
            # sharded over dp from ZeRO-1 on (a strided shard under tp), replicated at ZeRO-0
            assert dp_place.is_replicate() == (role.zero == 0), (name, param.placements)
            assert table._dtensor(strategies[i])  # priced as a DTensor parameter
        checked += 1
    return checked


@pytest.mark.parametrize("case", sorted(MATRIX))
@pytest.mark.slow
def test_lowered_modules_are_what_the_contract_and_pricing_say(case: str, fake_group) -> None:
    from autopar.runtime import default_loss
    from autopar.runtime.lowering import lower

    build, pins, ranks = MATRIX[case]
    graph, plan = _plan(build, pins)
    layout = contract.plan_layout(graph, plan)
    table, strategies = _table(graph, plan)
    assert table.engine is layout.engine
    for rank in range(plan.mesh.pp):  # the FSDP2 buffers each rank is priced with are the contract's
        priced = [table.buffers_needed(i, table.index_of(i, s)) for i, (s, lp) in
                  enumerate(zip(strategies, plan.layers)) if contract.pipeline_rank(lp.stage, plan.mesh.pp) == rank]
        assert max(priced) is layout.rank_buffers(rank), (case, rank)
    checked = 0
    for rank in ranks:
        fake_group(rank)
        model, inputs = build()
        lowered = lower(model, graph, plan, example_inputs=inputs, loss_fn=default_loss, init_fn=None)
        stages = lowered.pipeline.stage_ids if lowered.pipeline is not None else [0]
        for part, stage in zip(lowered.parts, stages):
            checked += _check_part(part, stage, graph, layout, table, strategies)
    assert checked >= len(graph) if plan.mesh.pp == 1 else checked >= 2


def test_pure_data_parallel_is_ddp_only_without_pipeline_or_tensor_parallelism() -> None:
    graph, _ = _plan(_gpt, ("pp=1", "dp=4", "tp=1", "zero=0", "microbatches=1"))
    choices, stages = (LayerChoice(),) * len(graph), (0,) * len(graph)
    assert contract.layout(graph, Mesh(dp=4), stages, choices).engine is Engine.DDP
    assert contract.layout(graph, Mesh(dp=2, tp=2), stages, choices).engine is Engine.REPLICATE
    one = contract.layout(graph, Mesh(dp=2, tp=2), stages, choices).stage_units(0)
    assert [u.path for u in one] == [ROOT]  # one replicate unit holds every layer


def test_a_zero0_block_beside_sharded_ones_is_priced_as_fsdp2_replicate_not_ddp() -> None:
    """pp = 1, tp = 1 with ZeRO-0 and ZeRO-3 blocks lowers as FSDP2 units: the ZeRO-0 block
    is a replicate unit, with no DDP gradient buckets beside its gradients."""
    graph, plan = _plan(_gpt, ("pp=1", "dp=4", "tp=1", "microbatches=1", "blocks.0:zero=3",
                               "blocks.1:zero=0"))
    table, strategies = _table(graph, plan)
    i = next(i for i, layer in enumerate(graph) if layer.name == "blocks.1")
    assert table.engine is Engine.FULLY_SHARD
    assert contract.plan_layout(graph, plan).role("blocks.1").engine is Engine.REPLICATE
    price = table.prices[i][table.index_of(i, strategies[i])]
    params = graph[i].param_count
    assert price.state_bytes == model_state_bytes(params, 0, 4, table.prec)  # no bucket copy
    ddp = PriceTable(graph, replace(table.config, data_parallel=contract.REPLICATED), table.cluster,
                     table.training)
    ddp_price = ddp.prices[i][ddp.index_of(i, LayerChoice(None, 0, False))]
    assert ddp_price.state_bytes == price.state_bytes + table.prec.grad_bytes * params


def test_recompute_is_offered_only_to_layers_with_a_module() -> None:
    model = Functional()
    graph = autopar.capture(model, (torch.randn(2, 16),))
    plan = autopar.solve(graph, WORLD, cluster="cpu", dtype="fp32", global_batch=8,
                         pins=["pp=1", "dp=4", "tp=1", "zero=3", "recompute=all"])
    glue = [i for i, layer in enumerate(graph) if layer.module_path is None]
    assert glue, "the glue model must have a layer without a module"
    table, _ = _table(graph, plan)
    for i in glue:
        assert not any(s.recompute for s in table.choices[i])
    assert any("recompute asked for" in note for note in plan.notes)


def test_root_layers_asking_for_different_stages_run_and_are_priced_at_the_highest() -> None:
    graph, plan = _plan(_gpt, ("pp=1", "dp=4", "tp=1", "microbatches=1", "tok_emb:zero=0",
                               "pos_emb:zero=1", "lm_head:zero=3", "blocks.*:zero=2"))
    layout = contract.plan_layout(graph, plan)
    assert layout.role("tok_emb").zero == layout.role("lm_head").zero == 3
    assert {lp.name: lp.choice.zero for lp in plan.layers}["tok_emb"] == 0  # the plan keeps the pin
    assert any("tok_emb (zero=0)" in note and "root FSDP unit, which runs at ZeRO-3" in note
               for note in plan.notes)
    assert "note: tok_emb (zero=0)" in plan.summary()
    table, strategies = _table(graph, plan)
    i = next(i for i, layer in enumerate(graph) if layer.name == "tok_emb")
    assert table.runs_as(i, strategies[i]).zero == 3


def test_the_solver_offers_only_choices_that_run_as_priced() -> None:
    """For every configuration of a small search, every strategy in the table runs as itself."""
    from autopar.pins import Pins
    from autopar.planning.solver import enumerate_configs

    graph, _ = _plan(_glue, ("pp=1", "dp=4", "tp=1", "zero=0"))
    cluster = PRESETS["cpu"].for_world_size(WORLD)
    training = TrainingSpec(8, "fp32")
    modes = set()
    for config in enumerate_configs(graph, WORLD, cluster, training, Pins()):
        table = PriceTable(graph, config, cluster, training)
        modes.add(config.data_parallel)
        for i, row in enumerate(table.choices):
            for s in row:
                runs = table.runs_as(i, s)
                assert runs.recompute == s.recompute
                assert runs.zero == s.zero or not graph[i].param_count, (config.describe(), graph[i].name, s)
    assert contract.REPLICATED in modes and any(m.sharded for m in modes)


def test_passes_run_in_their_order_and_a_failure_names_the_pass_and_those_before(fake_group) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.errors import LoweringError
    from autopar.passes.parallelize import PASSES, Context, Pass, run_passes
    from autopar.runtime.lowering import whole_model_part

    assert [p.name for p in PASSES] == ["tensor_parallel", "expert_parallel", "context_parallel", "recompute",
                                        "data_parallel"]
    graph, plan = _plan(_gpt, ("pp=1", "dp=4", "tp=1", "zero=3", "microbatches=1", "blocks.*:recompute=on"))
    fake_group(0)
    mesh = init_device_mesh("cpu", plan.mesh.degrees, mesh_dim_names=plan.mesh.dim_names())
    part = whole_model_part(graph, plan)
    model, _ = _gpt()
    fully_shard(model.blocks[0], mesh=mesh["dp"])  # sharded before recompute could sit inside it
    with pytest.raises(LoweringError, match=r"pass 'recompute' on the model failed: requires none, found "
                                            r"modules already sharded by FSDP2.*blocks\.0.*passes run before it: none"):
        run_passes(model, Context(graph, plan, part, mesh))

    def refuse(module, ctx):
        return "a reason"

    late = Pass("late", lambda ctx: True, lambda m, ctx: None, lambda m, ctx, r: None, refuse)
    model, _ = _gpt()
    with pytest.raises(LoweringError, match=r"pass 'late' on the model failed: a reason "
                                            r"\(passes run before it: recompute, data_parallel\)"):
        run_passes(model, Context(graph, plan, part, mesh), passes=(*PASSES, late))


def test_recompute_is_priced_as_checkpointing_the_module_leaves_it() -> None:
    """Checkpointing a layer's module frees its saved activations but keeps its input and what
    the layer's glue ops (outside the module) save: the priced saving is the measured one."""
    from torch.distributed._composable import checkpoint

    def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        return sum(seen.values())

    torch.manual_seed(0)
    plain, recomputed = GlueGPT(), GlueGPT()
    x = torch.zeros(2, 8, dtype=torch.long)
    layer = autopar.capture(plain, (x,)).layer("blocks.1")
    assert layer.glue_saved_bytes_per_sample == 8 * 32 * 4  # tanh keeps its output, outside the block
    checkpoint(recomputed.blocks[1])
    measured = saved_activation_bytes(plain, x) - saved_activation_bytes(recomputed, x)
    kept = layer.input_bytes_per_sample + layer.glue_saved_bytes_per_sample
    assert measured == 2 * (layer.activation_bytes_per_sample - kept)
    graph, plan = _plan(_glue, ("pp=1", "dp=4", "tp=1", "zero=0", "recompute=all"))
    table, strategies = _table(graph, plan)
    i = next(i for i, layer in enumerate(graph) if layer.name == "blocks.1")
    price = table.prices[i][table.index_of(i, strategies[i])]
    assert price.activation_mb_bytes == round(table.microbatch_size * kept)
