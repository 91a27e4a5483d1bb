"""The sharding rules of the ops that multiply activations together: matmul, baddbmm (Bloom's ALiBi
scores) and scaled-dot-product attention (its heads, and whole keys/values cut to a rank's heads).

Split from :mod:`autopar.sharding.ops` (which registers them in ``RULES``) to keep files short.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.sharding.layout import NoShardRule, Sharded, local_of

ShardMode = Any  # autopar.sharding.rules.ShardMode


def matmul(mode: ShardMode, name, func, args, kwargs):
    a, b = args[0], args[1]
    la, lb = mode.layout(a), mode.layout(b)
    if a.dim() < 2 or b.dim() < 2:
        raise NoShardRule(name, "a vector operand with a sharded activation")
    n = max(a.dim(), b.dim())
    out: Sharded | None = None
    if la is not None:
        pa = la.dim + n - a.dim()
        if la.dim == a.dim() - 1:
            raise NoShardRule(name, "contracts over the sharded dimension outside a row projection")
        out = Sharded(pa, la.segments, la.source)
    if lb is not None:
        pb = lb.dim + n - b.dim()
        if lb.dim == b.dim() - 2:
            raise NoShardRule(name, "contracts over the sharded dimension outside a row projection")
        if out is not None and (out.dim, out.segments) != (pb, lb.segments):
            raise NoShardRule(name, "its operands are sharded on different dims")
        out = Sharded(pb, lb.segments, lb.source)
    assert out is not None
    if out.dim >= n - 2:  # the m (of a) or n (of b) dim: the other operand must not be sharded there
        if la is not None and lb is not None:
            raise NoShardRule(name, "both operands sharded on their free dims")
    else:  # a batch dim: an unsharded operand must broadcast over it
        for t, lay in ((a, la), (b, lb)):
            if lay is None:
                j = out.dim - (n - t.dim())
                if j >= 0 and t.shape[j] != 1:
                    raise NoShardRule(name, "a replicated operand is full size on a sharded batch dim")
    return mode.tag(func(*args, **kwargs), out)


def baddbmm(mode: ShardMode, name, func, args, kwargs):
    """``beta * input + alpha * (batch1 @ batch2)`` (Bloom's ALiBi scores): the product on shares of
    the batch dim, a whole ``input`` cut to this rank's share of it."""
    x = args[0]
    b1 = args[1] if len(args) > 1 else kwargs["batch1"]
    b2 = args[2] if len(args) > 2 else kwargs["batch2"]
    lay = mode.layout(b1)
    if lay is None or lay.dim != 0 or mode.layout(b2) != lay:
        raise NoShardRule(name, "its batches are not both sharded alike on the batch dim")
    lx = mode.layout(x)
    if lx is None and x.dim() == 3 and x.shape[0] == lay.size:
        x = local_of(mode, x, 0, lay)
    elif lx is None and x.dim() == 3 and x.shape[0] != 1:
        raise NoShardRule(name, f"an input of batch {x.shape[0]} meets sharded batches of {lay.size}")
    elif lx is not None and lx != lay:
        raise NoShardRule(name, "its input is sharded unlike its batches")
    rest = {k: v for k, v in kwargs.items() if k not in ("batch1", "batch2")}
    return mode.tag(func(x, b1, b2, *args[3:], **rest), lay)


def sdpa(mode: ShardMode, name, func, args, kwargs):
    """Attention on this rank's heads. A key or value left whole (its projection replicated: fewer
    key/value heads than ranks) is cut to the heads this rank's queries read."""
    q = args[0]
    lq = mode.layout(q)
    if lq is None or lq.dim != q.dim() - 3:
        raise NoShardRule(name, "the query is not sharded on its head dimension")
    gqa = bool(kwargs.get("enable_gqa", False))
    kv = []
    for t in args[1:3]:
        lay = mode.layout(t)
        if lay is None:
            kv.append(heads_for(mode, name, t, lq, gqa))
        elif lay.dim != t.dim() - 3:
            off = tuple(dict.fromkeys(mode.layout(u).source for u in args[1:3] if mode.layout(u) is not None))
            if lq.source in off:  # GPTBigCode's multi-query c_attn: q for every head, one k/v head
                width = sum(mode.layout(u).size for u in args[1:3]  # type: ignore[union-attr]
                            if mode.layout(u) is not None and mode.layout(u).source == lq.source)  # type: ignore[union-attr]
                raise NoShardRule(name, f"key and value come from the query's fused projection {lq.source} "
                                  "with fewer heads than the tp degree; running only part of one projection "
                                  "whole on every rank is not supported", whole=(lq.source, width))
            raise NoShardRule(name, "query, key and value are not all sharded on their head dimension",
                              replicate=off)
        else:
            kv.append(t)
    args = (q, *kv, *args[3:])
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mode.layout(mask) is None:
        j = mask.dim() - 3
        if j >= 0 and mask.shape[j] != 1:
            if mask.shape[j] != lq.size:
                raise NoShardRule(name, "a mask whose head dimension does not match the heads")
            cut = local_of(mode, mask, j, lq)
            if len(args) > 3:
                args = (*args[:3], cut, *args[4:])
            else:
                kwargs = {**kwargs, "attn_mask": cut}
    return mode.tag(func(*args, **kwargs), lq)


def heads_for(mode: ShardMode, name: str, t: torch.Tensor, lq: Sharded, gqa: bool) -> torch.Tensor:
    """The heads of a whole key or value that this rank's query heads attend with: the same heads
    (one per query head), or under grouped-query attention the groups they belong to."""
    j = t.dim() - 3
    heads = t.shape[j]
    if heads == 1 and j >= 0:  # one head broadcast over every query head (multi-query): all of it, on every rank
        return t
    if heads == lq.size:
        return local_of(mode, t, j, lq)
    if not gqa or len(lq.segments) != 1 or lq.size % heads:
        raise NoShardRule(name, f"a whole key or value of {heads} heads meets {lq.size} query heads")
    group, local = lq.size // heads, lq.size // mode.tp
    lo = mode.comm.rank * local
    if local % group == 0:
        idx = torch.arange(lo // group, (lo + local) // group)
    elif group % local == 0:
        idx = torch.tensor([lo // group])
    else:
        raise NoShardRule(name, f"{local} query heads a rank straddle the groups of {group} sharing a key head")
    return t.index_select(j, idx.to(t.device))


__all__ = ["baddbmm", "heads_for", "matmul", "sdpa"]
