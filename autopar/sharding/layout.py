"""Where one tensor-parallel rank's share of an activation lies: the words the sharding rules use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

TAG = "_autopar_shard"  # the attribute a rank's sharded activations carry: (mode key, Sharded)
SEQUENCE = "<sequence>"  # the ``source`` of a share along the sequence (sequence parallelism)


class NoShardRule(Exception):  # noqa: N818 - a reason, raised and caught inside capture
    """An op inside a tensor-parallel layer that cannot run exactly on shards.

    ``hint`` carries split points the op asked for along a sharded dimension,
    in global coordinates (a fused projection's segment boundaries), so the
    checker can retry with those segments; ``replicate`` names column
    projections the checker may retry unsharded (key/value projections with
    fewer heads than the tp degree, run whole on every rank as Megatron-Core
    and vLLM do).
    """

    def __init__(self, op: str, why: str, hint: tuple[str, tuple[int, ...]] | None = None,
                 replicate: tuple[str, ...] = (), whole: tuple[str, int] | None = None):
        super().__init__(f"{op}: {why}")
        self.op = op
        self.why = why
        self.hint = hint
        self.replicate = replicate  # column projections that could run whole instead (too few kv heads)
        self.whole = whole  # (fused column, width of its trailing segments that could run whole)


@dataclass(frozen=True)
class Sharded:
    """An activation holding one rank's share of dimension ``dim``.

    The dimension is the concatenation of ``segments`` (global sizes); each
    segment is split into ``tp`` equal contiguous pieces and a rank holds its
    piece of every segment, in order. ``source`` is the column projection the
    share started from (for hints). ``whole`` indexes segments every rank holds
    whole (a multi-query projection's key/value rows beside its query's shares):
    only the rules of :mod:`autopar.sharding.whole` read such a layout.
    """

    dim: int
    segments: tuple[int, ...]
    source: str = ""
    whole: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return sum(self.segments)

    def local(self, tp: int) -> int:
        """The size a rank holds along ``dim``."""
        return sum(s if i in self.whole else s // tp for i, s in enumerate(self.segments))

    @property
    def sequence(self) -> bool:
        """A share of the sequence (sequence parallelism), not of features or heads."""
        return self.source == SEQUENCE


def segment_indices(segments: Sequence[int], tp: int, rank: int) -> torch.Tensor:
    """Global indices a rank holds along a dimension made of ``segments``."""
    parts, start = [], 0
    for s in segments:
        piece = s // tp
        parts.append(torch.arange(start + rank * piece, start + (rank + 1) * piece))
        start += s
    return torch.cat(parts)


def segment_permutation(segments: Sequence[int], tp: int) -> torch.Tensor:
    """``perm`` with ``full[perm]`` holding rank r's indices in its contiguous 1/tp (rank order)."""
    return torch.cat([segment_indices(segments, tp, r) for r in range(tp)])


def local_of(mode: Any, t: torch.Tensor, dim: int, lay: Sharded) -> torch.Tensor:
    """This rank's share of a replicated tensor that is full size along a sharded dimension."""
    idx = segment_indices(lay.segments, mode.tp, mode.comm.rank).to(t.device)
    return t.index_select(dim, idx)


def with_cuts(segments: tuple[int, ...], cuts: tuple[int, ...]) -> tuple[int, ...]:
    """Segments whose boundaries are both ``segments``' and those of the pieces ``cuts`` an op asked
    for; cuts made on a view of the projection's output (heads of ``head_dim`` features) are first
    scaled to the projection's own features."""
    width, total = sum(segments), sum(cuts)
    if total and total != width and width % total == 0:
        cuts = tuple(c * (width // total) for c in cuts)
    bounds, acc = set(), 0
    for s in segments:
        acc += s
        bounds.add(acc)
    acc = 0
    for s in cuts:
        acc += s
        bounds.add(acc)
    out, prev = [], 0
    for b in sorted(bounds):
        out.append(b - prev)
        prev = b
    return tuple(out)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def projection_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an nn.Linear or a Conv1D; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        w = module.weight
        return int(w.shape[0]), int(w.shape[1])
    return None


__all__ = ["SEQUENCE", "TAG", "NoShardRule", "Sharded", "is_conv1d", "local_of", "projection_dims", "segment_indices",
           "segment_permutation", "with_cuts"]
