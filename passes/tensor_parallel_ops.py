"""Tensor parallelism's collectives as custom ops, for a block that runs under torch.compile.

The eager tensor-parallel runtime (:class:`autopar.passes.tensor_parallel.MeshRank`) sums and
gathers with ``torch.autograd.Function``\\ s around in-place c10d calls. A compiled block is first
traced once under :class:`~autopar.sharding.rules.ShardMode` by ``make_fx``
(:mod:`autopar.runtime.sharded_trace`), below autograd: an autograd function's backward would not
be in that trace. So :class:`TracedMeshRank` issues the same four collectives as single ops that
carry their own autograd formula (``torch.library.custom_op`` with ``register_autograd``): ``make_fx``
records each as one node, running the trace's graph keeps its gradient, and dynamo and AOTAutograd
trace it (a custom op is opaque to inductor and runs as its own kernel).

Why hand-written rather than ``torch.distributed._functional_collectives``: those have no all-reduce
whose backward is the identity (Megatron's *g*) nor an identity whose backward is an all-reduce
(Megatron's *f*), the two conjugate operators tensor parallelism needs; and one family of ops over
the same :func:`~autopar.passes.tensor_parallel._all_gather` / ``_reduce_scatter`` helpers the eager
runtime uses keeps the two paths' collectives the same, numbers included.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.passes.tensor_parallel import MeshRank, _all_gather, _reduce_scatter


def _group(name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# ------------------------------------------------------------------ Megatron's g: sum forward, identity backward


@torch.library.custom_op("autopar::tp_sum", mutates_args=())
def tp_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    """Every rank's ``x`` summed over the tp group ``group`` (a process group's name)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group(group))
    return out


@tp_sum.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _sum_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


tp_sum.register_autograd(_sum_backward)


# ------------------------------------------------------------------ Megatron's f: identity forward, sum backward


@torch.library.custom_op("autopar::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: str) -> torch.Tensor:
    """``x`` (a copy: a custom op's output may not alias its input); its gradient summed over ``group``."""
    return x.clone()


@tp_copy.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _copy_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group = inputs[1]


def _copy_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return tp_sum(grad, ctx.group), None


tp_copy.register_autograd(_copy_backward, setup_context=_copy_setup)


# ------------------------------------------------------------------ sequence parallelism: gather / reduce-scatter


@torch.library.custom_op("autopar::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, group: str, tp: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``; the gradient is reduce-scattered back."""
    return _all_gather(x, dim, _group(group), tp)


@tp_gather.register_fake
def _(x: torch.Tensor, dim: int, group: str, tp: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= tp
    return x.new_empty(shape)


@torch.library.custom_op("autopar::tp_scatter", mutates_args=())
def tp_scatter(x: torch.Tensor, dim: int, group: str, tp: int) -> torch.Tensor:
    """The sum of every rank's ``x``, of which this rank keeps its 1/tp along ``dim``; the gradient is
    gathered back."""
    return _reduce_scatter(x, dim, _group(group), tp)


@tp_scatter.register_fake
def _(x: torch.Tensor, dim: int, group: str, tp: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= tp
    return x.new_empty(shape)


def _sequence_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dim, ctx.group, ctx.tp = inputs[1], inputs[2], inputs[3]


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    return tp_scatter(grad, ctx.dim, ctx.group, ctx.tp), None, None, None


def _scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    return tp_gather(grad, ctx.dim, ctx.group, ctx.tp), None, None, None


tp_gather.register_autograd(_gather_backward, setup_context=_sequence_setup)
tp_scatter.register_autograd(_scatter_backward, setup_context=_sequence_setup)


class TracedMeshRank(MeshRank):
    """:class:`MeshRank` whose collectives are the custom ops above: the backend a compiled block is
    traced with (module docstring). Weights, shares and the ranks are MeshRank's."""

    def __init__(self, tp_mesh: Any):
        super().__init__(tp_mesh)
        self.group_name = self.group.group_name
        self.full_shapes: dict[int, tuple[int, ...]] = {}  # id(a local shard) -> its DTensor's global shape

    def full_size(self, weight: torch.Tensor, dim: int) -> int:
        shape = self.full_shapes.get(id(weight))
        return int(shape[dim]) if shape is not None else int(weight.shape[dim])

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        return tp_copy(x, self.group_name)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return tp_sum(partial, self.group_name)

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return tp_gather(x, dim, self.group_name, self.tp)

    def reduce_scatter_sequence(self, partial: torch.Tensor, dim: int) -> torch.Tensor:
        return tp_scatter(partial, dim, self.group_name, self.tp)

    def grad_sum(self, x: torch.Tensor) -> torch.Tensor:
        return tp_copy(x, self.group_name)


__all__ = ["TracedMeshRank", "tp_copy", "tp_gather", "tp_scatter", "tp_sum"]
