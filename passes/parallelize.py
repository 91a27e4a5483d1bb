"""One lowering path: the per-part passes, in their one order, for the model or a pipeline stage.

:func:`parallelize_part` takes one *part* — the whole model when pp = 1, or
one pipeline stage's module — with the slice of the plan it holds
(:class:`Part`), the device mesh (``None`` in a single process) and the
device; it runs :data:`PASSES` in order and returns what they made
(:class:`PartResult`). The runtime calls it once for the model; the pipeline
pass splits stages and calls it once per stage of this rank.

The order is data (:data:`PASSES`) and matters (torchtitan's):

1. **tensor parallel** first: it swaps weights for DTensors, which FSDP2
   must then shard over dp as a 2-D layout;
2. **expert parallel** (ep > 1): the experts' weights become DTensors on the
   (edp, ep) mesh and their forward routes tokens with all-to-all; before
   recompute, so a recomputed block reruns the same dispatch, and before
   data parallel, which must leave the expert weights out (they are reduced
   over the expert-data-parallel group, ``passes/expert_parallel.py``);
3. **context parallel** (cp > 1): hooks the modules given positions so they get the
   rank's global ones, and makes the attention mode the runtime holds over forward and
   backward (``passes/context_parallel.py``); it changes no parameter;
4. **recompute** next, so its hooks sit inside FSDP's gather/free hooks and
   a recomputed forward still finds its parameters;
5. **data parallel** (ZeRO / replicate / DDP) last, wrapping the final
   parameters and every module call outermost, over dp (or dp × cp flattened).

Each :class:`Pass` states what it requires and ensures, checked in code like
torch.fx's ``PassBase``; a failure is a :class:`~autopar.errors.LoweringError`
naming the pass, the layer or module, and the passes that ran before it.
What stays true across the passes: parameter FQNs are the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from autopar.choice import Recompute
from autopar.contract import Unit, data_ranks
from autopar.errors import LoweringError
from autopar.graph import LayerGraph
from autopar.passes.context_parallel import data_mesh
from autopar.passes.materialise import is_meta, materialise
from autopar.plan import LayerPlan, Plan


@dataclass(frozen=True)
class Part:
    """The slice of the plan one part holds: its layers' choices, units and recomputed modules."""

    stage: int | None  # the virtual stage; None for the whole model
    layers: tuple[LayerPlan, ...]
    units: tuple[Unit, ...]
    recompute: tuple[str, ...]

    def describe(self) -> str:
        return "the model" if self.stage is None else f"pipeline stage {self.stage}"


@dataclass
class PartResult:
    """What the passes made of one part."""

    module: nn.Module
    applied: list[str] = field(default_factory=list)
    permutations: dict[str, Any] = field(default_factory=dict)  # passes.tensor_parallel.Permutation by FQN
    data_parallel: Any = None  # passes.zero.DataParallelResult, when dp > 1
    experts: Any = None  # passes.expert_parallel.ExpertParallelResult, when ep > 1
    context: Any = None  # passes.context_parallel.ContextParallelResult, when cp > 1


@dataclass(frozen=True)
class Context:
    """What every pass may read: the graph, the plan restricted to the part, the mesh."""

    graph: LayerGraph
    plan: Plan
    part: Part
    mesh: Any  # a DeviceMesh with the plan mesh's axes (autopar.mesh), or None in one process


def _fsdp_wrapped(module: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [name or "<root>" for name, m in module.named_modules() if isinstance(m, FSDPModule)
            or "replicate" in _registry(m)]


def _registry(module: nn.Module) -> dict[str, Any]:
    from torch.distributed._composable.contract import _get_registry

    return _get_registry(module) or {}


# ---------------------------------------------------------------- the passes


def _tp_applies(ctx: Context) -> bool:
    return ctx.plan.mesh.tp > 1 and any(lp.choice.tp is not None for lp in ctx.part.layers)


def _tp_requires(module: nn.Module, ctx: Context) -> str | None:
    wrapped = _fsdp_wrapped(module)
    return f"modules already data-parallel: {wrapped[:3]}" if wrapped else None


def _tp_run(module: nn.Module, ctx: Context, result: PartResult) -> None:
    from autopar.passes.tensor_parallel import apply_tensor_parallel

    tp = apply_tensor_parallel(module, ctx.graph, ctx.plan, ctx.mesh["tp"])
    result.permutations.update(tp.permutations)


def _tp_ensures(module: nn.Module, ctx: Context) -> str | None:
    from torch.distributed.tensor import DTensor

    plain = []
    for lp in ctx.part.layers:
        if lp.choice.tp is None:
            continue
        style = ctx.graph.layer(lp.name).tp_style(lp.choice.tp)
        for path in (*style.column, *style.row, *style.vocab):
            weight = getattr(module.get_submodule(path), "weight", None)
            if weight is not None and not isinstance(weight, DTensor):
                plain.append(f"{lp.name}: {path}")
    return f"weights left unsharded: {plain[:3]}" if plain else None


def _ep_applies(ctx: Context) -> bool:
    from autopar.passes.expert_parallel import moe_blocks

    return ctx.plan.mesh.ep > 1 and bool(moe_blocks(ctx.graph, ctx.plan))


def _ep_requires(module: nn.Module, ctx: Context) -> str | None:
    from autopar.passes.expert_parallel import check_expert_parallel

    wrapped = _fsdp_wrapped(module)
    if wrapped:
        return f"modules already data-parallel: {wrapped[:3]}"
    try:
        check_expert_parallel(module, ctx.graph, ctx.plan)
    except LoweringError as exc:
        return str(exc)
    return None


def _ep_run(module: nn.Module, ctx: Context, result: PartResult) -> None:
    from autopar.passes.expert_parallel import apply_expert_parallel

    result.experts = apply_expert_parallel(module, ctx.graph, ctx.plan, ctx.mesh, ctx.part.units)


def _ep_ensures(module: nn.Module, ctx: Context) -> str | None:
    from torch.distributed.tensor import DTensor

    from autopar.experts import ExpertLayout
    from autopar.passes.expert_list import Elsewhere
    from autopar.passes.expert_parallel import moe_blocks

    def split(facts: Any) -> bool:
        experts = module.get_submodule(facts.experts_path)
        if facts.layout is ExpertLayout.MODULE_LIST:  # the other ranks' experts replaced
            away = sum(isinstance(e, Elsewhere) for e in experts)
            return away == facts.num_experts - facts.num_experts // ctx.plan.mesh.ep
        if facts.block_held:  # a capacity block's own 3-D weights, beside its router
            return all(isinstance(p, DTensor) for p in experts.parameters(recurse=False)
                       if p.dim() >= 2 and p.shape[0] == facts.num_experts)
        return all(isinstance(p, DTensor) for p in experts.parameters())

    whole = [m.experts_path for _, m in moe_blocks(ctx.graph, ctx.plan) if not split(m)]
    return f"experts left unsharded: {whole[:3]}" if whole else None


def _cp_applies(ctx: Context) -> bool:
    return ctx.plan.mesh.cp > 1


def _stage_layers(ctx: Context) -> tuple[LayerPlan, ...] | None:
    """A pipeline stage's plan entries (cp hooks its share of the position and attention modules);
    None for the whole model."""
    return None if ctx.part.stage is None else ctx.part.layers


def _cp_requires(module: nn.Module, ctx: Context) -> str | None:
    from autopar.passes.context_parallel import check_context_parallel

    try:
        check_context_parallel(ctx.graph, ctx.plan)
    except LoweringError as exc:
        return str(exc)
    from autopar.passes.context_parallel import part_paths

    layers = _stage_layers(ctx)
    missing = [p for p in part_paths(ctx.graph, layers, (*ctx.graph.cp_positions, *ctx.graph.cp_attention))
               if not _has_module(module, p)]
    return f"position or attention modules not in the model: {missing[:3]}" if missing else None


def _has_module(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _cp_run(module: nn.Module, ctx: Context, result: PartResult) -> None:
    from autopar.passes.context_parallel import apply_context_parallel

    layers = _stage_layers(ctx)
    result.context = apply_context_parallel(module, ctx.graph, ctx.plan, ctx.mesh, layers)


def _cp_ensures(module: nn.Module, ctx: Context) -> str | None:
    from autopar.passes.context_parallel import is_held, part_paths

    layers = _stage_layers(ctx)
    bare = [p for p in part_paths(ctx.graph, layers, ctx.graph.cp_positions)
            if not module.get_submodule(p)._forward_pre_hooks]
    bare += [p for p in part_paths(ctx.graph, layers, ctx.graph.cp_attention) if not is_held(module.get_submodule(p))]
    return f"position or attention modules left without their hook: {bare[:3]}" if bare else None


def _rc_applies(ctx: Context) -> bool:
    return bool(ctx.part.recompute)


def _rc_requires(module: nn.Module, ctx: Context) -> str | None:
    wrapped = [p for p in ctx.part.recompute if _fsdp_wrapped(module.get_submodule(p))]
    return (f"modules already sharded by FSDP2 (recompute must sit inside its hooks): {wrapped[:3]}"
            if wrapped else None)


def _rc_run(module: nn.Module, ctx: Context, result: PartResult) -> None:
    from autopar.contract_compile import compiled_block_paths
    from autopar.passes.recompute import checkpoint_modules

    checkpoint_modules(module, list(ctx.part.recompute), _recompute_kinds(ctx),
                       compiled=set(compiled_block_paths(ctx.graph, ctx.plan)))


def _recompute_kinds(ctx: Context) -> dict[str, Recompute]:
    """How each module of the part's ``recompute`` is checkpointed: as the plan entry of its first
    layer asks (the contract put the module there, so that kind applies; see
    :meth:`autopar.contract.Layout.recompute_kinds`)."""
    kinds: dict[str, Recompute] = {}
    for lp in ctx.part.layers:
        path = ctx.graph.layer(lp.name).module_path
        if path in ctx.part.recompute and lp.choice.recompute:
            kinds.setdefault(path, lp.choice.recompute)
    return kinds


def _rc_ensures(module: nn.Module, ctx: Context) -> str | None:
    from autopar.passes.recompute import CHECKPOINTED_FORWARD

    missing = [p for p in ctx.part.recompute if "checkpoint" not in _registry(m := module.get_submodule(p))
               and not hasattr(m, CHECKPOINTED_FORWARD)]
    return f"modules without checkpoint hooks or a checkpointed forward: {missing[:3]}" if missing else None


def _dp_applies(ctx: Context) -> bool:
    return data_ranks(ctx.plan.mesh) > 1 and bool(ctx.part.units)


def _dp_requires(module: nn.Module, ctx: Context) -> str | None:
    wrapped = _fsdp_wrapped(module)
    return f"modules already data-parallel: {wrapped[:3]}" if wrapped else None


def _dp_run(module: nn.Module, ctx: Context, result: PartResult) -> None:
    from autopar.passes.zero import apply_data_parallel

    experts = result.experts
    ignored = [m for m in experts.modules if m not in {e for e, _ in experts.sharded}] if experts else ()
    result.data_parallel = apply_data_parallel(module, ctx.part.units, data_mesh(ctx.mesh, ctx.plan.mesh.cp),
                                               ignored=ignored, experts=experts,
                                               replicas=ctx.plan.mesh.dp_replicate)


def _dp_ensures(module: nn.Module, ctx: Context) -> str | None:
    from torch.distributed.fsdp import FSDPModule

    bare = [u.path or "<root>" for u in ctx.part.units
            if not (isinstance(m := module.get_submodule(u.path), FSDPModule) or _registry(m))]
    return f"units left unwrapped: {bare[:3]}" if bare else None


@dataclass(frozen=True)
class Pass:
    """A lowering pass and its contract: when it applies, what it requires before it runs,
    what it ensures after (each a check returning None or what is wrong)."""

    name: str
    applies: Callable[[Context], bool]
    requires: Callable[[nn.Module, Context], str | None]
    run: Callable[[nn.Module, Context, PartResult], None]
    ensures: Callable[[nn.Module, Context], str | None]


PASSES: tuple[Pass, ...] = (
    Pass("tensor_parallel", _tp_applies, _tp_requires, _tp_run, _tp_ensures),
    Pass("expert_parallel", _ep_applies, _ep_requires, _ep_run, _ep_ensures),
    Pass("context_parallel", _cp_applies, _cp_requires, _cp_run, _cp_ensures),
    Pass("recompute", _rc_applies, _rc_requires, _rc_run, _rc_ensures),
    Pass("data_parallel", _dp_applies, _dp_requires, _dp_run, _dp_ensures),
)


def _fail(p: Pass, ctx: Context, ran: list[str], what: str) -> LoweringError:
    before = ", ".join(ran) or "none"
    return LoweringError(f"lowering pass {p.name!r} on {ctx.part.describe()} failed: {what} "
                         f"(passes run before it: {before})")


def run_passes(module: nn.Module, ctx: Context, passes: tuple[Pass, ...] = PASSES) -> PartResult:
    """Run ``passes`` in order on ``module``, checking each one's contract."""
    result = PartResult(module)
    for p in passes:
        if not p.applies(ctx):
            continue
        problem = p.requires(module, ctx)
        if problem:
            raise _fail(p, ctx, result.applied, f"requires none, found {problem}")
        try:
            p.run(module, ctx, result)
        except LoweringError as exc:
            raise _fail(p, ctx, result.applied, str(exc)) from None
        problem = p.ensures(module, ctx)
        if problem:
            raise _fail(p, ctx, result.applied, problem)
        result.applied.append(p.name)
    return result


def parallelize_part(module: nn.Module, graph: LayerGraph, plan: Plan, part: Part, mesh: Any,
                     device: torch.device, init_fn: Callable[[nn.Module], None] | None = None) -> PartResult:
    """Lower one part for this rank: move it to ``device`` (or, on the meta device, materialise
    it after sharding, so each rank allocates only its shards), run :data:`PASSES`, and give
    DDP replicas the first rank's weights.

    Requires: ``module`` unsharded; ``mesh`` with the axes of ``plan.mesh`` (:meth:`Mesh.dim_names`)
    (None only when the plan is one rank's).
    """
    from autopar.passes.zero import sync_replicas

    meta = is_meta(module)
    if not meta:
        module.to(device)
    stage_plan = replace(plan, layers=part.layers)
    result = run_passes(module, Context(graph, stage_plan, part, mesh))
    if meta:
        materialise(module, device, init_fn)
    if result.data_parallel is not None:
        sync_replicas(result.data_parallel, data_mesh(mesh, plan.mesh.cp))
    if result.experts is not None:
        from autopar.passes.expert_parallel import sync_expert_replicas

        sync_expert_replicas(result.experts)
    return result


__all__ = ["PASSES", "Context", "Part", "PartResult", "Pass", "parallelize_part", "run_passes"]
