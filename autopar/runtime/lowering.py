"""Lowering: a Plan made into this rank's model parts.

The model becomes a list of *parts*: ``[model]`` without a pipeline, or this
rank's pipeline stages. Every part goes through the one lowering path,
:func:`autopar.passes.parallelize.parallelize_part` (tensor parallel →
recompute → ZeRO/DP), with its slice of the plan and its units from the
contract (:func:`autopar.contract.plan_layout`); the pipeline pass splits the
stages and calls that same function for each. What :class:`Lowered` holds is
therefore the same whatever the plan: parts, the mesh, what each pass made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.batch_coupling import refusal as coupling_refusal
from autopar.batch_coupling import synced
from autopar.contract import plan_layout
from autopar.contract_hsdp import hsdp_refusal
from autopar.errors import LoweringError, PlanError
from autopar.graph import LayerGraph
from autopar.passes.batchnorm import sync_batch_norms
from autopar.passes.parallelize import Part, PartResult, parallelize_part
from autopar.plan import Plan
from autopar.runtime.launch import device as rank_device
from autopar.runtime.precision import plan_dtype

InitFn = Callable[[nn.Module], None]


@dataclass
class Lowered:
    """What lowering made of the model on this rank.

    ``parts`` are the modules this rank trains (``[model]``, or its pipeline
    stages); ``data_parallel`` what the ZeRO pass made of each (None where dp
    = 1); ``pipeline`` the schedule runtime when pp > 1; ``pp_group`` the
    group whose ranks hold the other stages (None without a pipeline).
    """

    parts: list[nn.Module]
    mesh: Any = None
    data_parallel: list[Any] = field(default_factory=list)
    permutations: dict[str, Any] = field(default_factory=dict)  # passes.tensor_parallel.Permutation by FQN
    pipeline: Any = None  # passes.pipeline.PipelineRuntime
    pp_group: Any = None
    experts: list[Any] = field(default_factory=list)  # passes.expert_parallel.ExpertParallelResult per part
    context: Any = None  # passes.context_parallel.ContextParallelResult when cp > 1

    @property
    def module(self) -> nn.Module:
        """The first part: the whole model without a pipeline."""
        return self.parts[0]

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original FQNs (each part's own)."""
        return [item for part in self.parts for item in part.named_parameters()]


def _pipeline_builder() -> Callable[..., Any]:
    try:
        from autopar.passes.pipeline import build_pipeline
    except ImportError:
        raise PlanError("pipeline plans need autopar.passes.pipeline") from None
    return build_pipeline


def whole_model_part(graph: LayerGraph, plan: Plan) -> Part:
    """The plan's one part when there is no pipeline: every layer, the contract's units."""
    layout = plan_layout(graph, plan)
    return Part(None, plan.layers, layout.stage_units(0), tuple(layout.recompute_paths(graph)))


def _from_parts(results: list[PartResult], mesh: Any, **kwargs: Any) -> Lowered:
    perms: dict[str, Any] = {}
    for r in results:
        perms.update(r.permutations)
    return Lowered([r.module for r in results], mesh,
                   [r.data_parallel for r in results], perms, **kwargs,
                   experts=[r.experts for r in results if r.experts is not None],
                   context=next((r.context for r in results if r.context is not None), None))


def lower(model: nn.Module, graph: LayerGraph, plan: Plan, *, example_inputs: Any,
          loss_fn: Callable[..., torch.Tensor], init_fn: InitFn | None) -> Lowered:
    """Lower ``plan`` for this rank of the initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.passes.context_parallel import check_context_parallel, data_mesh
    from autopar.passes.expert_parallel import check_expert_parallel, expert_mesh
    from autopar.passes.tensor_parallel import check_tensor_parallel
    from autopar.passes.zero import compute_dtype, hsdp_mesh

    device, dp = rank_device(), plan.mesh.dp
    # every check that can fail runs before the first collective (the mesh's groups)
    builder = _pipeline_builder() if plan.mesh.pp > 1 else None
    check_tensor_parallel(model, graph, plan, plan.mesh.tp)
    check_expert_parallel(model, graph, plan)
    if why := coupling_refusal(graph, plan.mesh, plan.microbatches, plan.training.batch_coupled):
        raise LoweringError(why)
    check_context_parallel(graph, plan)
    if why := hsdp_refusal(plan.mesh, compiled=plan.training.compiled, float8=plan.training.float8 is not None):
        raise LoweringError(why)
    if plan.mesh.cp > 1 and graph.cp_manual:  # attention written by hand: its rewrite checked on the module
        from autopar.passes.manual_attention import prove_manual_attention

        prove_manual_attention(model, graph, plan.mesh.cp, str(plan.cp_attention) == "ulysses")
    # the plan mesh's axes, outermost first (autopar.mesh: the rank layout pricing assumed)
    mesh = init_device_mesh(device.type, plan.mesh.degrees, mesh_dim_names=plan.mesh.dim_names())
    if plan.mesh.cp > 1:  # the flattened dp × cp dimension data parallelism wraps over, made by every rank
        data_mesh(mesh, plan.mesh.cp)
    if plan.mesh.dp_replicate > 1:  # hybrid sharding's 2-D mesh, made by every rank before any part is lowered
        hsdp_mesh(data_mesh(mesh, plan.mesh.cp), plan.mesh.dp_replicate)
    if plan.mesh.ep > 1:  # ep's groups, folded into dp (× cp): made by every rank before any part is lowered
        expert_mesh(mesh, plan.mesh.ep)
    dtype = plan_dtype(plan.training.dtype)
    with compute_dtype(dtype):
        if builder is not None:
            # without FSDP2 (dp = 1) a bf16 plan's fp32 masters take the gradients, scaled there
            runtime = builder(model, example_inputs, graph, plan, mesh, loss_fn, device, init_fn=init_fn,
                              scale_grads=dtype is None or dp > 1)
            return Lowered(runtime.modules, mesh, [None] * len(runtime.modules), runtime.permutations,
                           pipeline=runtime, pp_group=runtime.pp_group, experts=runtime.experts)
        if dp > 1 and synced(plan.training.batch_coupled):  # BatchNorm over the whole dp group's batch
            sync_batch_norms(model, mesh["dp"].get_group())
        result = parallelize_part(model, graph, plan, whole_model_part(graph, plan), mesh, device, init_fn)
    return _from_parts([result], mesh)


def lower_local(model: nn.Module, graph: LayerGraph, plan: Plan, init_fn: InitFn | None) -> Lowered:
    """One rank and no process group: the same path, where only recompute applies."""
    result = parallelize_part(model, graph, plan, whole_model_part(graph, plan), None,
                              torch.device("cpu"), init_fn)
    return _from_parts([result], None)


def held_group(lowered: Lowered) -> Any:
    """The ep group whose ranks hold different experts of a module list (None without any): their
    experts are plain tensors of one rank each, gathered over it (``passes/expert_list.py``)."""
    return next((r.ep_group for r in lowered.experts if r.held), None)


def held_params(lowered: Lowered) -> set[int]:
    """ids of the parameters this rank alone of its ep group holds (a module list's local experts)."""
    return {id(p) for r in lowered.experts for m in r.held for p in m.parameters()}


def gather_all(local: dict[str, Any], lowered: Lowered) -> dict[str, Any]:
    """Every stage's and every ep rank's tensors on every rank (collectives): over the pipeline group,
    then over the ep group where a module list's experts are held by one rank of it each (an ep group
    is the same dp ranks on every stage, so the two gathers cover the whole model)."""
    return gather_parts(gather_parts(local, lowered.pp_group), held_group(lowered))


def gather_parts(local: dict[str, Any], pp_group: Any) -> dict[str, Any]:
    """Every rank's tensors of ``pp_group`` (a pipeline's, or an ep group) on every rank of it (a
    collective); ``local`` itself without one."""
    if pp_group is None:
        return local
    local = {k: v.cpu() for k, v in local.items()}
    parts: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, local, group=pp_group)
    return {k: v for part in parts for k, v in part.items()}
