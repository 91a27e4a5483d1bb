"""This rank's training state by the original model's names: parameters, buffers, optimizer state.

Every feature that reads or writes weights — checkpoints, export, weights
in, full state dicts, clipping — starts from :func:`param_entries`: one
:class:`Entry` per parameter this rank holds, named by its FQN in the
original model, with the tensor that holds its fp32 truth (the master
where :mod:`autopar.runtime.precision` made one, else the parameter: an
FSDP2 shard, a tensor-parallel DTensor, a plain tensor) and the row
permutation tensor parallelism applied to it (fused q/k/v or gate/up).

A row-permuted shard is not a contiguous block of the original tensor: rank
r of a tp group holds its heads' q, k and v rows. :class:`OriginalRows`
presents such a shard to ``torch.distributed.checkpoint`` as the few
contiguous runs of *original* rows it holds, so a checkpoint is laid out as
the unsharded, unpermuted model and loads under any other permutation,
tensor-parallel degree or plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from autopar.passes.tensor_parallel import Permutation


@dataclass(frozen=True)
class Entry:
    """One parameter of this rank: its original FQN, the module's parameter, the tensor holding
    its fp32 truth (``value``: the master, or the parameter itself) and its row permutation."""

    fqn: str
    param: nn.Parameter
    value: torch.Tensor
    perm: Permutation | None


class Trainable(Protocol):
    """What checkpoints and weights read and write of a :class:`~autopar.runtime.model.ParallelModel`
    (a protocol, so those modules need not import the model's)."""

    plan: Any
    graph: Any
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    lowered: Any
    scheduler: Any
    masters: Any
    step: int
    entries: list[Entry]
    _checkpoint_group: Any
    _pending_save: Any

    def _require_launch(self) -> Any: ...

    def wait_for_checkpoint(self) -> None: ...


def param_entries(named: list[tuple[str, nn.Parameter]], masters: Any,
                  perms: dict[str, Permutation]) -> list[Entry]:
    """One entry per distinct parameter of ``named`` (a tied parameter under its first name)."""
    seen: set[int] = set()
    out = []
    for name, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        value = masters.master_of(p) if masters is not None else p
        out.append(Entry(name, p, value, perms.get(name)))
    return out


def persistent_buffers(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every part's buffers that its state dict holds (not the non-persistent ones), by FQN."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for prefix, module in part.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out.setdefault(f"{prefix}.{name}" if prefix else name, buf)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor, perm: Permutation | None) -> torch.Tensor:
    """The whole tensor in the original row order (for a DTensor a collective over its mesh)."""
    from torch.distributed.tensor import DTensor

    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full if perm is None else full.index_select(perm.dim, torch.argsort(perm.index).to(full.device))


def shard_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, offsets) of this rank's block of ``t`` in the whole (permuted) tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return tuple(t.shape), (0,) * t.dim()
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(sizes), tuple(offsets)


def row_runs(perm: torch.Tensor, start: int, count: int) -> list[tuple[int, int, int]]:
    """(original row, local row, rows) of each run of consecutive original rows among the permuted
    rows ``start … start + count − 1``."""
    rows = perm[start:start + count].tolist()
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if runs and runs[-1][0] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, i, 1))
    return runs


class OriginalRows(torch.Tensor):
    """A rank's shard of a row-permuted tensor, as DCP sees it: chunks of the unpermuted tensor.

    Implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``, as DTensor does);
    each chunk is a view of the local shard, so loading writes into it in place.
    It supports no other tensor operation.
    """

    @staticmethod
    def __new__(cls, shard: torch.Tensor, perm: Permutation) -> OriginalRows:
        sizes, offsets = shard_box(shard)
        data = local(shard)
        self = torch.Tensor._make_wrapper_subclass(cls, shard.shape, dtype=data.dtype, device=data.device)
        self._data = data
        self._offsets, self._dim = offsets, perm.dim
        self._runs = row_runs(perm.index, offsets[perm.dim], sizes[perm.dim]) if data.numel() else []
        return self

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"OriginalRows holds a checkpoint view and supports no tensor op ({func})")

    def _chunks(self) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
        d, out = self._dim, []
        for row, at, n in self._runs:
            offsets, sizes = list(self._offsets), list(self._data.shape)
            offsets[d], sizes[d] = row, n
            out.append((torch.Size(offsets), torch.Size(sizes), self._data.narrow(d, at, n)))
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.size()))
                for offsets, sizes, view in self._chunks()]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._chunks()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, _, view in self._chunks():
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no rows at {tuple(index.offset)}")


def checkpoint_view(t: torch.Tensor, perm: Permutation | None) -> torch.Tensor:
    """What DCP saves or loads for ``t``: itself, or its rows in the original order."""
    return t if perm is None else OriginalRows(t, perm)
