"""A fused column projection with some segments run whole: GPTBigCode's multi-query ``c_attn``.

One Linear yields ``[q for every head | k | v]`` with a single key/value head, fewer than any tp
degree. Megatron-Core and vLLM run such key/value rows whole on every rank beside each rank's share
of the query rows; so does this module. The projection's weight is held whole on every rank (a
plain replicated parameter, so optimizers, gradient norms and checkpoints see one ordinary tensor);
each rank multiplies only its query rows and the key/value rows:

* the query rows' gradient is summed over the tp group (each rank fills only its own rows);
* the key/value rows read the layer's replicated input directly, and their output, a replicated
  tensor, has its gradient summed over the tp group where it meets the query's share (the generic
  :meth:`~autopar.sharding.rules.Collectives.grad_sum` of the rules), as for separate replicated
  key/value projections.

The output is tagged with a :class:`Sharded` whose ``whole`` names those segments; only ``unsqueeze``
and a split at segment boundaries read it (anything else is refused), and the split hands the whole
pieces on untagged (replicated) and the shared ones as ordinary shares.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from autopar.sharding.layout import NoShardRule, Sharded, segment_indices

ShardMode = Any  # autopar.sharding.rules.ShardMode


def rows(segments: tuple[int, ...], whole: tuple[int, ...], tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output rows a rank computes, in its local order, split into (shared rows, whole rows)
    as positions into that order (the local output interleaves them segment by segment)."""
    parts, start = [], 0
    for i, s in enumerate(segments):
        parts.append(torch.arange(start, start + s) if i in whole else
                     segment_indices((s,), tp, rank) + start)
        start += s
    return torch.cat(parts), torch.tensor([i in whole for i, s in enumerate(segments) for _ in
                                           range(s if i in whole else s // tp)], dtype=torch.bool)


def project(mode: ShardMode, path: str, mod: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
            conv: bool, segments: tuple[int, ...], whole: tuple[int, ...]) -> torch.Tensor:
    """``x`` through a column projection whose ``whole`` segments every rank computes in full."""
    if mode.sequence is not None:
        raise NoShardRule(path, "sequence parallelism beside key/value rows run whole is not ruled")
    if mode.layout(x) is not None:
        raise NoShardRule(path, "a column projection reads an activation that is already sharded")
    for i, s in enumerate(segments):
        if i not in whole:
            mode.need(s, f"a segment of {path}'s output", path)
    tp, rank = mode.tp, mode.comm.rank
    idx, is_whole = rows(segments, whole, tp, rank)
    shared_rows, whole_rows = idx[~is_whole], idx[is_whole]
    wdim = 1 if conv else 0
    weight = mod.weight
    # every rank's shared rows (global indices): the block whose gradient each rank fills only in part
    block = torch.tensor([i not in whole for i, s in enumerate(segments) for _ in range(s)]).nonzero().flatten()

    def pick(param: torch.Tensor, dim: int, sel: torch.Tensor, summed: bool) -> torch.Tensor:
        param = mode.comm.replicated(param)
        if summed:  # this rank fills only its own shared rows: the block's gradient is summed over the group
            param = mode.comm.grad_sum(param.index_select(dim, block.to(param.device)))
            sel = torch.searchsorted(block, sel)
        return param.index_select(dim, sel.to(param.device))

    xin = mode.comm.copy_to(x)
    ys = _linear(xin, pick(weight, wdim, shared_rows, True),
                 pick(bias, 0, shared_rows, True) if bias is not None else None, conv)
    yw = _linear(x, pick(weight, wdim, whole_rows, False),
                 pick(bias, 0, whole_rows, False) if bias is not None else None, conv)
    pieces, si, wi = [], 0, 0
    for i, s in enumerate(segments):
        if i in whole:
            pieces.append(yw.narrow(-1, wi, s))
            wi += s
        else:
            pieces.append(ys.narrow(-1, si, s // tp))
            si += s // tp
    y = torch.cat(pieces, -1)
    return mode.tag(y, Sharded(y.dim() - 1, segments, path, whole))


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, conv: bool) -> torch.Tensor:
    if not conv:
        return torch.nn.functional.linear(x, w, b)
    out = torch.mm(x, w)
    return out + b if b is not None else out


def rule(mode: ShardMode, name: str, func, args, kwargs):
    """An op on a projection output holding some segments whole: ``unsqueeze`` or a split."""
    x = args[0]
    lay = mode.layout(x)
    if lay is None or not lay.whole or any(mode.layout(a) is not None and a is not x for a in args[1:]):
        raise NoShardRule(name, "an output with key/value rows run whole meets another sharded operand")
    if name == "unsqueeze":
        d = args[1] if len(args) > 1 else kwargs["dim"]
        d = d + x.dim() + 1 if d < 0 else d
        return mode.tag(func(*args, **kwargs), dataclasses.replace(lay, dim=lay.dim + (d <= lay.dim)))
    if name not in ("split", "split_with_sizes"):
        raise NoShardRule(name, "runs on a fused projection's output holding key/value rows whole (only a "
                          "split at its segments is ruled)")
    spec = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim = dim + x.dim() if dim < 0 else dim
    if dim != lay.dim or isinstance(spec, int):
        raise NoShardRule(name, "splits a fused projection's output holding key/value rows whole other than "
                          "into its segments")
    bounds, acc = [], 0
    for s in lay.segments:
        acc += s
        bounds.append(acc)
    cuts, acc = [], 0
    for s in spec:
        acc += int(s)
        cuts.append(acc)
    if not set(cuts) <= set(bounds):
        raise NoShardRule(name, f"cuts at {cuts[:-1]}, not at the segment boundaries {bounds[:-1]}")
    groups, cur = [], []
    for i, b in enumerate(bounds):
        cur.append(i)
        if b in cuts:
            groups.append(cur)
            cur = []
    local = [sum(lay.segments[i] if i in lay.whole else lay.segments[i] // mode.tp for i in g) for g in groups]
    out = torch.split(x, local, dim)
    result = []
    for t, g in zip(out, groups):
        segs = tuple(lay.segments[i] for i in g)
        kept = tuple(j for j, i in enumerate(g) if i in lay.whole)
        if len(kept) == len(g):
            result.append(t)  # every rank holds it whole: a replicated tensor
        elif not kept:
            result.append(mode.tag(t, Sharded(dim, segs, lay.source)))
        else:
            result.append(mode.tag(t, Sharded(dim, segs, lay.source, kept)))
    return tuple(result)


def whole_tail(segments: tuple[int, ...], width: int) -> tuple[int, ...]:
    """Indices of the trailing segments that make up ``width`` features (the key/value rows of a
    multi-query projection); empty if no run of trailing segments does."""
    acc = 0
    for i in range(len(segments) - 1, 0, -1):
        acc += segments[i]
        if acc == width:
            return tuple(range(i, len(segments)))
        if acc > width:
            break
    return ()


__all__ = ["project", "rows", "rule", "whole_tail"]
