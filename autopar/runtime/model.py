"""The runtime's trainable model: a Plan lowered for this rank, trained step by step.

    pm = autopar.compile(model, example_inputs=(idx,), max_grad_norm=1.0,     # inside torchrun
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    for x, y in batches:
        loss = pm.train_step(pm.local_batch(x), pm.local_batch(y))
    pm.save("ckpt/step-100")          # and later, under any plan: pm.load(...)

The trainable model :func:`autopar.compile` returns (:mod:`autopar.runtime.build` plans, admits and lowers
it): its train step, evaluation, weights and checkpoints.

A train step: zero the gradients; forward and backward of every microbatch
(on the step's own RNG stream, :mod:`autopar.runtime.training`); clip by the
global gradient norm when ``max_grad_norm`` is set; the optimizer step (and
the bf16 copies of the masters refreshed); the scheduler's step; the global
mean loss, the same on every rank.

A rank that raises must not hang the others: every check that can fail on
bad input (world size, tp divisibility, a missing pipeline pass, batch
shape, loss shape) is deterministic — the same on every rank given the same
plan and shapes — and the compile-time ones run before the first collective
(the device mesh). If a rank still exits alone, torchrun tears the group down
when any process exits non-zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar import inputs as model_inputs
from autopar.admission import launch_hint
from autopar.errors import BatchError, LaunchError
from autopar.graph import LayerGraph
from autopar.passes.expert_parallel import reduce_expert_grads
from autopar.plan import Plan, Predicted
from autopar.runtime.balance import BiasBalancer
from autopar.runtime.chunked_loss import hidden_head, refuse_labels
from autopar.runtime.float8 import drop_scales, precompute_scales
from autopar.runtime.launch import (
    device,
    hold,
)
from autopar.runtime.lowering import Lowered, gather_all, held_params
from autopar.runtime.precision import MasterWeights, cast_floating
from autopar.runtime.state import Entry, full_tensor, persistent_buffers
from autopar.runtime.training import check_batch, check_loss, clip_grads_, global_grad_norm, step_rng

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
LossFn = Callable[[Any, torch.Tensor | None], torch.Tensor]


# ------------------------------------------------------------------ the trainable model


@dataclass
class ParallelModel:
    """A model lowered for this rank: train it with :meth:`train_step`.

    ``module`` is this rank's model, its parameters DTensors where sharded
    (under a pipeline, the model as given: this rank's stages are
    ``lowered.parts``); ``optimizer`` steps this rank's fp32 weights of every
    part (the FSDP2 shards, or the masters of a bf16 plan's other parts:
    ``masters``); ``scheduler`` is stepped with it. ``step`` counts optimizer
    steps (restored by :meth:`load`); ``grad_norm`` is the last step's global
    gradient norm before clipping (None unless ``max_grad_norm`` is set; give
    ``float("inf")`` to measure without clipping). Plan-only (``launched``
    false) when compiled outside a process group for several ranks: inspect
    ``plan``, and ``train_step`` raises :class:`LaunchError`.
    """

    plan: Plan
    graph: LayerGraph
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_fn: LossFn
    launched: bool
    lowered: Lowered | None = None
    scheduler: Any = None
    max_grad_norm: float | None = None
    masters: MasterWeights | None = None
    seed: int = 0
    step: int = 0
    grad_norm: float | None = None
    entries: list[Entry] = field(default_factory=list)
    compiled: tuple[str, ...] = ()  # the blocks running under torch.compile (plan.training.compiled)
    balancer: BiasBalancer | None = None  # moe_bias_update > 0: the routers' expert biases it moves
    float8_gathered: bool = False  # FSDP2 gathers float8 weights: their scales set once a step (runtime/float8.py)
    chunked_loss: bool = False  # the head returns the hidden state in a step; the loss runs it in chunks
    _checkpoint_group: Any = field(default=None, repr=False)
    _pending_save: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        m, n = self.plan.mesh, self.plan.world_size
        mesh = f", {m.describe(' ')}" if n > 1 else ""
        return (f"ParallelModel({self.plan.model}, {n} rank{'s' * (n != 1)}{mesh}, {self.plan.cluster.name}, "
                f"launched={self.launched})")

    @property
    def predicted(self) -> Predicted:
        return self.plan.predicted

    @property
    def local_batch_size(self) -> int:
        """Samples per step on one data-parallel rank: microbatches × microbatch size."""
        return self.plan.microbatches * self.plan.microbatch_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate: ``DistributedSampler(..., rank=pm.dp_rank)``."""
        return self._dp_rank()

    @property
    def dp_size(self) -> int:
        """How many data-parallel shards a global batch splits into (``num_replicas`` of a sampler)."""
        return self.plan.mesh.dp

    def _require_launch(self) -> Lowered:
        if self.lowered is None:
            raise LaunchError(f"this plan runs on {self.plan.world_size} ranks and no process group "
                              f"is initialised: {launch_hint(self.plan.world_size)}")
        return self.lowered

    def _coordinate(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` of the device mesh (its coordinates are held by the mesh:
        slicing ``mesh[axis]`` for its local rank cost ~1 ms a step on gloo)."""
        mesh = self._require_launch().mesh
        if mesh is None:
            return 0
        if axis not in (mesh.mesh_dim_names or ()):  # a flattened axis: its own mesh
            return mesh[axis].get_local_rank()
        return mesh.get_coordinate()[mesh.mesh_dim_names.index(axis)]

    def _dp_rank(self) -> int:
        return self._coordinate("dp")

    def _stream(self) -> int:
        """The RNG stream of this rank: its (pp, dp) coordinate, shared by its tp group."""
        return self._coordinate("pp") * self.plan.mesh.dp + self._dp_rank()

    def _stage_ranks(self) -> int:
        """The ranks that hold one pipeline stage: every axis's but pp."""
        return self.plan.world_size // self.plan.mesh.pp

    def _device(self) -> torch.device:
        return device() if self.launched else torch.device("cpu")

    def local_batch(self, batch: Any) -> Any:
        """This dp rank's slice of a global batch (the tp and pp ranks of a dp group share it): a tensor,
        a tuple of positional inputs or a dict of keyword inputs, sliced along dim 0 (None stays None);
        under cp, every tensor whose dim 1 is the sequence is then cut to this cp rank's head and tail
        chunks (``passes/context_parallel.py``): inputs and targets alike."""
        return self.sequence_shard(self._dp_slice(batch))

    def sequence_shard(self, local: Any) -> Any:
        """Under cp, this dp rank's batch cut to this cp rank's sequence chunks, as :meth:`local_batch` cuts it
        (``autopar.data``'s loader, which reads the dp share itself, hands it here)."""
        cp = self.plan.mesh.cp
        if cp <= 1 or local is None:
            return local
        from autopar.passes.context_parallel import shard_sequence

        mesh = self._require_launch().mesh
        return shard_sequence(local, self.graph.seq_len, cp, mesh["cp"].get_local_rank())

    def _dp_slice(self, batch: Any) -> Any:
        if batch is None:
            return None
        dp = self.plan.mesh.dp
        expected = dp * self.local_batch_size
        got = model_inputs.batch_size(batch)
        if got != expected:
            raise BatchError(f"a global batch for this plan has {expected} samples (dp {dp} × "
                             f"microbatches {self.plan.microbatches} × microbatch size "
                             f"{self.plan.microbatch_size}), got {got}")
        if isinstance(batch, torch.Tensor):
            return batch.chunk(dp)[self._dp_rank()]
        return model_inputs.shard(batch, dp, self._dp_rank())

    def _check_batch(self, inputs: model_inputs.Inputs, targets: torch.Tensor | None,
                     what: str = "train_step") -> None:
        check_batch(inputs, targets, self.local_batch_size, self.plan.microbatches,
                    self.plan.microbatch_size, what)
        if self.chunked_loss:
            refuse_labels(inputs)

    def _loss(self, output: Any, targets: torch.Tensor | None) -> torch.Tensor:
        if self.plan.training.dtype == "bf16":
            output = cast_floating(output, torch.float32)
        return check_loss(self.loss_fn(output, targets))

    # -------------------------------------------------------------- training

    def train_step(self, inputs: Any, targets: torch.Tensor | None = None) -> float:
        """One optimizer step on this rank's shard; returns the global-batch mean loss (same on every rank).

        ``inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs (``input_ids``,
        ``attention_mask``, ``labels``…); ``targets`` may be None when the model computes its own loss."""
        lowered = self._require_launch()
        inputs = model_inputs.normalise(inputs)
        self._check_batch(inputs, targets)
        self._check_context(inputs, targets)
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        if self.float8_gathered:
            precompute_scales(self.module)
        if self.balancer is not None:
            self.balancer.counting = True
        try:
            with step_rng(self.seed, self.step, self._stream(), self._device()), hidden_head(self.chunked_loss):
                if lowered.pipeline is not None:  # the schedule runs the microbatches through the stages
                    loss = self._pipeline_step(lowered, inputs, targets)
                else:
                    loss = self._accumulate(lowered, inputs, targets)
        finally:
            if self.balancer is not None:
                self.balancer.counting = False
        for experts in lowered.experts:  # ep: expert gradients reduced over their edp group
            reduce_expert_grads(experts)
        if self.masters is not None:
            self.masters.drop_param_grads()
        if self.max_grad_norm is not None:
            self._clip()
        self.optimizer.step()
        if self.masters is not None:
            self.masters.copy_to_params()
        if self.float8_gathered:
            drop_scales(self.module)
        if self.balancer is not None:  # the routers' biases moved by the step's token counts (balance.py)
            self.balancer.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        return self._global_mean(loss)

    def _check_context(self, inputs: model_inputs.Inputs, targets: torch.Tensor | None) -> None:
        """Under cp: this rank's tokens only (``local_batch``), and a loss the runtime takes over equal
        token counts. The model's own loss (a Hugging Face model given ``labels``) shifts the labels
        inside each rank's chunks, and an ignored target (-100) leaves ranks unequal counts: either
        would average to another number than one device's, so both are refused. The ignored-target
        check is a collective (the same answer on every rank)."""
        cp = self.plan.mesh.cp
        if cp <= 1:
            return
        local = self.graph.seq_len // cp
        if isinstance(inputs, dict) and "labels" in inputs:
            raise BatchError(f"under cp={cp} the model cannot compute its own loss from 'labels' (it would "
                             "shift them inside each rank's chunks): pass the next-token targets to train_step")
        for what, t in model_inputs.tensors(inputs) + ([("targets", targets)] if targets is not None else []):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] not in (local,):
                raise BatchError(f"under cp={cp} each rank takes {local} of the {self.graph.seq_len} tokens of "
                                 f"a sequence; {what} has {t.shape[1]}. Use local_batch() on the global batch")
        if targets is not None:
            ignored = (targets == -100).any().to(torch.float64).reshape(1).to(self._device())
            dist.all_reduce(ignored, op=dist.ReduceOp.MAX)
            if float(hold(ignored)):
                raise BatchError(f"under cp={cp} targets of -100 (ignored) would leave the ranks unequal token "
                                 "counts and the mean loss another number than one device's; not supported yet")

    def _global_mean(self, loss: torch.Tensor) -> float:
        if dist.is_initialized() and dist.get_world_size() > 1:
            # each dp group's mean is held by every rank of the last stage (other stages hold
            # zeros): the sum over the world / (the ranks of one stage) is the global mean
            dist.all_reduce(loss)
            return float(hold(loss)) / self._stage_ranks()
        return float(loss)

    def _accumulate(self, lowered: Lowered, inputs: model_inputs.Inputs,
                    targets: torch.Tensor | None) -> torch.Tensor:
        """Gradient accumulation: each microbatch's loss scaled by 1/m, so gradients are the batch mean."""
        from autopar.passes.zero import set_last_microbatch

        dev, m = self._device(), self.plan.microbatches
        xs = model_inputs.chunks(model_inputs.to(inputs, dev), m)
        ys = targets.to(dev).chunk(m) if targets is not None else [None] * m
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i in range(m):
            for result in lowered.data_parallel:
                if result is not None:
                    set_last_microbatch(result, i == m - 1)
            if self.masters is not None:
                self.masters.ddp_syncing = i == m - 1
            loss = self._loss(model_inputs.call(lowered.module, xs[i]), ys[i])
            (loss / m).backward()
            total += loss.detach().double()
        return total / m

    def _pipeline_step(self, lowered: Lowered, inputs: model_inputs.Inputs,
                       targets: torch.Tensor | None) -> torch.Tensor:
        """The pipeline runtime's step: forward and backward of every microbatch, returning
        the mean loss of this rank's shard on last-stage ranks and zero elsewhere."""
        loss = lowered.pipeline.step(_one_or_all(inputs), targets)
        if loss is None:
            return torch.zeros((), dtype=torch.float64, device=device())
        return loss.detach().double().to(device())

    def _clip(self) -> None:
        held = held_params(self.lowered)
        with_grad = [e for e in self.entries if e.value.grad is not None]
        grads = [e.value.grad for e in with_grad]
        norm = global_grad_norm(grads, self._stage_ranks(), self.launched,
                                [self.plan.mesh.ep if id(e.param) in held else 1 for e in with_grad])
        self.grad_norm = float(norm)
        clip_grads_(grads, float(self.max_grad_norm), norm)

    def evaluate(self, inputs: Any, targets: torch.Tensor | None = None) -> float:
        """The global-batch mean loss of this rank's shard in eval mode, without gradients (every
        rank calls it; the same value on every rank). Pipelines run forward only."""
        lowered = self._require_launch()
        inputs = model_inputs.normalise(inputs)
        self._check_batch(inputs, targets, "evaluate")
        self._check_context(inputs, targets)
        modes = [(m, m.training) for part in lowered.parts for m in part.modules()]
        for part in lowered.parts:
            part.eval()
        try:
            with torch.no_grad(), hidden_head(self.chunked_loss):
                if lowered.pipeline is not None:
                    loss = lowered.pipeline.evaluate(_one_or_all(inputs), targets)
                    loss = (torch.zeros((), dtype=torch.float64) if loss is None else loss.double()).to(device())
                else:
                    dev, m = self._device(), self.plan.microbatches
                    xs = model_inputs.chunks(model_inputs.to(inputs, dev), m)
                    ys = targets.to(dev).chunk(m) if targets is not None else [None] * m
                    loss = sum(self._loss(model_inputs.call(lowered.module, xs[i]), ys[i]).double()
                               for i in range(m)) / m
        finally:
            for module, training in modes:
                module.training = training
            _reshard(lowered)
        return self._global_mean(loss)

    # -------------------------------------------------------------- state

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient (fp32), unsharded and in the original layout, on every rank
        (a collective)."""
        lowered = self._require_launch()
        local = {e.fqn: full_tensor(e.value.grad, e.perm).detach() for e in self.entries
                 if e.value.grad is not None}
        return gather_all(local, lowered)

    def state_dict(self, full: bool = True) -> dict[str, Any]:
        """The model's state dict with the fp32 weights; ``full``: unsharded tensors keyed by the
        original FQNs on every rank (a collective; every stage's under a pipeline), else this rank's
        DTensor shards (fused q/k/v rows permuted)."""
        lowered = self.lowered
        if lowered is None:
            return self.module.state_dict()
        if not full:
            out: dict[str, Any] = {}
            for part in lowered.parts:
                out.update(_sharded_state_dict(part, lowered.mesh is not None))
            out.update({e.fqn: e.value.detach() for e in self.entries})
            return out
        local: dict[str, Any] = {}
        for e in self.entries:
            local[e.fqn] = full_tensor(e.value, e.perm).detach()
        first = {id(e.param): e.fqn for e in self.entries}
        for part in lowered.parts:
            for name, p in part.named_parameters(remove_duplicate=False):  # tied weights' other names
                if id(p) in first and name not in local:
                    local[name] = local[first[id(p)]]
        for name, buf in persistent_buffers(lowered.parts).items():
            local.setdefault(name, buf.detach())
        return gather_all(local, lowered)

    def local_param_bytes(self) -> int:
        """Bytes of parameters this rank holds (its shards only)."""
        from torch.distributed.tensor import DTensor

        params = self.lowered.parameters() if self.lowered is not None else list(self.module.parameters())
        total = 0
        for p in params:
            t = p.to_local() if isinstance(p, DTensor) else p
            total += t.numel() * t.element_size()
        return total

    # -------------------------------------------------------------- checkpoints and weights

    def save(self, path: str | Path, extra: dict[str, Any] | None = None, async_save: bool = False) -> Any:
        """Save a distributed checkpoint (every rank calls it): model, optimizer, scheduler, ``step``,
        ``extra`` (rank 0's: keep it the same on every rank) and the plan, loadable under any plan
        by :meth:`load`. ``async_save`` returns at
        once and writes in the background (the returned handle's ``result()`` waits). DCP's metadata
        is pickled: load only checkpoints your own jobs wrote (:mod:`autopar.runtime.checkpoint`)."""
        from autopar.runtime.checkpoint import save

        return save(self, path, extra, async_save)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint saved under any plan and world size into this plan; returns its
        ``extra``. A checkpoint of another model, or an incomplete or damaged one, raises
        :class:`~autopar.errors.CheckpointError` with nothing loaded."""
        from autopar.runtime.checkpoint import load

        return load(self, path)

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save in progress to be written and published."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.result()

    def export(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write the whole model's weights as safetensors keyed like the original model (every rank
        calls it): a Hugging Face model's export loads with ``from_pretrained(path)``."""
        from autopar.runtime.weights import export

        return export(self, path, dtype=dtype)

    def load_weights(self, path: str | Path) -> None:
        """Load safetensors weights (a file, or a Hugging Face checkpoint directory), each rank
        reading only its shards; the optimizer state is left as it is."""
        from autopar.runtime.weights import load_weights

        load_weights(self, path)

    def close(self) -> None:
        """Finish pending checkpoint writes and shut the process groups down cleanly."""
        from autopar.runtime.launch import shutdown

        self.wait_for_checkpoint()
        shutdown()


def _one_or_all(inputs: model_inputs.Inputs) -> Any:
    """What the pipeline runtime takes: one positional input alone, else the tuple or the dict."""
    return inputs[0] if isinstance(inputs, tuple) and len(inputs) == 1 else inputs


def _sharded_state_dict(part: nn.Module, distributed: bool) -> dict[str, Any]:
    if not distributed:
        return part.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(part, options=StateDictOptions(full_state_dict=False))


def _reshard(lowered: Lowered) -> None:
    """Free the weights FSDP2 units left gathered by a forward that no backward followed."""
    from torch.distributed.fsdp import FSDPModule

    for part in lowered.parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
