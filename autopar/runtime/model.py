"""The runtime: lower a Plan for this rank and train it.

    pm = autopar.compile(model, example_inputs=(idx,))      # inside torchrun
    for x, y in batches:
        loss = pm.train_step(pm.local_batch(x), pm.local_batch(y))

:func:`compile` captures the model (or takes a plan), and inside a process
group lowers the plan (:mod:`autopar.runtime.lowering`: every model part
through the one lowering path, tensor parallel → recompute → ZeRO/DP) and
builds the optimizer over the parts' parameters. Outside one, with one
rank it lowers the plan in this process and trains there; with more, it
returns the plan-only :class:`ParallelModel` whose ``train_step`` says how
to launch. Without a ``cluster``, the plan is priced on the machine compile
runs on (:func:`autopar.runtime.launch.local_cluster`).

A rank that raises must not hang the others: every check that can fail on
bad input (world size, tp divisibility, a missing pipeline pass, batch
shape, loss shape) is deterministic — the same on every rank given the same
plan and shapes — and the compile-time ones run before the first collective
(the device mesh). If a rank still exits alone, torchrun tears the group down
when any process exits non-zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import BatchError, LaunchError
from autopar.graph import LayerGraph
from autopar.plan import Plan, Predicted
from autopar.runtime.launch import check_world, device, ensure_process_group, launch_hint, resolve_plan
from autopar.runtime.lowering import Lowered, gather_parts, lower, lower_local

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


# ------------------------------------------------------------------ the trainable model


def _as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _unpermute(name: str, tensor: torch.Tensor, perms: dict[str, torch.Tensor]) -> torch.Tensor:
    perm = perms.get(name)
    return tensor if perm is None else tensor[torch.argsort(perm).to(tensor.device)]


@dataclass
class ParallelModel:
    """A model lowered for this rank: train it with :meth:`train_step`.

    ``module`` is this rank's model, its parameters DTensors where sharded
    (under a pipeline, the model as given: this rank's stages are
    ``lowered.parts``); ``optimizer`` steps this rank's shards of every
    part. Plan-only (``launched`` false) when compiled outside a process
    group for several ranks: inspect ``plan``, and ``train_step`` raises
    :class:`LaunchError`.
    """

    plan: Plan
    graph: LayerGraph
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_fn: LossFn
    launched: bool
    lowered: Lowered | None = None

    def __repr__(self) -> str:
        m, n = self.plan.mesh, self.plan.world_size
        return (f"ParallelModel({self.plan.model}, {n} rank{'s' * (n != 1)}, pp={m.pp} dp={m.dp} "
                f"tp={m.tp}, {self.plan.cluster.name}, launched={self.launched})")

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
        if lowered.pipeline is not None:  # the schedule runs the microbatches through the stages
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

        dev, m = device() if self.launched else torch.device("cpu"), self.plan.microbatches
        xs = [x.to(dev).chunk(m) for x in inputs]
        ys = targets.to(dev).chunk(m)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i in range(m):
            for result in lowered.data_parallel:
                if result is not None:
                    set_last_microbatch(result, i == m - 1)
            loss = self.loss_fn(lowered.module(*(x[i] for x in xs)), ys[i])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise BatchError(f"loss_fn must return a scalar tensor (the microbatch mean), got {shape}")
            (loss / m).backward()
            total += loss.detach().double()
        return total / m

    def _pipeline_step(self, lowered: Lowered, inputs: tuple[torch.Tensor, ...],
                       targets: torch.Tensor) -> torch.Tensor:
        """The pipeline runtime's step: forward and backward of every microbatch, returning
        the mean loss of this rank's shard on last-stage ranks and zero elsewhere."""
        loss = lowered.pipeline.step(inputs if len(inputs) > 1 else inputs[0], targets)
        if loss is None:
            return torch.zeros((), dtype=torch.float64, device=device())
        return loss.detach().double().to(device())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient, unsharded and in the original layout, on every rank (a collective)."""
        from torch.distributed.tensor import DTensor

        lowered = self._require_launch()
        local = {}
        for name, p in lowered.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            local[name] = _unpermute(name, g.detach(), lowered.row_permutations)
        return gather_parts(local, lowered.pp_group)

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """The model's state dict; ``full``: unsharded tensors keyed by the original FQNs on every
        rank (a collective; every stage's under a pipeline), else this rank's DTensor shards
        (fused q/k/v rows permuted)."""
        lowered = self.lowered
        if lowered is None or lowered.mesh is None:
            return self.module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        local: dict[str, Any] = {}
        for part in lowered.parts:
            local.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=full)))
        if not full:
            return local
        local = {k: _unpermute(k, v, lowered.row_permutations) for k, v in local.items()}
        return gather_parts(local, lowered.pp_group)

    def local_param_bytes(self) -> int:
        """Bytes of parameters this rank holds (its shards only)."""
        from torch.distributed.tensor import DTensor

        params = self.lowered.parameters() if self.lowered is not None else list(self.module.parameters())
        total = 0
        for p in params:
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
    ``cluster`` defaults to this machine: its CUDA device's preset, ``cpu``
    without a GPU (:func:`autopar.runtime.launch.local_cluster`). Outside a
    process group, ``world_size`` 1 trains in this process and a larger one
    gives a plan-only model (``launched`` false) whose ``train_step`` raises
    :class:`LaunchError`.
    ``loss_fn(output, targets)`` returns the microbatch mean (default
    :func:`default_loss`); ``optimizer`` is a callable ``params -> Optimizer``
    (default AdamW, lr 1e-3). ``init_fn`` initialises a meta-device model
    after sharding (default: ``reset_parameters()``); ``graph`` skips capture.
    """
    launched = ensure_process_group()
    if world_size is None:
        if not launched:
            raise LaunchError("compile needs world_size outside a process group "
                              "(or launch under torchrun so it can be read)")
        world_size = dist.get_world_size()
    kwargs = dict(solve_kwargs, cluster=cluster, pins=pins)
    plan, graph = resolve_plan(model, example_inputs, plan, graph, world_size, launched, **kwargs)
    check_world(plan, world_size, launched)
    loss_fn = loss_fn or default_loss
    if not launched and world_size > 1:
        return ParallelModel(plan, graph, model, None, loss_fn, launched=False)
    if launched:
        lowered = lower(model, graph, plan, example_inputs=example_inputs, loss_fn=loss_fn, init_fn=init_fn)
    else:
        lowered = lower_local(model, graph, plan, init_fn)
    opt = (optimizer or default_optimizer)(lowered.parameters())
    module = model if lowered.pipeline is not None else lowered.module  # a pipeline's stages: lowered.parts
    return ParallelModel(plan, graph, module, opt, loss_fn, launched=launched, lowered=lowered)
