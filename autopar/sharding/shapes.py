"""The shape proof: a layer's sharding rules run at its real size, on meta, at every degree offered.

A style's numerical proof runs on a small copy of the layer (its own module
when small, a narrower copy when large: :mod:`autopar.sharding.narrow`) at a
few small degrees. What only the real sizes can show, the numerical proof
cannot: a head count or a width that the degree does not divide at the real
size, a view whose rule holds only while ``c // heads`` is small, a reshape
that merges a sharded dimension at the real sequence. :func:`prove_shapes`
runs the layer's forward and backward at its real shapes on the meta device
(no byte is allocated, a GPT-3 block takes milliseconds) under the very
:class:`~autopar.sharding.rules.ShardMode` and rules the simulation and the
runtime use, as one rank whose collectives return correctly shaped results.
Every rule's precondition is thereby checked at the real sizes.

Why a proof at one degree carries to another: the rules are written for any
``tp`` — a rank's share is ``size // tp`` of each segment, the same slicing
and the same sum at every degree — so what the numerical run proves is the
rules' arithmetic, and what differs between degrees is only whether each
rule's precondition holds (``tp`` divides this size, this view keeps each
rank's block whole). The shape proof checks exactly those preconditions,
at each degree that is offered. So a degree is offered when the numerical
proof passed at the small degrees it ran (2 … 8, those the copy admits) and
the shape proof passed at that degree at the real size.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.sharding.layout import NoShardRule, segment_permutation
from autopar.sharding.rules import Collectives, ShardMode

MAX_DEGREE = 256  # the largest tp degree offered (a tp group beyond this is not a layout anyone runs)


class ShapeRank(Collectives):
    """Rank 0 of ``tp`` on meta tensors: weights sliced as the runtime slices them, and every
    collective answering with the shape the real one returns (every rank's share has one shape)."""

    def __init__(self, tp: int):
        self.tp, self.rank = tp, 0

    def column_weight(self, weight: torch.Tensor, dim: int, segments: tuple[int, ...]) -> torch.Tensor:
        idx = segment_permutation(segments, self.tp).chunk(self.tp)[0].to(weight.device)
        return weight.index_select(dim, idx)

    def row_weight(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        return weight.chunk(self.tp, dim=dim)[0]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial * 1

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x] * self.tp, dim=dim)

    def reduce_scatter_sequence(self, partial: torch.Tensor, dim: int) -> torch.Tensor:
        return partial.chunk(self.tp, dim=dim)[0]


def prove_shapes(module: nn.Module, inputs: tuple, columns: tuple[str, ...], rows: tuple[str, ...],
                 segments: dict[str, tuple[int, ...]], tp: int, sequence: bool = False,
                 whole: dict[str, tuple[int, ...]] | None = None) -> set[int]:
    """Run ``module`` (meta, real size) forward and backward as one of ``tp`` ranks on ``inputs``
    (meta, real shapes); the sizes tp had to divide. Raises :class:`NoShardRule` naming the op
    whose rule does not hold at this size. ``sequence``: under sequence parallelism (the hidden
    state comes in, and the output must leave, as this rank's share of the sequence)."""
    from autopar.sharding.check import (
        SEQ_DIM,
        _first_tensor,
        _floating_leaves,
        _MetaValues,
        hidden_input,
        install_projection_hooks,
        with_hidden_input,
    )

    args, kwargs = inputs
    hidden = hidden_input(args, kwargs) if sequence else None
    if sequence and (hidden is None or hidden[1].dim() != 3):
        raise NoShardRule("sequence parallel", "the layer's hidden state is not [batch, sequence, features]")
    leaves = _floating_leaves((args, kwargs))
    for t in leaves:
        t.requires_grad_(True)
    params = [p for p in module.parameters() if p.requires_grad]
    handles = install_projection_hooks(module, columns, rows, segments, whole=whole)
    try:
        with _MetaValues(), ShardMode(ShapeRank(tp), dropout=False) as mode:
            if hidden is not None:
                length = int(hidden[1].shape[SEQ_DIM])
                share = mode.enter_sequence(hidden[1].chunk(tp, SEQ_DIM)[0], SEQ_DIM, length)
                args, kwargs = with_hidden_input(args, kwargs, hidden[0], share)
            out = _first_tensor(module(*args, **kwargs))
        lay = mode.layout(out)
        if hidden is not None and (lay is None or not lay.sequence or lay.dim != SEQ_DIM):
            raise NoShardRule("output", "sequence parallel: the layer's output is not its share of the sequence")
        if hidden is None and lay is not None:
            raise NoShardRule("output", "the layer's output is still sharded (no row projection closes it)")
        torch.autograd.grad(out.sum(), [*params, *leaves], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for c, s in segments.items():
        mode.divisors.update(x for i, x in enumerate(s) if i not in (whole or {}).get(c, ()))
    return set(mode.divisors)


def meta_inputs(recorded: tuple) -> tuple:
    """``recorded`` (args, kwargs) with every tensor a fresh meta tensor of its shape (real sizes)."""
    from autopar.sharding.narrow import probe_inputs

    return probe_inputs(recorded, {}, -1, None)


def degrees_to_try(divisors: set[int], limit: int = MAX_DEGREE) -> list[int]:
    """Every degree 2..``limit`` that divides all of ``divisors``."""
    return [d for d in range(2, limit + 1) if all(s % d == 0 for s in divisors)]


__all__ = ["MAX_DEGREE", "ShapeRank", "degrees_to_try", "meta_inputs", "prove_shapes"]
