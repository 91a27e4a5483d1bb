"""Pipeline parallelism: a plan's stages as ``torch.distributed.pipelining`` stages and a schedule.

Takes the model (materialised, unsharded), example inputs, the LayerGraph,
the Plan, the ``(pp, dp, tp)`` DeviceMesh, ``loss_fn(output, targets)`` (the
microbatch mean) and the device. Returns a :class:`PipelineRuntime` whose
``step`` runs one schedule step (forward and backward of every microbatch)
and whose ``parameters`` the optimizer steps.

Lowering, per rank (virtual stage s lives on pp rank ``s % pp``):

1. split the model into one module per virtual stage (:mod:`.stage_split`);
2. on each of this rank's stages, the pp = 1 passes in torchtitan's order,
   each handed the plan restricted to the stage's layers: tensor parallel
   over the tp axis (swaps weights for DTensors), recompute (its hooks sit
   inside FSDP's), ZeRO/DP over the dp axis last (wraps the stage root, so
   the stage is an ``FSDPModule`` and pipelining drives its gradient sync);
3. ``PipelineStage`` on the pp axis's group, and the schedule the plan names.

What stays true: gradients are the global-batch mean. ``loss_fn`` averages a
microbatch; the schedule sums microbatch gradients and divides by
``microbatches`` (``scale_grads=True``), giving this dp rank's mean; FSDP /
``replicate`` average over dp. Parameter FQNs are the model's.

Export-captured models (Hugging Face) run as ATen graphs in which no layer
module is called, so tensor parallelism and recompute cannot hook them: a
:class:`LoweringError`. ZeRO then shards each stage as one FSDP unit (the
highest zero stage of its layers; plain ``replicate`` if all are 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import BatchError, LoweringError
from autopar.graph import LayerGraph
from autopar.plan import Plan
from autopar.passes.stage_split import StageSplit, split_model

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass
class PipelineRuntime:
    """This rank's pipeline stages and their schedule.

    ``modules`` are this rank's stage modules (after TP/recompute/ZeRO), in
    virtual-stage order ``stage_ids``; ``row_permutations`` the fused q/k/v
    row orders tensor parallelism applied (by original FQN).
    """

    plan: Plan
    modules: list[nn.Module]
    stage_ids: list[int]
    schedule: Any
    pp_group: Any
    device: torch.device
    tracer: str
    row_permutations: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.plan.stages - 1 in self.stage_ids

    def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
        """One schedule step on this dp rank's shard (microbatches × microbatch size samples).

        Returns the mean loss over the shard on ranks holding the last stage,
        None elsewhere. Gradients accumulate into ``parameters()`` (the
        caller zeroes them).
        """
        args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        args = tuple(a.to(self.device) for a in args) if self.has_first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.has_last:
            kwargs = dict(target=targets.to(self.device), losses=losses)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.has_last:
            return None
        return torch.stack([l.detach() for l in losses]).mean()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original FQNs (each stage's own)."""
        for mod in self.modules:
            yield from mod.named_parameters()

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pp rank's tensors, fused q/k/v rows put back in the original order first."""
        local = {k: self._unpermute(k, v).cpu() for k, v in local.items()}
        parts: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(parts, local, group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()}

    def _unpermute(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        perm = self.row_permutations.get(name)
        return tensor if perm is None else tensor[torch.argsort(perm).to(tensor.device)]

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every stage's gradients, unsharded and in the original layout, on every rank (a collective)."""
        from torch.distributed.tensor import DTensor

        local = {}
        for name, p in self.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                local[name] = g.detach()
        return self._gather(local)

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """``full``: every stage's unsharded state in the original layout on every rank (a collective);
        else this rank's shards (fused q/k/v rows permuted, see ``row_permutations``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local: dict[str, Any] = {}
        for mod in self.modules:
            local.update(get_model_state_dict(mod, options=StateDictOptions(full_state_dict=full)))
        return self._gather(local) if full else local


def _check_lowerable(split: StageSplit, plan: Plan, model: nn.Module) -> None:
    """Typed errors, the same on every rank, for what this split cannot lower."""
    if split.layers_called:
        return
    why = ("its layers are inlined into one traced graph (torch.export capture)" if split.tracer == "export"
           else "FX cannot trace it with each layer kept as one module call")
    tp = [lp.name for lp in plan.layers if lp.tp is not None]
    if tp and plan.mesh.tp > 1:
        raise LoweringError(f"tensor parallelism inside pipeline stages needs layer modules that are "
                            f"called, but {why}; plan layers {tp[:3]} with tp=none, or use pp=1")
    rc = [lp.name for lp in plan.layers if lp.recompute]
    if rc:
        raise LoweringError(f"recompute inside pipeline stages needs layer modules that are called, "
                            f"but {why}; plan layers {rc[:3]} with recompute=off, or use pp=1")


def _stage_graph_view(graph: LayerGraph, split: StageSplit) -> LayerGraph:
    """The graph the ZeRO pass sees: with layers inlined, every layer's parameters belong to the stage root."""
    if split.layers_called:
        return graph
    layers = [replace(l, module_path=None) for l in graph]
    return LayerGraph(layers, model_name=graph.model_name, example_batch=graph.example_batch,
                      dtype_bytes=graph.dtype_bytes, tracer=graph.tracer, seq_len=graph.seq_len)


def _lower_stage(module: nn.Module, k: int, graph: LayerGraph, plan: Plan, mesh: Any,
                 row_permutations: dict[str, torch.Tensor]) -> None:
    """Stage k's passes in torchtitan's order (see the module docstring), each on the stage's plan."""
    from autopar.passes.recompute import apply_recompute
    from autopar.passes.tensor_parallel import apply_tensor_parallel
    from autopar.passes.zero import apply_data_parallel

    stage_plan = replace(plan, layers=tuple(lp for lp in plan.layers if lp.stage == k))
    tp_result = apply_tensor_parallel(module, graph, stage_plan, mesh["tp"])
    row_permutations.update(tp_result.row_permutations)
    apply_recompute(module, graph, stage_plan)
    if plan.mesh.dp > 1:
        apply_data_parallel(module, graph, stage_plan, mesh["dp"], allow_ddp=False)


def _checked_loss(loss_fn: LossFn) -> LossFn:
    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        value = loss_fn(output, targets)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise BatchError(f"loss_fn must return a scalar tensor (the microbatch mean), got {shape}")
        return value

    return loss


def _schedule(plan: Plan, stages: list[Any], loss_fn: LossFn) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    m = plan.microbatches
    if plan.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(plan.schedule)
    if single is None or len(stages) != 1:
        raise LoweringError(f"pipeline schedule {plan.schedule!r} with {plan.chunks} chunk(s) per rank "
                            "is not supported: use gpipe, 1f1b (1 chunk) or interleaved_1f1b")
    return single(stages[0], m, loss_fn=loss_fn)


def _microbatch_inputs(example_inputs: Any, size: int) -> Any:
    """Example inputs resized to one microbatch on dim 0 (export specialises on the batch size)."""
    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        return t[:1].expand(size, *t.shape[1:]).clone()

    if isinstance(example_inputs, dict):
        return {k: resize(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor):
        return (resize(example_inputs),)
    return tuple(resize(t) for t in example_inputs)


def build_pipeline(model: nn.Module, example_inputs: Any, graph: LayerGraph, plan: Plan, mesh: Any,
                   loss_fn: LossFn, device: torch.device,
                   init_fn: Callable[[nn.Module], None] | None = None) -> PipelineRuntime:
    """Lower ``plan`` (pp > 1) for this rank; see the module docstring.

    Requires: an initialised process group, ``mesh`` with axes ("pp", "dp",
    "tp") matching ``plan.mesh``, ``example_inputs`` shaped like one batch.
    Raises :class:`LoweringError` (the same on every rank, before any
    collective of its own) for what cannot be lowered. A meta-device model is
    materialised stage by stage after sharding: each rank allocates only its
    own stages' shards (``init_fn`` on each stage module, else
    ``reset_parameters()`` per module).
    """
    from autopar.passes.materialise import materialise
    from torch.distributed.pipelining import PipelineStage

    if example_inputs is None:
        raise LoweringError("pipeline plans need example_inputs to split the model: pass them to compile")
    split = split_model(model, _microbatch_inputs(example_inputs, plan.microbatch_size), graph, plan)
    _check_lowerable(split, plan, model)
    view = _stage_graph_view(graph, split)
    pp, pp_rank = plan.mesh.pp, mesh["pp"].get_local_rank()
    stage_ids = list(range(pp_rank, plan.stages, pp))
    modules: list[nn.Module] = []
    perms: dict[str, torch.Tensor] = {}
    meta = any(p.is_meta for p in model.parameters())
    for k in stage_ids:
        module = split.modules[k] if meta else split.modules[k].to(device)
        _lower_stage(module, k, view, plan, mesh, perms)
        if meta:
            materialise(module, device, init_fn)
        modules.append(module)
    group = mesh["pp"].get_group()
    stages = [PipelineStage(mod, k, plan.stages, device, group=group) for mod, k in zip(modules, stage_ids)]
    schedule = _schedule(plan, stages, _checked_loss(loss_fn))
    return PipelineRuntime(plan, modules, stage_ids, schedule, group, device, split.tracer, perms)


__all__ = ["PipelineRuntime", "build_pipeline"]
