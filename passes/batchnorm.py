"""BatchNorm under data parallelism: statistics of the global batch, as one device computes them.

A BatchNorm in training mode normalises with the mean and variance of the
batch it sees and moves its running statistics toward them. Under dp each
rank sees only its shard, so plain data parallelism normalises with shard
statistics: outputs, gradients and running statistics all differ from one
device. :func:`sync_batch_norms` makes every ``nn.BatchNorm1d/2d/3d`` of a
model compute the statistics of the whole dp group's batch (what
``torch.nn.SyncBatchNorm`` does, which runs on CUDA only): the per-channel
sum, then the sum of squared deviations, each all-reduced over the dp group
with autograd's all-reduce (so the backward sums the statistics' gradients
over the group too: the gradient of the global-batch loss). Running
statistics move by the global mean and the unbiased global variance, the
same on every rank. Cost: two all-reduces of C floats per BatchNorm per
microbatch forward (and two in backward), a few KiB, priced as such
(``PriceTable._norm_sync_s``, from the layer's ``sync_norm_channels``).

The module keeps its class's parameters, buffers and names (only its class
changes), so checkpoints, ``state_dict`` and ZeRO see the model as built.
In eval mode it is the plain BatchNorm (running statistics, no collective).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def batch_norms(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm modules that use batch statistics in training."""
    return [n for n, m in model.named_modules() if isinstance(m, _BATCH_NORMS)]


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group's ranks; its backward sums the gradients the same way (every rank's
    loss depends on every rank's contribution to a global statistic)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    return _SumOverGroup.apply(t, group)


class _GlobalBatchNorm:
    """Mixed into a BatchNorm's class: forward with the dp group's statistics in training."""

    _autopar_group: Any

    def _count(self, x: torch.Tensor) -> float:
        # every dp rank holds an equal shard (train_step checks it): the global count needs no collective
        return float(x.numel() // x.shape[1] * dist.get_world_size(self._autopar_group))

    def _sum(self, t: torch.Tensor, dims: list[int]) -> torch.Tensor:
        return _all_reduce(t.sum(dims), self._autopar_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)  # type: ignore[misc]
        self._check_input_dim(x)  # type: ignore[attr-defined]
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        n = self._count(x)
        mean = self._sum(x, dims) / n
        centred = x - mean.reshape(shape)
        var = self._sum(centred.pow(2), dims) / n
        self._update_running(mean.detach(), var.detach(), n)
        y = centred * torch.rsqrt(var + self.eps).reshape(shape)  # type: ignore[attr-defined]
        if self.affine:  # type: ignore[attr-defined]
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)  # type: ignore[attr-defined]
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        if not self.track_running_stats or self.running_mean is None:  # type: ignore[attr-defined]
            return
        self.num_batches_tracked.add_(1)  # type: ignore[attr-defined]
        momentum = self.momentum  # type: ignore[attr-defined]
        factor = 1.0 / float(self.num_batches_tracked) if momentum is None else momentum  # type: ignore[attr-defined]
        unbiased = var * (n / (n - 1)) if n > 1 else var
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)  # type: ignore[attr-defined]
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)  # type: ignore[attr-defined]


class _PartsBatchNorm(_GlobalBatchNorm):
    """The statistics of :class:`_GlobalBatchNorm` in one process: the batch as ``_autopar_parts``
    equal shares (the dp ranks' shards, in rank order), each summed on its own and the sums added in
    that order, as the all-reduce adds them. ``verify``'s one-process reference runs this so that both
    sides add the same fp32 numbers in the same order: a BatchNorm's backward subtracts the batch mean
    of its gradient, and the sums' rounding, ~1e-7 of each term, reaches 1e-5 of a gradient that small
    cancellation leaves (measured: a 32-wide ResNet's bn1.weight gradient moves 1.6e-4 between two
    fp32 orders, both that far from float64)."""

    _autopar_parts: int

    def _count(self, x: torch.Tensor) -> float:
        return float(x.numel() // x.shape[1])

    def _sum(self, t: torch.Tensor, dims: list[int]) -> torch.Tensor:
        parts = t.chunk(self._autopar_parts)
        total = parts[0].sum(dims)
        for part in parts[1:]:
            total = total + part.sum(dims)
        return total


_CLASSES: dict[tuple[type, type], type] = {}


def _global_class(cls: type, mixin: type = _GlobalBatchNorm) -> type:
    if (cls, mixin) not in _CLASSES:
        prefix = "Global" if mixin is _GlobalBatchNorm else "Parts"
        _CLASSES[cls, mixin] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _CLASSES[cls, mixin]


def summed_in_parts(model: nn.Module, parts: int) -> list[str]:
    """Make every BatchNorm of ``model`` compute its training statistics as :func:`sync_batch_norms`
    does over ``parts`` dp ranks, in one process (:class:`_PartsBatchNorm`); returns their names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_NORMS) and not isinstance(module, _GlobalBatchNorm):
            module.__class__ = _global_class(type(module), _PartsBatchNorm)
            module._autopar_parts = parts
            names.append(name)
    return names


def sync_batch_norms(model: nn.Module, group: Any) -> list[str]:
    """Make every BatchNorm of ``model`` normalise with the statistics of ``group``'s whole batch
    (in place; returns their names). A no-op for a group of one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return []
    names = []
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_NORMS) and not isinstance(module, _GlobalBatchNorm):
            module.__class__ = _global_class(type(module))
            module._autopar_group = group
            names.append(name)
    return names


__all__ = ["batch_norms", "summed_in_parts", "sync_batch_norms"]
