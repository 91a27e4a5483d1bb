"""The sharding rules, op by op: how each op runs on one rank's share of its inputs.

Each rule takes the active :class:`~autopar.sharding.rules.ShardMode`,
the op's name, the op and its arguments; it calls the op with local
arguments (local shapes, split sizes, index ranges) and tags what it returns
with where the share went. A rule raises
:class:`~autopar.sharding.layout.NoShardRule` when the op cannot run
exactly on shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from autopar.sharding.attention_ops import baddbmm, matmul, sdpa
from autopar.sharding.channel_ops import conv, inner_row
from autopar.sharding.join_ops import cat, complex_view
from autopar.sharding.layout import TAG, NoShardRule, Sharded, local_of

ShardMode = Any  # autopar.sharding.rules.ShardMode (which imports this module)


def any_tagged(mode: ShardMode, values) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            tag = getattr(v, TAG, None)
            if tag is not None and tag[0] is mode.key:
                return True
        elif isinstance(v, (tuple, list)) and v and any_tagged(mode, v):
            return True
    return False


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d





def _size(mode: ShardMode, name, func, args, kwargs):
    shape = mode.global_shape(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        return torch.Size(shape)
    return shape[dim]


def _get_shape(mode: ShardMode, name, func, args, kwargs):
    return torch.Size(mode.global_shape(args[0]))


def _numel(mode: ShardMode, name, func, args, kwargs):
    return math.prod(mode.global_shape(args[0]))


def _len(mode: ShardMode, name, func, args, kwargs):
    return mode.global_shape(args[0])[0]


def _passthrough_tagged(mode: ShardMode, name, func, args, kwargs):
    """Ops that keep shape and layout (contiguous, clone, to, detach…)."""
    lay = mode.layout(args[0])
    out = func(*args, **kwargs)
    if lay is None:  # the sharded value only lends its dtype or device (``x.type_as(q)``)
        return out
    return mode.tag(out, lay) if isinstance(out, torch.Tensor) and out.shape == args[0].shape else out


def _broadcast_shape(shapes: list[list[int]]) -> list[int]:
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, v in enumerate(s):
            j = n - len(s) + i
            if v != 1:
                if out[j] not in (1, v):
                    raise NoShardRule("broadcast", f"shapes {shapes} do not broadcast")
                out[j] = v
    return out


def elementwise(mode: ShardMode, name, func, args, kwargs):
    """Broadcasting ops: every sharded input must meet on the same output dim and layout;
    replicated inputs that are full size there are cut to this rank's share."""
    tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    shapes = [mode.global_shape(t) for t in tensors]
    out_shape = _broadcast_shape(shapes)
    n = len(out_shape)
    where: Sharded | None = None
    for t in tensors:
        lay = mode.layout(t)
        if lay is None:
            continue
        at = Sharded(lay.dim + n - t.dim(), lay.segments, lay.source)
        if where is not None and (where.dim, where.segments, where.sequence) != (at.dim, at.segments, at.sequence):
            raise NoShardRule(name, "its sharded inputs are split on different dims or segments")
        where = at
    assert where is not None

    def fix(a):
        if not isinstance(a, torch.Tensor) or mode.layout(a) is not None:
            return a
        j = where.dim - (n - a.dim())
        if j < 0 or a.shape[j] == 1:
            return a
        if a.shape[j] == where.size:
            return local_of(mode, a, j, where)
        raise NoShardRule(name, f"a replicated input of size {a.shape[j]} meets a sharded dim of {where.size}")

    out = func(*[fix(a) for a in args], **{k: fix(v) for k, v in kwargs.items()})
    if isinstance(out, torch.Tensor) and out.dim() == n:
        return mode.tag(out, where)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        raise NoShardRule(name, "reduces a sharded activation to a scalar")
    raise NoShardRule(name, "its result does not keep the broadcast shape")


def _dim_arg(args, kwargs, pos: int, key: str = "dim", default: Any = None) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(key, default)


def _softmax(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    dim = _dim_arg(args, kwargs, 1)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as a non-input argument")
    if dim is None or _dim(dim, x.dim()) == lay.dim:
        raise NoShardRule(name, "normalises over the sharded dimension")
    return mode.tag(func(*args, **kwargs), lay)


def _norm(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    shape = _dim_arg(args, kwargs, 1, "normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    if lay is None or lay.dim >= x.dim() - k:
        raise NoShardRule(name, "normalises over the sharded dimension")
    rest = [a for a in [*args[2:], *kwargs.values()] if isinstance(a, torch.Tensor)]
    if any(mode.layout(a) is not None for a in rest):
        raise NoShardRule(name, "a sharded weight")
    return mode.tag(func(*args, **kwargs), lay)


_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
                         "argmax", "argmin", "prod", "all", "any", "var_mean", "std_mean"})


def _reduction(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    if lay is None:
        return elementwise(mode, name, func, args, kwargs)
    dim = _dim_arg(args, kwargs, 1)
    if name == "norm":
        dim = _dim_arg(args, kwargs, 2)
    if dim is None or isinstance(dim, torch.Tensor):
        raise NoShardRule(name, "reduces over every dimension, the sharded one included")
    dims = [_dim(d, x.dim()) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
    if lay.dim in dims:
        return _reduce_across(mode, name, x, lay, dims, args, kwargs)
    keep = bool(_dim_arg(args, kwargs, 3 if name == "norm" else 2, "keepdim", False))
    new = lay.dim if keep else lay.dim - sum(1 for d in dims if d < lay.dim)
    out = func(*args, **kwargs)
    # ``max(dim=…)`` returns a named pair (``.values``, ``.indices``): tagged as it is, not as a tuple
    return mode.tag(out, Sharded(new, lay.segments, lay.source))


def _reduce_across(mode: ShardMode, name, x: torch.Tensor, lay: Sharded, dims: list[int], args, kwargs):
    """A sum or mean over the sharded dimension (OLMo2's RMSNorm over the whole query projection):
    each rank's partial sum, summed over the tp group (an all-reduce), is the whole one, on every
    rank. Its gradient needs no sum of its own: where the result meets a share again (``x *
    rsqrt(var)``) its gradient is summed there (:meth:`Collectives.grad_sum`)."""
    if name not in ("sum", "mean") or lay.sequence:
        raise NoShardRule(name, "reduces over the sharded dimension")
    if any(k not in ("dim", "keepdim") for k in kwargs) or len(args) > 3:
        raise NoShardRule(name, "reduces over the sharded dimension with a dtype or an output")
    keep = bool(_dim_arg(args, kwargs, 2, "keepdim", False))
    partial = torch.sum(x, dims, keepdim=keep)
    if name == "mean":
        gshape = mode.global_shape(x)
        partial = partial / math.prod(gshape[d] for d in dims)
    mode.stat_reduces.append(partial.numel())
    return mode.comm.reduce(partial)


# -- shapes ---------------------------------------------------------------


def _target_shape(args, start: int) -> list[int]:
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = rest[0]
    return [int(s) for s in rest]


def _resolve(shape: list[int], numel: int, op: str) -> list[int]:
    if shape.count(-1) > 1:
        raise NoShardRule(op, "more than one -1 in a shape")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = [numel // known if s == -1 else s for s in shape]
    if math.prod(shape) != numel:
        raise NoShardRule(op, f"shape {shape} does not fit {numel} elements")
    return shape


def view_layout(mode: ShardMode, in_shape: list[int], lay: Sharded, out_shape: list[int], op: str
                ) -> tuple[Sharded, list[int]]:
    """Where a sharded dimension goes under a reshape of global ``in_shape`` to ``out_shape``,
    and the local shape to ask for; raises :class:`NoShardRule` when no layout is exact."""
    d = lay.dim
    pin = [math.prod(in_shape[:k]) for k in range(len(in_shape) + 1)]
    pout = [math.prod(out_shape[:k]) for k in range(len(out_shape) + 1)]
    outs = set(pout)
    c = max(k for k in range(d + 1) if pin[k] in outs)
    c_end = min(k for k in range(d + 1, len(in_shape) + 1) if pin[k] in outs)
    e = max(k for k in range(len(out_shape) + 1) if pout[k] == pin[c])
    e_end = min(k for k in range(len(out_shape) + 1) if pout[k] == pin[c_end])
    outer = math.prod(in_shape[c:d])
    if outer != 1 and lay.sequence:  # sequence parallelism gathers and scatters one contiguous share
        raise NoShardRule(op, "merges the sharded dimension into an outer one (ranks would interleave)")
    inner = math.prod(in_shape[d + 1:c_end])
    # the merged group, still segment-contiguous: merged into an outer dim (Bloom's [batch, heads]
    # viewed as batch × heads) every outer index repeats the segments, each split across ranks
    segments = tuple(s * inner for _ in range(outer) for s in lay.segments)
    group = out_shape[e:e_end]
    if not group:
        raise NoShardRule(op, "drops the sharded dimension")
    while True:
        lead = next((i for i, s in enumerate(group) if s != 1), None)
        if lead is None:
            raise NoShardRule(op, "the sharded dimension becomes size 1")
        rest = math.prod(group[lead + 1:])
        if all(s % rest == 0 for s in segments) and all((s // rest) % mode.tp == 0 for s in segments):
            new = tuple(s // rest for s in segments)
            dim = e + lead
            break
        if len(set(segments)) == 1 and group[lead] == len(segments):
            # [q; k; v] viewed as (3, …): each rank's share lives in the dims after the 3
            segments = (segments[0],)
            e, group = e + lead + 1, group[lead + 1:]
            continue
        k = group[lead]
        # a fused [q; k; v] viewed as (3, heads, head_dim) with no split before: retried as k segments
        # (not (heads, head_dim): a head count tp does not divide is tried at other degrees instead)
        hint = (lay.source, (lay.segments[0] // k,) * k) if len(lay.segments) == 1 and k > 1 \
            and len(group) - lead >= 3 and lay.segments[0] % k == 0 and not lay.sequence and lay.source else None
        raise NoShardRule(op, f"splits the sharded dimension ({'+'.join(map(str, lay.segments))}) into "
                          f"{tuple(out_shape[e:e_end])}, which tp={mode.tp} cannot share exactly", hint)
    for s in new:
        mode.divisors.add(s)
    local = list(out_shape)
    local[dim] = sum(new) // mode.tp
    return Sharded(dim, new, lay.source), local


def _view(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as a shape argument")
    gshape = mode.global_shape(x)
    numel = math.prod(gshape)
    if name in ("view", "reshape", "_reshape_alias"):
        if len(args) > 1 and isinstance(args[1], torch.dtype):
            raise NoShardRule(name, "reinterprets a sharded activation's dtype")
        target = _target_shape(args, 1) if len(args) > 1 else list(kwargs.get("shape", kwargs.get("size")))
    elif name in ("view_as", "reshape_as"):
        target = mode.global_shape(args[1])
    elif name == "flatten":
        start = _dim(_dim_arg(args, kwargs, 1, "start_dim", 0), x.dim())
        end = _dim(_dim_arg(args, kwargs, 2, "end_dim", -1), x.dim())
        target = gshape[:start] + [math.prod(gshape[start:end + 1])] + gshape[end + 1:]
    elif name == "unflatten":
        dim = _dim(_dim_arg(args, kwargs, 1), x.dim())
        sizes = list(_dim_arg(args, kwargs, 2, "sizes"))
        sizes = _resolve(sizes, gshape[dim], name)
        target = gshape[:dim] + sizes + gshape[dim + 1:]
    elif name == "unsqueeze":
        dim = _dim_arg(args, kwargs, 1)
        dim = dim + x.dim() + 1 if dim < 0 else dim
        target = gshape[:dim] + [1] + gshape[dim:]
    elif name == "squeeze":
        dim = _dim_arg(args, kwargs, 1)
        dims = range(x.dim()) if dim is None else [_dim(d, x.dim()) for d in
                                                    (dim if isinstance(dim, (tuple, list)) else [dim])]
        target = [s for i, s in enumerate(gshape) if not (i in dims and s == 1)]
    else:
        raise NoShardRule(name, "no sharding rule for this op on a sharded activation")
    target = _resolve(target, numel, name)
    new, local = view_layout(mode, gshape, lay, target, name)
    method = "view" if name in ("view", "view_as", "flatten", "unflatten", "unsqueeze", "squeeze") else "reshape"
    return mode.tag(getattr(x, method)(local), new)


def _permute_like(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as a non-input argument")
    n = x.dim()
    order = list(range(n))
    if name == "permute":
        order = [_dim(d, n) for d in _target_shape(args, 1)]
    elif name in ("transpose", "swapaxes", "swapdims"):
        a, b = _dim(_dim_arg(args, kwargs, 1, "dim0"), n), _dim(_dim_arg(args, kwargs, 2, "dim1"), n)
        order[a], order[b] = order[b], order[a]
    elif name in ("t", "get_T", "get_mT"):
        order[-1], order[-2] = order[-2], order[-1]
    elif name in ("movedim", "moveaxis"):
        src, dst = _dim_arg(args, kwargs, 1, "source"), _dim_arg(args, kwargs, 2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        rest = [i for i in range(n) if i not in [_dim(s, n) for s in src]]
        result: list[int | None] = [None] * n
        for s, t in zip(src, dst):
            result[_dim(t, n)] = _dim(s, n)
        it = iter(rest)
        order = [r if r is not None else next(it) for r in result]  # type: ignore[misc]
    out = func(*args, **kwargs)
    return mode.tag(out, Sharded(order.index(lay.dim), lay.segments, lay.source))


def _split(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as a non-input argument")
    gshape = mode.global_shape(x)
    if name == "tensor_split":  # by indices or a count: ruled along a dim other than the sharded one
        if _dim(_dim_arg(args, kwargs, 2, "dim", 0), x.dim()) == lay.dim:
            raise NoShardRule(name, "splits the sharded dimension at indices")
        return mode.tag(tuple(func(*args, **kwargs)), lay)
    if name == "chunk":
        chunks = int(_dim_arg(args, kwargs, 1, "chunks"))
        dim = _dim(_dim_arg(args, kwargs, 2, "dim", 0), x.dim())
        step = -(-gshape[dim] // chunks)
        sizes = [min(step, gshape[dim] - i) for i in range(0, gshape[dim], step)]
    elif name == "unbind":
        dim = _dim(_dim_arg(args, kwargs, 1, "dim", 0), x.dim())
        sizes = [1] * gshape[dim]
    else:
        spec = _dim_arg(args, kwargs, 1, "split_size_or_sections", kwargs.get("split_size"))
        dim = _dim(_dim_arg(args, kwargs, 2, "dim", 0), x.dim())
        if isinstance(spec, int):
            sizes = [min(spec, gshape[dim] - i) for i in range(0, gshape[dim], spec)]
        else:
            sizes = [int(s) for s in spec]
    if dim != lay.dim:
        out = func(*args, **kwargs)
        return mode.tag(tuple(out), lay)
    if name == "unbind":
        raise NoShardRule(name, "unbinds the sharded dimension")
    pieces = _segment_pieces(mode, lay, sizes, name)
    local = [sum(p) // mode.tp for p in pieces]
    out = torch.split(x, local, dim)
    return tuple(mode.tag(t, Sharded(dim, p, lay.source)) for t, p in zip(out, pieces))


def _segment_pieces(mode: ShardMode, lay: Sharded, sizes: list[int], op: str) -> list[tuple[int, ...]]:
    """Group ``lay``'s segments into consecutive pieces of global ``sizes`` (boundaries must meet)."""
    bounds, acc = [], 0
    for s in lay.segments:
        acc += s
        bounds.append(acc)
    cuts, acc = [], 0
    for s in sizes:
        acc += s
        cuts.append(acc)
    if not set(cuts) <= set(bounds) and not set(bounds) <= set(cuts):
        raise NoShardRule(op, f"cuts the sharded dimension at {cuts[:-1]}, not at its segment boundaries "
                          f"{bounds[:-1]}", (lay.source, tuple(sizes)))
    if not set(cuts) <= set(bounds):  # finer cuts inside a segment: ask for those segments
        raise NoShardRule(op, f"cuts inside a segment at {cuts[:-1]}", (lay.source, tuple(sizes)))
    pieces, cur = [], []
    for s, b in zip(lay.segments, bounds):
        cur.append(s)
        if b in cuts:
            pieces.append(tuple(cur))
            cur = []
    return pieces


def _getitem(mode: ShardMode, name, func, args, kwargs):
    x, idx = args[0], args[1]
    lay = mode.layout(x)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as an index")
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, torch.Tensor) or isinstance(i, list) for i in items):
        raise NoShardRule(name, "advanced indexing into a sharded activation")
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (x.dim() - n_real) + items[k + 1:]
    items += [slice(None)] * (x.dim() - sum(1 for i in items if i is not None))
    gshape = mode.global_shape(x)
    out_dim, in_dim, new_lay, local_items = 0, 0, None, []
    for it in items:
        if it is None:
            out_dim += 1
            local_items.append(None)
            continue
        if in_dim == lay.dim:
            if isinstance(it, int) or not isinstance(it, slice):
                raise NoShardRule(name, "indexes the sharded dimension with a scalar")
            start, stop, step = it.indices(gshape[in_dim])
            if step != 1:
                raise NoShardRule(name, "a strided slice of the sharded dimension")
            sizes = [s for s in (start, stop - start, gshape[in_dim] - stop) if s > 0]
            pieces = _segment_pieces(mode, lay, sizes, name)
            which = 0 if start == 0 else 1
            keep = pieces[which]
            lo = sum(sum(p) for p in pieces[:which]) // mode.tp
            local_items.append(slice(lo, lo + sum(keep) // mode.tp))
            new_lay = Sharded(out_dim, keep, lay.source)
            out_dim += 1
        else:
            local_items.append(it)
            if isinstance(it, slice):
                out_dim += 1
        in_dim += 1
    out = x[tuple(local_items)]
    return mode.tag(out, new_lay) if new_lay is not None else out


def _expand(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    if lay is None:
        raise NoShardRule(name, "a sharded activation as a shape argument")
    sizes = mode.global_shape(args[1]) if name == "expand_as" else _target_shape(args, 1)
    lead = len(sizes) - x.dim()
    d = lay.dim + lead
    if name == "repeat":
        if sizes[d] != 1:
            raise NoShardRule(name, "repeats along the sharded dimension")
        out = x.repeat(sizes)
        return mode.tag(out, Sharded(d, lay.segments, lay.source))
    if sizes[d] not in (-1, lay.size):
        raise NoShardRule(name, "expands the sharded dimension")
    local = list(sizes)
    local[d] = -1
    return mode.tag(x.expand(local), Sharded(d, lay.segments, lay.source))


def _new_tensor(mode: ShardMode, name, func, args, kwargs):
    """``x.new_empty(shape)`` and kin: a tensor of the same rank whose size on ``x``'s sharded dim is the
    whole of it is this rank's share there (DeepSeek's MLA fills its keys this way); any other shape
    owes nothing to the share and is made whole."""
    x = args[0]
    lay = mode.layout(x)
    if name == "new_full":
        sizes, fill = (args[1] if len(args) > 1 else kwargs["size"]), args[2:]
    else:
        sizes, fill = (_target_shape(args, 1) if len(args) > 1 else kwargs["size"]), ()
    sizes = [int(s) for s in sizes]
    rest = {k: v for k, v in kwargs.items() if k != "size"}
    if lay is None or len(sizes) != x.dim() or sizes[lay.dim] != lay.size:
        return func(x, sizes, *fill, **rest)
    local = list(sizes)
    local[lay.dim] = lay.size // mode.tp
    return mode.tag(func(x, local, *fill, **rest), lay)


def _repeat_interleave(mode: ShardMode, name, func, args, kwargs):
    x = args[0]
    lay = mode.layout(x)
    reps = _dim_arg(args, kwargs, 1, "repeats")
    dim = _dim_arg(args, kwargs, 2, "dim")
    if lay is None or dim is None or not isinstance(reps, int):
        raise NoShardRule(name, "repeat_interleave of a sharded activation without an int repeat and dim")
    out = func(*args, **kwargs)
    if _dim(dim, x.dim()) == lay.dim:
        return mode.tag(out, Sharded(lay.dim, tuple(s * reps for s in lay.segments), lay.source))
    return mode.tag(out, lay)


def _dropout(mode: ShardMode, name, func, args, kwargs):
    """Dropout on a share draws the mask the whole tensor would get (every rank of a tp group
    draws from the same generator state) and keeps this rank's share of it: the ranks' masks
    are the pieces of one mask, as on one device, not one piece repeated."""
    x = args[0]
    if not mode.dropout:
        return x
    p = float(_dim_arg(args, kwargs, 1, "p", 0.5))
    training = bool(_dim_arg(args, kwargs, 2, "training", True))
    lay = mode.layout(x)
    if name != "dropout" or lay is None or not training or p == 0.0:
        return elementwise(mode, name, func, args, kwargs)
    full = torch.empty(mode.global_shape(x), dtype=x.dtype, device=x.device)
    keep = full.bernoulli_(1.0 - p) if p < 1.0 else full.zero_()
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return mode.tag(x * local_of(mode, keep, lay.dim, lay) * scale, lay)


ELEMENTWISE = frozenset("""
add __add__ __radd__ __iadd__ add_ sub __sub__ __rsub__ __isub__ sub_ rsub mul __mul__ __rmul__ __imul__ mul_
div __truediv__ __rtruediv__ __itruediv__ div_ true_divide __floordiv__ floor_divide neg __neg__ neg_ pow __pow__
__rpow__ pow_ exp exp_ log log1p expm1 tanh tanh_ sigmoid sigmoid_ relu relu_ gelu silu silu_ mish softplus
leaky_relu elu selu hardswish hardsigmoid rsqrt sqrt square abs sin cos erf erfc masked_fill masked_fill_ where
clamp clamp_ clip maximum minimum float half bfloat16 double to type_as type clone detach detach_ contiguous
requires_grad_ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ eq ne lt le gt ge logical_not logical_and logical_or
__and__ __or__ __invert__ bitwise_not sign reciprocal lerp addcmul addcdiv copy_ fill_ zero_ nan_to_num
get_data glu_no polar complex conj conj_physical resolve_conj get_real get_imag
ones_like zeros_like empty_like full_like rand_like randn_like tril triu
""".split())

RULES: dict[str, Callable] = {
    "size": _size, "get_shape": _get_shape, "numel": _numel, "__len__": _len,
    "softmax": _softmax, "log_softmax": _softmax, "_softmax": _softmax,
    "layer_norm": _norm, "rms_norm": _norm,
    "view": _view, "reshape": _view, "view_as": _view, "reshape_as": _view, "flatten": _view,
    "unflatten": _view, "unsqueeze": _view, "squeeze": _view,
    "permute": _permute_like, "transpose": _permute_like, "swapaxes": _permute_like, "swapdims": _permute_like,
    "t": _permute_like, "get_T": _permute_like, "get_mT": _permute_like, "movedim": _permute_like,
    "moveaxis": _permute_like,
    "split": _split, "chunk": _split, "unbind": _split, "split_with_sizes": _split,
    "tensor_split": _split,
    "__getitem__": _getitem,
    "expand": _expand, "expand_as": _expand, "repeat": _expand,
    "repeat_interleave": _repeat_interleave,
    "new_empty": _new_tensor, "new_zeros": _new_tensor, "new_ones": _new_tensor, "new_full": _new_tensor,
    "cat": cat, "concat": cat, "concatenate": cat, "stack": cat,
    "matmul": matmul, "__matmul__": matmul, "bmm": matmul, "baddbmm": baddbmm,
    "scaled_dot_product_attention": sdpa,
    "conv1d": conv, "linear": inner_row,
    "view_as_complex": complex_view, "view_as_real": complex_view,
    "dropout": _dropout, "dropout_": _dropout, "feature_dropout": _dropout,
    **{name: _reduction for name in _REDUCTIONS},
}
for _passthrough in ("contiguous", "clone", "detach", "to", "float", "half", "bfloat16", "double", "type_as",
                     "requires_grad_", "get_data"):
    RULES[_passthrough] = _passthrough_tagged
METADATA_OPS = frozenset({"dim", "get_ndim", "get_dtype", "get_device", "get_requires_grad", "get_is_leaf",
                         "get_grad_fn", "is_floating_point", "is_contiguous", "element_size", "get_layout",
                         "data_ptr", "get_is_cuda", "get_is_meta", "is_complex", "get_names", "get_grad",
                         "stride", "storage_offset", "untyped_storage", "get_itemsize", "get_nbytes"})
for _n in METADATA_OPS:
    RULES[_n] = lambda mode, name, func, args, kwargs: func(*args, **kwargs)


# what reads a tensor's shape or metadata, or detaches it: no gradient flows through these
NO_GRADIENT_OPS = METADATA_OPS | {"size", "get_shape", "numel", "__len__", "get_data", "detach", "detach_",
                                  "requires_grad_"}

__all__ = ["ELEMENTWISE", "METADATA_OPS", "NO_GRADIENT_OPS", "RULES", "any_tagged", "elementwise", "view_layout"]
