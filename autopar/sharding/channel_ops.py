"""The sharding rules of a selective state-space mixer (Mamba's): its per-channel convolution, and a
projection inside the layer that contracts over the sharded channels.

A Mamba mixer splits over its inner channels (``d_inner``) as GPT-NeoX's ``ParallelMambaBlock`` does
(EleutherAI/gpt-neox, ``megatron/model/mamba/mamba.py``): ``in_proj`` column-parallel (its ``x`` and
``z`` halves two segments), the depthwise ``conv1d`` on each rank's channels, ``x_proj`` a row projection
over the sharded channels, the scan per channel, ``out_proj`` row. Here:

- :func:`conv` — a depthwise convolution (``groups`` = channels, one input channel per group) on a share
  of its channels: the weight and bias cut to the same channels, ``groups`` to the local count. Each
  output channel reads only its own input channel, so the share is exact.
- :func:`inner_row` — ``F.linear`` of an activation sharded on its last dim as one block by a weight not
  split by the style (``x_proj``): this rank's columns of the weight, the partial products summed over the
  tp group (an all-reduce, counted as a statistic the style prices), so ``dt``, ``B`` and ``C`` come out
  whole on every rank. GPT-NeoX's row ``x_proj`` leaves the partial sums unreduced; a scan that reads ``B``
  and ``C`` for every channel needs their sum to match one device.

The mixer's per-channel parameters (``conv1d``'s weight and bias, ``dt_proj``'s, ``A_log``, ``D``: every
parameter of the group's module whose first dim is the channels, :func:`channel_params`) are read directly by
its code, not through a projection's forward; they are split on that dim like a column's weight (DTensor
``Shard(0)`` on the mesh), and :class:`~autopar.sharding.rules.ShardMode` hands the code this rank's share
of each wherever it reads one. So ``dt_proj.weight @ dt`` makes this rank's channels of the time step, and
the discretisation and scan run on shares. ``x_proj``'s weight stays whole: a rank uses its columns, and
their gradient is summed over the tp group (:meth:`~autopar.sharding.rules.Collectives.grad_sum`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autopar.sharding.layout import NoShardRule, Sharded, local_of, projection_dims

ShardMode = Any  # autopar.sharding.rules.ShardMode


def conv(mode: ShardMode, name, func, args, kwargs):
    """``conv1d``/``conv2d`` of an input sharded on its channels (dim 1), depthwise: see the module docstring."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    bound = dict(zip(names, args)) | kwargs
    x, weight = bound["input"], bound["weight"]
    lay, groups = mode.layout(x), bound.get("groups", 1)
    if lay is None or lay.dim != 1 or len(lay.segments) != 1:
        raise NoShardRule(name, "its input is not sharded on its channels as one block")
    channels = lay.size
    if groups != channels or mode.global_shape(weight)[0] != channels or weight.shape[1] != 1:
        raise NoShardRule(name, f"not depthwise (groups {groups}, weight {tuple(weight.shape)}, {channels} "
                          "channels): an output channel reads other ranks' channels")
    for key in ("weight", "bias"):  # a per-channel parameter arrives as this rank's share; else cut here
        t = bound.get(key)
        if t is None:
            continue
        tl = mode.layout(t)
        if tl is None:
            bound[key] = local_of(mode, t, 0, lay)
        elif (tl.dim, tl.segments) != (0, lay.segments):
            raise NoShardRule(name, f"its {key} is split unlike its input's channels")
    bound["groups"] = lay.local(mode.tp)
    out = func(**{k: v for k, v in bound.items() if k in names})
    return mode.tag(out, Sharded(1, lay.segments, lay.source))


def inner_row(mode: ShardMode, name, func, args, kwargs):
    """``F.linear`` contracting over the sharded dim, outside the style's projections: see the module
    docstring."""
    x = args[0]
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    lay = mode.layout(x)
    if lay is None or mode.layout(weight) is not None or (bias is not None and mode.layout(bias) is not None):
        raise NoShardRule(name, "its weight is sharded, or its input is not")
    if lay.sequence or lay.dim != x.dim() - 1 or len(lay.segments) != 1 or weight.shape[-1] != lay.size:
        raise NoShardRule(name, "contracts over a sharded dimension that is not its input's last, as one block")
    partial = torch.nn.functional.linear(x, local_of(mode, weight, 1, lay))
    mode.stat_reduces.append(partial.numel())
    y = mode.comm.reduce(partial)
    return y + bias if bias is not None else y


def channel_params(layer: nn.Module, columns: tuple[str, ...], rows: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Per column projection (paths relative to ``layer``), the per-channel parameters its group shares
    out: only for a group of one column in a submodule of its own (a mixer, not the layer) that also holds
    other projections (a Mamba mixer's ``x_proj``, ``dt_proj``), every parameter of that module outside the
    column and the row whose first dim is the row's input width (the channels). Attention and MLP groups
    hold none, nor does a block that holds its projections itself (a Switch block's norms are no channels)."""
    out: dict[str, tuple[str, ...]] = {}
    for row in rows:
        parent = row.rsplit(".", 1)[0] if "." in row else ""
        mine = [c for c in columns if (c.rsplit(".", 1)[0] if "." in c else "") == parent]
        owner = layer.get_submodule(parent) if parent else layer
        dims = projection_dims(layer.get_submodule(row))
        others = [n for n, m in owner.named_modules() if n and projection_dims(m) is not None
                  and f"{parent}.{n}".lstrip(".") not in (*mine, row)]
        if not parent or len(mine) != 1 or not others or dims is None:
            continue
        skip = tuple(f"{p[len(parent):].lstrip('.')}." for p in (*mine, row))
        found = tuple(f"{parent}.{n}".lstrip(".") for n, p in owner.named_parameters()
                      if not n.startswith(skip) and p.dim() >= 1 and p.shape[0] == dims[0])
        if found:
            out[mine[0]] = found
    return out


__all__ = ["channel_params", "conv", "inner_row"]
