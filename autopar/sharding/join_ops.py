"""The sharding rules of the ops that join activations or pair their elements: cat/stack (with
replicated operands cut to a rank's share, gpt-oss's attention sinks) and ``view_as_complex`` /
``view_as_real`` (rotary embeddings as complex numbers, Meta's Llama and torchtitan's).

Split from :mod:`autopar.sharding.ops` (which registers them in ``RULES``) to keep files short.
"""

from __future__ import annotations

from typing import Any

from autopar.sharding.layout import NoShardRule, Sharded, local_of

ShardMode = Any  # autopar.sharding.rules.ShardMode


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dim_arg(args, kwargs, pos: int, key: str = "dim", default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(key, default)


def cat(mode: ShardMode, name, func, args, kwargs):
    tensors = list(args[0])
    dim = _dim_arg(args, kwargs, 1, "dim", 0)
    lays = [mode.layout(t) for t in tensors]
    if any(lay is None for lay in lays):
        tensors, lays = _cut_replicated(mode, name, tensors, lays, dim)
        args = (tensors, *args[1:])
    ndim = tensors[0].dim()
    if name == "stack":
        d0 = _dim(dim, ndim + 1)
        if any((lay.dim, lay.segments) != (lays[0].dim, lays[0].segments) for lay in lays):  # type: ignore[union-attr]
            raise NoShardRule(name, "stacks activations sharded differently")
        at = lays[0].dim + (1 if d0 <= lays[0].dim else 0)  # type: ignore[union-attr]
        return mode.tag(func(*args, **kwargs), Sharded(at, lays[0].segments, lays[0].source))  # type: ignore[union-attr]
    d0 = _dim(dim, ndim)
    if any(lay.dim != lays[0].dim for lay in lays):  # type: ignore[union-attr]
        raise NoShardRule(name, "joins activations sharded on different dims")
    if d0 == lays[0].dim:  # type: ignore[union-attr]
        segs = tuple(s for lay in lays for s in lay.segments)  # type: ignore[union-attr]
        return mode.tag(func(*args, **kwargs), Sharded(d0, segs, lays[0].source))  # type: ignore[union-attr]
    if any(lay.segments != lays[0].segments for lay in lays):  # type: ignore[union-attr]
        raise NoShardRule(name, "joins activations whose sharded dims are cut differently")
    return mode.tag(func(*args, **kwargs), lays[0])


def complex_view(mode: ShardMode, name, func, args, kwargs):
    """``view_as_complex`` pairs the last dim's two floats into one complex number, ``view_as_real``
    splits it back (rotary embeddings as Meta's Llama and torchtitan write them): a share on any other
    dim stays where it is, every rank holding whole pairs."""
    x = args[0]
    lay = mode.layout(x)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as a non-input argument")
    if name == "view_as_complex" and lay.dim >= x.dim() - 1:
        raise NoShardRule(name, "pairs the sharded dimension's elements into complex numbers")
    return mode.tag(func(*args, **kwargs), lay)


def _cut_replicated(mode: ShardMode, name: str, tensors: list, lays: list, dim: int) -> tuple[list, list]:
    """A cat of shares with replicated tensors (gpt-oss's per-head attention sinks beside the scores):
    exact when the join runs along another dim than the sharded one and each replicated tensor is
    whole there (one entry per head): a rank joins its own heads' entries (its gradient, a share of
    the whole one, is summed over the group as every replicated tensor's is)."""
    at = next(lay for lay in lays if lay is not None)
    ndim = tensors[0].dim()
    d0 = _dim(dim, ndim + 1 if name == "stack" else ndim)
    if name == "stack" or d0 == at.dim:
        raise NoShardRule(name, "joins sharded and replicated activations along the sharded dimension")
    out_t, out_l = [], []
    for t, lay in zip(tensors, lays):
        if lay is None:
            if t.dim() != ndim or t.shape[at.dim] != at.size:
                raise NoShardRule(name, f"joins a share with a replicated tensor of size "
                                  f"{t.shape[at.dim] if t.dim() == ndim else tuple(t.shape)} on the sharded "
                                  f"dimension (of {at.size})")
            t = mode.tag(local_of(mode, t, at.dim, at), at)
            lay = at
        out_t.append(t)
        out_l.append(lay)
    return out_t, out_l


__all__ = ["cat", "complex_view"]
