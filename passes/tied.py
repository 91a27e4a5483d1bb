"""Tied embeddings across pipeline stages: one weight, held by the first and the last stage.

nanoGPT and GPT-2 tie the output head to the input embedding. Split into a
pipeline, the first stage (embedding) and the last (head) each hold the
weight; after every backward the two copies' gradients are summed, so both
take the same optimizer step and stay equal — Megatron-LM's embedding group.
At build time the last stage takes the first stage's values (a meta model is
initialised per stage, and the two modules' ``reset_parameters`` differ).

:class:`TiedEmbeddings` takes the stage modules of this rank (after the
lowering passes: the weight may be an FSDP2 shard over dp, which is laid out
alike on both ends because both are in their stage's root unit), the device
mesh and the tied parameters' names; what stays true: the two ends hold
equal values after :meth:`TiedEmbeddings.share_weights` and after every
optimizer step that follows :meth:`TiedEmbeddings.sum_grads`.

The sum is a plain all-reduce over a group of the two ranks (for pp = 2 the
pipeline group itself): torch's pipelining has no notion of shared weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def tied_locations(module: nn.Module, shared: list[nn.Parameter]) -> list[str]:
    """Names, in ``module`` (before lowering), of the ``shared`` parameters it holds, in their order."""
    where = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    return [where[id(p)] for p in shared if id(p) in where]


@dataclass
class TiedEmbeddings:
    """This rank's ends of tied embeddings and the group that joins the two ends."""

    ends: list[tuple[nn.Module, str]] = field(default_factory=list)  # (stage module, parameter name)
    group: Any = None
    src: int = 0  # the global rank holding the first stage, in this rank's pair

    @classmethod
    def build(cls, mesh: Any, pp: int, located: list[tuple[nn.Module, list[str]]]) -> TiedEmbeddings:
        """Every rank calls this (collective: it makes the pair groups for pp > 2)."""
        grid = mesh.mesh.reshape(pp, -1)  # global ranks: pp (the outermost axis) × every other axis's coordinates
        me = dist.get_rank()
        group, src = None, 0
        if pp == 2:
            group = mesh["pp"].get_group()
            src = int(grid[0, (grid == me).nonzero()[0, 1]])
        else:
            for column in range(grid.shape[1]):
                pair = [int(grid[0, column]), int(grid[pp - 1, column])]
                g = dist.new_group(pair)
                if me in pair:
                    group, src = g, pair[0]
        ends = [(module, name) for module, names in located for name in names]
        return cls(ends, group if ends else None, src)

    def _tensors(self, grads: bool) -> list[torch.Tensor]:
        out = []
        for module, name in self.ends:
            p = module.get_parameter(name)
            t = p.grad if grads else p.data
            if t is not None:
                out.append(_local(t))
        return out

    @torch.no_grad()
    def share_weights(self) -> None:
        """The last stage takes the first stage's values."""
        for t in self._tensors(grads=False):
            dist.broadcast(t, src=self.src, group=self.group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Sum the two ends' gradients (call after the backward of every microbatch)."""
        for t in self._tensors(grads=True):
            dist.all_reduce(t, group=self.group)


__all__ = ["TiedEmbeddings", "tied_locations"]
