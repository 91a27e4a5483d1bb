"""The runtime: lower a Plan for this rank and train it.

    pm = autopar.compile(model, example_inputs=(idx,))      # inside torchrun
    for x, y in batches:
        loss = pm.train_step(pm.local_batch(x), pm.local_batch(y))

:func:`compile` captures the model (or takes a plan), and inside a process
group lowers the plan with the passes in torchtitan's order — tensor
parallel, recompute, ZeRO/DP last — then builds the optimizer. Outside one,
with more than one rank, it returns the plan-only :class:`ParallelModel`
whose ``train_step`` says how to launch.

A rank that raises must not hang the others: every check that can fail on
bad input (world size, tp divisibility, a missing pipeline pass, batch
shape, loss shape) is deterministic — the same on every rank given the same
plan and shapes — and the compile-time ones run before the first collective
(the device mesh). If a rank still exits alone, torchrun tears the group down
when any process exits non-zero.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import AutoparError, BatchError, LaunchError, PlanError
from autopar.graph import LayerGraph
from autopar.passes.materialise import is_meta, materialise
from autopar.plan import Plan, Predicted

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with lr 1e-3: the optimizer ``compile`` builds when none is given."""
    return torch.optim.AdamW(params, lr=1e-3)


def default_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the last dim for integer targets (logits), else mean squared error.

    Hugging Face outputs are unwrapped to ``.logits``; a tuple to its first element.
    """
    if hasattr(output, "logits"):
        output = output.logits
    elif isinstance(output, (tuple, list)):
        output = output[0]
    if not targets.is_floating_point():
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
    return F.mse_loss(output, targets)


# ------------------------------------------------------------------ launch


def _ensure_process_group() -> bool:
    """True inside a process group; under torchrun's env vars, initialise one (NCCL on GPU, else gloo)."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_hint(world_size: int) -> str:
    return (f"launch one process per rank: `torchrun --nproc-per-node {world_size} script.py` "
            f"or `autopar run script.py --nproc {world_size}`")


# ------------------------------------------------------------------ the plan


def _solve_everywhere(graph: LayerGraph, world_size: int, launched: bool, **kwargs: Any) -> Plan:
    """Solve on rank 0 and broadcast, so every rank lowers the same plan (CP-SAT with
    several workers may pick different optima); an error on rank 0 is raised on all."""
    from autopar.planning.api import solve

    if not launched or dist.get_world_size() == 1:
        return solve(graph, world_size, **kwargs)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("plan", solve(graph, world_size, **kwargs).to_json())
        except AutoparError as exc:
            box[0] = ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        import autopar.errors as errors

        raise getattr(errors, box[0][1], AutoparError)(box[0][2])
    return Plan.from_json(box[0][1])


def resolve_plan(model: nn.Module, example_inputs: Any, plan: Plan | str | Path | None,
                 graph: LayerGraph | None, world_size: int, launched: bool,
                 **solve_kwargs: Any) -> tuple[Plan, LayerGraph]:
    """The plan to run and the graph it was made for (captured unless given)."""
    if graph is None:
        if example_inputs is None:
            raise AutoparError("compile needs example_inputs to capture the model "
                               "(a tuple of tensors shaped like one batch)")
        from autopar.capturing import capture

        graph = capture(model, example_inputs)
    if plan is None:
        return _solve_everywhere(graph, world_size, launched, **solve_kwargs), graph
    if isinstance(plan, (str, Path)):
        return Plan.load(plan, fingerprint=graph.fingerprint()), graph
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be a Plan or a path to plan JSON, got {type(plan).__name__}")
    plan.check_fingerprint(graph.fingerprint())
    return plan, graph


def _check_world(plan: Plan, world_size: int, launched: bool) -> None:
    if launched and dist.get_world_size() != plan.world_size:
        raise PlanError(f"the plan is for {plan.world_size} ranks but {dist.get_world_size()} "
                        f"were launched: re-plan for {dist.get_world_size()} or "
                        f"{launch_hint(plan.world_size)}")
    if plan.world_size != world_size:
        raise PlanError(f"the plan is for {plan.world_size} ranks but world_size is {world_size}: "
                        "re-plan for this world size")


# ------------------------------------------------------------------ lowering


@dataclass
class Lowered:
    """What lowering made of the model on this rank."""

    module: nn.Module
    mesh: Any = None
    data_parallel: Any = None  # passes.zero.DataParallelResult
    row_permutations: dict[str, torch.Tensor] = field(default_factory=dict)
    pipeline: Any = None  # passes.pipeline.PipelineRuntime


def _pipeline_builder() -> Callable[..., Any]:
    try:
        from autopar.passes.pipeline import build_pipeline
    except ImportError:
        raise PlanError("pipeline plans need autopar.passes.pipeline") from None
    return build_pipeline


def lower(model: nn.Module, graph: LayerGraph, plan: Plan, *, example_inputs: Any,
          loss_fn: LossFn, init_fn: Callable[[nn.Module], None] | None) -> Lowered:
    """Lower ``plan`` for this rank of the initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.passes.recompute import apply_recompute
    from autopar.passes.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
    from autopar.passes.zero import apply_data_parallel, sync_replicas

    device, (pp, dp, tp) = _device(), (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp)
    # every check that can fail runs before the first collective (the mesh's groups)
    builder = _pipeline_builder() if pp > 1 else None
    check_tensor_parallel(model, graph, plan, tp)
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    if builder is not None:
        runtime = builder(model, example_inputs, graph, plan, mesh, loss_fn, device, init_fn=init_fn)
        return Lowered(module=model, mesh=mesh, pipeline=runtime,
                       row_permutations=runtime.row_permutations)
    meta = is_meta(model)
    if not meta:
        model.to(device)
    # Order matters (torchtitan's): TP first, since it swaps weights for DTensors that
    # FSDP2 must then shard over dp as a 2-D layout; recompute next, so its hooks sit
    # inside FSDP's gather/free hooks and a recomputed forward still finds parameters;
    # ZeRO/DP last, wrapping the final parameters and every module call outermost.
    tp_result = apply_tensor_parallel(model, graph, plan, mesh["tp"])
    apply_recompute(model, graph, plan)
    dp_result = apply_data_parallel(model, graph, plan, mesh["dp"]) if dp > 1 else None
    if meta:
        materialise(model, device, init_fn)
    if dp_result is not None:
        sync_replicas(dp_result, mesh["dp"])
    return Lowered(module=model, mesh=mesh, data_parallel=dp_result,
                   row_permutations=tp_result.row_permutations)


def _lower_local(model: nn.Module, graph: LayerGraph, plan: Plan,
                 init_fn: Callable[[nn.Module], None] | None) -> Lowered:
    """One rank and no process group: only recompute applies."""
    from autopar.passes.recompute import apply_recompute

    apply_recompute(model, graph, plan)
    if is_meta(model):
        materialise(model, torch.device("cpu"), init_fn)
    return Lowered(module=model)


# ------------------------------------------------------------------ the trainable model


def _as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _unpermute(name: str, tensor: torch.Tensor, perms: dict[str, torch.Tensor]) -> torch.Tensor:
    perm = perms.get(name)
    return tensor if perm is None else tensor[torch.argsort(perm).to(tensor.device)]


@dataclass
class ParallelModel:
    """A model lowered for this rank: train it with :meth:`train_step`.

    ``module`` is this rank's model (its parameters DTensors where sharded);
    ``optimizer`` steps this rank's shards. Plan-only (``launched`` false) when
    compiled outside a process group for several ranks: inspect ``plan``, and
    ``train_step`` raises :class:`LaunchError`.
    """

    plan: Plan
    graph: LayerGraph
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_fn: LossFn
    launched: bool
    lowered: Lowered | None = None

    @property
    def predicted(self) -> Predicted:
        return self.plan.predicted

    @property
    def local_batch_size(self) -> int:
        """Samples per step on one data-parallel rank: microbatches × microbatch size."""
        return self.plan.microbatches * self.plan.microbatch_size

    def _require_launch(self) -> Lowered:
        if self.lowered is None:
            raise LaunchError(f"this plan runs on {self.plan.world_size} ranks and no process group "
                              f"is initialised: {launch_hint(self.plan.world_size)}")
        return self.lowered

    def _dp_rank(self) -> int:
        mesh = self._require_launch().mesh
        return 0 if mesh is None else mesh["dp"].get_local_rank()

    def local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """This dp rank's slice of a global batch (the tp and pp ranks of a dp group share it)."""
        dp = self.plan.mesh.dp
        expected = dp * self.local_batch_size
        if tensor.shape[0] != expected:
            raise BatchError(f"a global batch for this plan has {expected} samples (dp {dp} × "
                             f"microbatches {self.plan.microbatches} × microbatch size "
                             f"{self.plan.microbatch_size}), got {tensor.shape[0]}")
        return tensor.chunk(dp)[self._dp_rank()]

    def _check_batch(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> None:
        n = self.local_batch_size
        for what, t in [("inputs", x) for x in inputs] + [("targets", targets)]:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
                got = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else "no batch dim"
                raise BatchError(f"train_step takes this rank's data-parallel shard of {n} samples "
                                 f"(microbatches {self.plan.microbatches} × microbatch size "
                                 f"{self.plan.microbatch_size}); {what} has {got}. Use local_batch() "
                                 "on the global batch")

    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        """One optimizer step on this rank's shard; returns the global-batch mean loss (same on every rank)."""
        lowered = self._require_launch()
        inputs = _as_tuple(inputs)
        self._check_batch(inputs, targets)
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        if lowered.pipeline is not None:
            loss = self._pipeline_step(lowered, inputs, targets)
        else:
            loss = self._accumulate(lowered, inputs, targets)
        self.optimizer.step()
        if dist.is_initialized() and dist.get_world_size() > 1:
            # each dp group's mean is held by its tp ranks (of the last stage; other
            # stages hold zeros): the sum over the world / (dp × tp) is the global mean
            dist.all_reduce(loss)
            loss = loss / (self.plan.mesh.dp * self.plan.mesh.tp)
        return float(loss)

    def _accumulate(self, lowered: Lowered, inputs: tuple[torch.Tensor, ...],
                    targets: torch.Tensor) -> torch.Tensor:
        """Gradient accumulation: each microbatch's loss scaled by 1/m, so gradients are the batch mean."""
        from autopar.passes.zero import set_last_microbatch

        device, m = _device() if self.launched else torch.device("cpu"), self.plan.microbatches
        xs = [x.to(device).chunk(m) for x in inputs]
        ys = targets.to(device).chunk(m)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(m):
            if lowered.data_parallel is not None:
                set_last_microbatch(lowered.data_parallel, i == m - 1)
            loss = self.loss_fn(self.module(*(x[i] for x in xs)), ys[i])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise BatchError(f"loss_fn must return a scalar tensor (the microbatch mean), got {shape}")
            (loss / m).backward()
            total += loss.detach().double()
        return total / m

    def _pipeline_step(self, lowered: Lowered, inputs: tuple[torch.Tensor, ...],
                       targets: torch.Tensor) -> torch.Tensor:
        """The pipeline runtime's step: forward and backward of every microbatch, returning
        the mean loss of this rank's shard on last-stage ranks and None elsewhere."""
        device = _device()
        loss = lowered.pipeline.step(inputs if len(inputs) > 1 else inputs[0], targets)
        if loss is None:
            return torch.zeros((), dtype=torch.float64, device=device)
        return loss.detach().double().to(device)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient, unsharded and in the original layout (a collective)."""
        from torch.distributed.tensor import DTensor

        perms = self.lowered.row_permutations if self.lowered else {}
        if self.lowered is not None and self.lowered.pipeline is not None:  # pp > 1: every stage's
            return self.lowered.pipeline.full_grads()
        out = {}
        for name, p in self.module.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = _unpermute(name, g.detach(), perms)
        return out

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """The model's state dict; ``full``: unsharded tensors keyed by the original FQNs on every
        rank (a collective), else this rank's DTensor shards (fused q/k/v rows permuted)."""
        if self.lowered is None or self.lowered.mesh is None:
            return self.module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.lowered.pipeline is not None:  # pp > 1: the stages' modules, gathered over pp if full
            return self.lowered.pipeline.state_dict(full)
        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=full))
        if full:
            sd = {k: _unpermute(k, v, self.lowered.row_permutations) for k, v in sd.items()}
        return sd

    def local_param_bytes(self) -> int:
        """Bytes of parameters this rank holds (its shards only)."""
        from torch.distributed.tensor import DTensor

        total = 0
        pipeline = self.lowered.pipeline if self.lowered is not None else None
        for p in (pipeline.parameters() if pipeline is not None else self.module.parameters()):
            t = p.to_local() if isinstance(p, DTensor) else p
            total += t.numel() * t.element_size()
        return total


# ------------------------------------------------------------------ compile


def compile(model: nn.Module, world_size: int | None = None, example_inputs: Any = None,
            cluster: Any = None, plan: Plan | str | Path | None = None, pins: Any = None,
            loss_fn: LossFn | None = None, optimizer: OptimizerFactory | None = None, *,
            init_fn: Callable[[nn.Module], None] | None = None, graph: LayerGraph | None = None,
            **solve_kwargs: Any) -> ParallelModel:
    """Plan (or load a plan for) ``model`` and lower it for this rank.

    ``world_size`` defaults to the process group's size (torchrun's env vars
    initialise one: gloo on CPU, NCCL on GPU). ``plan``: a Plan or a plan JSON
    path, checked against the captured graph; else ``autopar.solve`` with
    ``cluster``, ``pins`` and ``solve_kwargs`` (e.g. ``global_batch``).
    ``loss_fn(output, targets)`` returns the microbatch mean (default
    :func:`default_loss`); ``optimizer`` is a callable ``params -> Optimizer``
    (default AdamW, lr 1e-3). ``init_fn`` initialises a meta-device model
    after sharding (default: ``reset_parameters()``); ``graph`` skips capture.
    """
    launched = _ensure_process_group()
    if world_size is None:
        if not launched:
            raise LaunchError("compile needs world_size outside a process group "
                              "(or launch under torchrun so it can be read)")
        world_size = dist.get_world_size()
    kwargs = dict(solve_kwargs, cluster=cluster, pins=pins)
    plan, graph = resolve_plan(model, example_inputs, plan, graph, world_size, launched, **kwargs)
    _check_world(plan, world_size, launched)
    loss_fn = loss_fn or default_loss
    if not launched and world_size > 1:
        return ParallelModel(plan, graph, model, None, loss_fn, launched=False)
    if launched:
        lowered = lower(model, graph, plan, example_inputs=example_inputs, loss_fn=loss_fn,
                        init_fn=init_fn)
    else:
        lowered = _lower_local(model, graph, plan, init_fn)
    params = (lowered.pipeline.parameters() if lowered.pipeline is not None
              else lowered.module.parameters())
    opt = (optimizer or default_optimizer)(params)
    return ParallelModel(plan, graph, lowered.module, opt, loss_fn, launched=launched, lowered=lowered)
