"""Pipeline parallelism: a plan's stages as ``torch.distributed.pipelining`` stages and a schedule.

Takes the model (materialised, unsharded), example inputs, the LayerGraph,
the Plan, the ``(pp, dp, tp)`` DeviceMesh, ``loss_fn(output, targets)`` (the
microbatch mean) and the device. Returns a :class:`PipelineRuntime` whose
``step`` runs one schedule step (forward and backward of every microbatch)
and whose ``parameters`` the optimizer steps.

Lowering, per rank (virtual stage s lives on pp rank ``s % pp``, or in a V for zbv and
dualpipev: stages r and 2·pp − 1 − r on rank r, :meth:`Plan.rank_stages`):

1. split the model into one module per virtual stage (:mod:`.stage_split`);
2. on each of this rank's stages, the one lowering path
   (:func:`autopar.passes.parallelize.parallelize_part`) with the stage's
   slice of the plan and the contract's units for it: tensor parallel,
   recompute, ZeRO/DP last (the stage root is a unit, so the stage is an
   ``FSDPModule`` and pipelining drives its gradient sync);
3. ``PipelineStage`` on the pp axis's group, and the schedule the plan names.

What stays true: gradients are the global-batch mean. ``loss_fn`` averages a
microbatch; the schedule sums microbatch gradients and divides by
``microbatches`` (``scale_grads=True``), giving this dp rank's mean; FSDP /
``replicate`` average over dp. Parameter FQNs are the model's. With
``scale_grads=False`` (a bf16 plan without FSDP2, whose fp32 master
gradients accumulate outside the stages: :mod:`autopar.runtime.precision`)
the caller divides instead.

Export-captured models (Hugging Face) run as ATen graphs in which no layer
module is called, so tensor parallelism and recompute cannot hook them: a
:class:`LoweringError`; the contract never offers them there, and runs each
export stage as one replicated unit. An FX model whose layers could not be
kept as module calls (the split's own fallback, unknown to the planner)
shards each stage as one FSDP unit at the highest ZeRO stage of its layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autopar.batch_coupling import synced
from autopar.contract import ROOT, Layout, Unit, plan_layout, unit_engine
from autopar.errors import BatchError, CompileError, LoweringError
from autopar.graph import LayerGraph
from autopar.passes.batchnorm import batch_norms, sync_batch_norms
from autopar.passes.parallelize import Part, parallelize_part
from autopar.passes.stage_split import StageSplit, split_model
from autopar.passes.tied import TiedEmbeddings, tied_locations
from autopar.plan import Plan

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass
class PipelineRuntime:
    """This rank's pipeline stages and their schedule.

    ``modules`` are this rank's stage modules (after TP/recompute/ZeRO), in
    virtual-stage order ``stage_ids``; ``permutations`` the fused q/k/v
    row orders tensor parallelism applied (by original FQN).
    """

    plan: Plan
    modules: list[nn.Module]
    stage_ids: list[int]
    schedule: Any
    pp_group: Any
    device: torch.device
    tracer: str
    permutations: dict[str, Any] = field(default_factory=dict)  # passes.tensor_parallel.Permutation by FQN
    tied: Any = None  # passes.tied.TiedEmbeddings: tied input/output embeddings split across stages
    experts: list[Any] = field(default_factory=list)  # passes.expert_parallel.ExpertParallelResult per stage

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.plan.stages - 1 in self.stage_ids

    def _schedule_args(self, inputs: Any, targets: torch.Tensor) -> tuple[tuple, dict[str, Any], list]:
        """What a schedule call takes on this rank: inputs on the first stage, targets and a list the
        losses land in on the last."""
        from autopar import inputs as model_inputs

        args: tuple = ()
        kwargs: dict[str, Any] = {}
        if self.has_first:  # keyword inputs go to the first stage's forward as keywords, split per microbatch
            given = model_inputs.to(inputs, self.device)
            args, kwargs = ((), dict(given)) if isinstance(given, dict) else (tuple(given), {})
        losses: list[torch.Tensor] = []
        if self.has_last:  # no targets (the model computes its own loss): an empty marker per microbatch
            target = (targets.to(self.device) if targets is not None
                      else torch.zeros(self.plan.microbatches, 0, device=self.device))
            kwargs |= dict(target=target, losses=losses)
        return args, kwargs, losses

    def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
        """One schedule step on this dp rank's shard (microbatches × microbatch size samples).

        Returns the mean loss over the shard on ranks holding the last stage,
        None elsewhere. Gradients accumulate into ``parameters()`` (the
        caller zeroes them).
        """
        args, kwargs, losses = self._schedule_args(inputs, targets)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if self.tied is not None:
            self.tied.sum_grads()
        if not self.has_last:
            return None
        return torch.stack([l.detach() for l in losses]).mean()

    def evaluate(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only, every microbatch through the stages without gradients: the mean loss over
        this dp rank's shard on ranks holding the last stage, None elsewhere."""
        args, kwargs, losses = self._schedule_args(inputs, targets)
        with torch.no_grad():
            self.schedule.eval(*args, **kwargs)
        if not self.has_last:
            return None
        return torch.stack([l.detach() for l in losses]).mean()


def _check_lowerable(split: StageSplit, plan: Plan, model: nn.Module) -> None:
    """Typed errors, the same on every rank, for what this split cannot lower."""
    if split.layers_called:
        return
    why = ("its layers are inlined into one traced graph (torch.export capture)" if split.tracer == "export"
           else "FX cannot trace it with each layer kept as one module call")
    if plan.training.compiled:
        raise CompileError(f"torch.compile per block inside pipeline stages needs block modules that are "
                           f"called, but {why}; plan it eager (drop --compile / torch_compile), or use pp=1")
    tp = [lp.name for lp in plan.layers if lp.choice.tp is not None]
    if tp and plan.mesh.tp > 1:
        raise LoweringError(f"tensor parallelism inside pipeline stages needs layer modules that are "
                            f"called, but {why}; plan layers {tp[:3]} with tp=none, or use pp=1")
    rc = [lp.name for lp in plan.layers if lp.choice.recompute]
    if rc:
        raise LoweringError(f"recompute inside pipeline stages needs layer modules that are called, "
                            f"but {why}; plan layers {rc[:3]} with recompute=off, or use pp=1")
    if plan.mesh.ep > 1:
        raise LoweringError(f"ep={plan.mesh.ep} inside pipeline stages reroutes the calls of the experts "
                            f"modules, but {why}: no experts module is called; use pp=1 or ep=1")


def stage_part(graph: LayerGraph, plan: Plan, layout: Layout, stage: int, layers_called: bool) -> Part:
    """Stage ``stage``'s slice of the plan and its units from the contract. With its layers
    inlined (no layer module is called), the stage is one unit holding every layer."""
    layers = tuple(lp for lp in plan.layers if lp.stage == stage)
    units = layout.stage_units(stage)
    if not layers_called and len(units) > 1:
        zero = max(u.zero for u in units)
        units = (Unit(ROOT, zero, unit_engine(zero), tuple(lp.name for lp in layers)),)
    return Part(stage, layers, units, tuple(layout.recompute_paths(graph, stage)))


def _state_keeping_stage(base: type) -> type:
    """``PipelineStage`` whose first-step metadata inference (one extra forward past the first stage,
    on inputs made from shapes alone) reads zeros, never uninitialised memory — a stage that computes
    a loss from labels or indexes with ids the first stage sent would otherwise index with garbage —
    and leaves the stage's buffers as they were: BatchNorm's running statistics move only with the
    real microbatches, as on one device. The real microbatches arrive with their real values.
    A schedule hands a rank's keyword inputs to every stage the rank holds; they are the model's
    inputs, the first stage's alone (a later stage receives what it uses of them from the one before:
    given them again, its forward got ``input_ids`` twice)."""

    class StateKeepingStage(base):  # type: ignore[misc, valid-type]
        def forward_one_chunk(self, fwd_chunk_id: int, args: Any, kwargs: Any = None, *rest: Any,
                              **more: Any) -> Any:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs if self.is_first else None, *rest, **more)

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            tensor = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):  # made from metadata: empty memory until zeroed
                with torch.no_grad():
                    tensor.zero_()
            return tensor

        def _forward_metadata_inference(self, args: Any, kwargs: Any = None, *rest: Any) -> Any:
            saved = [(b, b.detach().clone()) for b in self.submod.buffers()]
            try:
                return super()._forward_metadata_inference(args, kwargs if self.is_first else None, *rest)
            finally:
                # through ``.data``: the real forward may already have saved a running statistic
                # for backward (BatchNorm's backward takes it, training mode reads no value of it);
                # a tracked copy would bump its version and fail that backward
                for b, value in saved:
                    b.data.copy_(value)

    return StateKeepingStage


def _output_form(model: nn.Module, example_inputs: Any) -> Callable[[Any], Any] | None:
    """What rebuilds the model's own output (a ``ModelOutput`` with its ``.loss``) from the flat tuple of
    tensors an exported last stage returns, so ``loss_fn`` sees what the model returns as under pp=1;
    None where the model returns no mapping or dataclass, or its form cannot be found."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capturing.boundary import Unsendable, flatten

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            def fake(t: Any) -> Any:
                return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

            if isinstance(example_inputs, dict):
                out = model(**{k: fake(v) for k, v in example_inputs.items()})
            else:
                out = model(*[fake(v) for v in example_inputs])
        paths, build = flatten(out)
    except (Unsendable, Exception):  # noqa: BLE001 - the stage's own output is used as it is
        return None
    if not (isinstance(out, dict) or dataclasses.is_dataclass(out)):
        return None

    def rebuild(output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            output = (output,)
        if not isinstance(output, (tuple, list)) or len(output) != len(paths):
            return output
        return build(iter(output))

    return rebuild


def _checked_loss(loss_fn: LossFn, form: Callable[[Any], Any] | None = None) -> LossFn:
    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        output = form(output) if form is not None else output
        value = loss_fn(output, None if targets.dim() == 2 and targets.shape[1] == 0 else targets)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise BatchError(f"loss_fn must return a scalar tensor (the microbatch mean), got {shape}")
        return value

    return loss


def _schedule(plan: Plan, stages: list[Any], loss_fn: LossFn, scale_grads: bool) -> Any:
    """torch's schedule for the plan: one stage a rank (GPipe, 1F1B), several looped (interleaved 1F1B,
    interleaved zero bubble), or two in a V (ZB-V, DualPipeV; torch sets the stages' rank map itself).
    The split-backward ones run each backward as input then weight gradients (``stage_backward_input`` /
    ``stage_backward_weight``) and divide by the microbatches in their REDUCE_GRAD action, as the others do."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from autopar.cost_models.pipeline import ScheduleKind

    m = plan.microbatches
    multi = {ScheduleKind.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
             ScheduleKind.INTERLEAVED_ZB: ScheduleInterleavedZeroBubble,
             ScheduleKind.ZBV: ScheduleZBVZeroBubble, ScheduleKind.DUALPIPE_V: ScheduleDualPipeV}.get(plan.schedule)
    if multi is not None:
        return multi(stages, m, loss_fn=loss_fn, scale_grads=scale_grads)
    single = {ScheduleKind.GPIPE: ScheduleGPipe, ScheduleKind.ONE_F_ONE_B: Schedule1F1B}.get(plan.schedule)
    if single is None or len(stages) != 1:
        raise LoweringError(f"pipeline schedule {plan.schedule.value!r} with {plan.chunks} chunk(s) per rank "
                            "is not supported: use gpipe, 1f1b (1 chunk), interleaved_1f1b, interleaved_zb, "
                            "zbv or dualpipev")
    return single(stages[0], m, loss_fn=loss_fn, scale_grads=scale_grads)


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


def _hf_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """Initialise a stage of a Hugging Face model as the model itself does, module by module."""
    def init(stage: nn.Module) -> None:
        for module in stage.modules():
            model._init_weights(module)  # type: ignore[operator]

    return init


def _off_meta(gm: Any, device: torch.device) -> None:
    """Tensors a stage creates on the device the trace saw (``arange(…, device=meta)`` when traced on
    the meta device: export bakes it in) are created on ``device`` instead."""
    meta = torch.device("meta")
    changed = False
    for node in gm.graph.nodes:
        if node.kwargs.get("device") in (meta, "meta"):
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        gm.recompile()


def _agree(failure: str) -> None:
    """Every rank raises the first rank's failure to lower its stages, or none does: a rank that
    failed alone would leave the others waiting in the schedule's first exchange."""
    import torch.distributed as dist

    failures: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f), "")
    if first:
        raise LoweringError(first)


def build_pipeline(model: nn.Module, example_inputs: Any, graph: LayerGraph, plan: Plan, mesh: Any,
                   loss_fn: LossFn, device: torch.device,
                   init_fn: Callable[[nn.Module], None] | None = None, *,
                   scale_grads: bool = True) -> PipelineRuntime:
    """Lower ``plan`` (pp > 1) for this rank; see the module docstring.

    Requires: an initialised process group, ``mesh`` with axes ("pp", "dp",
    "tp") matching ``plan.mesh``, ``example_inputs`` shaped like one batch.
    Raises :class:`LoweringError` (the same on every rank, before any
    collective of its own) for what cannot be lowered. A meta-device model is
    materialised stage by stage after sharding: each rank allocates only its
    own stages' shards (``init_fn`` on each stage module, else a Hugging Face
    model's own ``_init_weights`` per module, else ``reset_parameters()``). ``scale_grads``: whether the schedule
    divides the stages' gradients by the microbatch count.
    """
    from torch.distributed.pipelining import PipelineStage

    if example_inputs is None:
        raise LoweringError("pipeline plans need example_inputs to split the model: pass them to compile")
    microbatch = _microbatch_inputs(example_inputs, plan.microbatch_size)
    if plan.mesh.cp > 1:  # the stages run on the cp rank's S/cp tokens: traced (export specialises) and sent so
        from autopar.passes.context_parallel import shard_sequence

        microbatch = shard_sequence(microbatch, graph.seq_len, plan.mesh.cp, mesh["cp"].get_local_rank())
    split = split_model(model, microbatch, graph, plan)
    form = _output_form(model, microbatch) if split.tracer.startswith("export") else None
    _check_lowerable(split, plan, model)
    if plan.mesh.dp > 1 and synced(plan.training.batch_coupled) and batch_norms(model) \
            and not any(batch_norms(m) for m in split.modules):
        raise LoweringError(f"{model.__class__.__name__}'s BatchNorm layers are traced into ops in its pipeline "
                            "stages, so under dp they would normalise with each rank's shard only: "
                            "pin pp=1, dp=1 or batch_coupled=split")
    if init_fn is None and callable(getattr(model, "_init_weights", None)):
        init_fn = _hf_init(model)  # a Hugging Face model's own initialisation (norms, rotary tables…)
    for module in split.modules:
        _off_meta(module, device)
    layout = plan_layout(graph, plan)
    pp, pp_rank = plan.mesh.pp, mesh["pp"].get_local_rank()
    stage_ids = plan.rank_stages(pp_rank)  # looped (s mod pp) or in a V (s and 2·pp − 1 − s)
    modules: list[nn.Module] = []
    perms: dict[str, Any] = {}
    experts: list[Any] = []
    shared = [model.get_parameter(name) for name in dict.fromkeys(p for l in graph for p in l.tied_params)]
    # tied embeddings: where the first and last stage hold them, found before lowering replaces them
    ends = {k: tied_locations(split.modules[k], shared) for k in stage_ids if k in (0, plan.stages - 1)}
    failure = ""
    for k in stage_ids:
        part = stage_part(graph, plan, layout, k, split.layers_called)
        if plan.mesh.dp > 1 and synced(plan.training.batch_coupled):  # BatchNorm over the dp group's batch
            sync_batch_norms(split.modules[k], mesh["dp"].get_group())
        try:
            result = parallelize_part(split.modules[k], graph, plan, part, mesh, device, init_fn)
        except LoweringError as exc:  # e.g. a buffer of a meta model nothing gives a value: this rank only
            failure = f"stage {k}: {exc}"
            break
        perms.update(result.permutations)
        modules.append(result.module)
        if result.experts is not None:  # ep: this stage's experts, reduced over its edp group each step
            experts.append(result.experts)
    _agree(failure)
    located = [(modules[stage_ids.index(k)], names) for k, names in ends.items()]
    tied = TiedEmbeddings.build(mesh, pp, located) if shared else None
    if tied is not None:
        tied.share_weights()
    group = mesh["pp"].get_group()
    stage_cls = _state_keeping_stage(PipelineStage)
    stages = [stage_cls(mod, k, plan.stages, device, group=group) for mod, k in zip(modules, stage_ids)]
    schedule = _schedule(plan, stages, _checked_loss(loss_fn, form), scale_grads)
    return PipelineRuntime(plan, modules, stage_ids, schedule, group, device, split.tracer, perms, tied, experts)


__all__ = ["PipelineRuntime", "build_pipeline", "stage_part"]
