"""Twin layers: reuse the measurement of a structurally identical layer.

Measuring a layer means dispatching each of its ops on meta tensors under
``FlopCounterMode`` and ``saved_tensors_hooks``, about a millisecond an op;
GPT-3 175B repeats one block 96 times, ~5000 ops. Two layers whose run is
*provably* the same — same ops with the same arguments in the same order,
same module classes, configurations and parameter shapes, and input values
with the same metadata (shape, stride, offset, dtype, autograd state, storage
size and aliasing) — dispatch the same kernels on the same metadata, so they
count the same FLOPs, save the same storages and produce outputs with the same
metadata. The later one ("the twin") is then *replayed*:

* its per-node stats are the measured layer's, except which saved storages
  are new: saves of storages the layer created are replayed as they happened;
  saves of storages that came from outside (the layer's inputs) are decided
  again against the run's real dedup state, so a storage saved by an earlier
  layer is still counted once;
* only values used after the layer are built, as meta tensors with the
  measured metadata and the same storage sharing (views of one storage stay
  views of one storage), then checked against the measured metadata.

Only meta values qualify (real data would need real execution), and anything
not covered above — unknown constants, hooks, tensor subclasses, inputs
mutated in place, storages reached other than through inputs — falls back to
executing the layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from autopar.sharding.detect import NodeStats

_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format, torch.Size, type(Ellipsis))
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)

# One save attempt while a node ran: (storage key or None for a direct entry, bytes, producer).
Event = tuple[Any, float, Any]


class NotReplayable(Exception):
    """This layer (or value) is outside what replaying can prove identical."""


# --------------------------------------------------------------------------- signatures


def _storage_key(t: torch.Tensor) -> tuple[Any, int]:
    try:
        s = t.untyped_storage()
        return s._cdata, int(s.nbytes())
    except Exception:  # noqa: BLE001
        return id(t), t.numel() * t.element_size()


def _const(value: Any) -> tuple:
    """A hashable, type-exact form of a constant argument (1, 1.0 and True differ)."""
    if type(value) in (tuple, list):
        return (type(value).__name__, tuple(_const(v) for v in value))
    if isinstance(value, slice):
        return ("slice", _const(value.start), _const(value.stop), _const(value.step))
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return ("dict", tuple((k, _const(v)) for k, v in value.items()))
    if type(value) in _SIMPLE:
        return ("c", type(value), value)
    raise NotReplayable(f"constant of type {type(value).__name__}")


def _module_signature(mod: nn.Module) -> tuple:
    """Class, simple attributes and tensor metadata of a called module and its children."""
    parts: list[tuple] = []
    for path, sub in mod.named_modules():
        if not type(sub).__module__.startswith("torch.nn."):
            raise NotReplayable(f"module class {type(sub).__qualname__} is not torch.nn's")
        if sub._forward_hooks or sub._forward_pre_hooks or "forward" in vars(sub):
            raise NotReplayable(f"module {path or type(mod).__name__} has hooks or its own forward")
        simple = tuple(sorted((k, _const(v)) for k, v in vars(sub).items() if type(v) in _SIMPLE))
        parts.append((path, type(sub), sub.extra_repr(), simple))
    for name, t in itertools.chain(mod.named_parameters(), mod.named_buffers()):
        parts.append((name, tuple(t.shape), t.stride(), t.dtype, t.device.type, t.requires_grad))
    return tuple(parts)


def _is_library_function(target: Any) -> bool:
    """torch, operator, math and builtin functions: results depend on their arguments only.

    A user function (``torch.fx.wrap``) could keep state between calls, so two
    calls with equal arguments are not provably equal.
    """
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "_operator", "operator", "math", "builtins")


def static_signature(gm: fx.GraphModule, key: str | None, nodes: list[fx.Node]) -> tuple[tuple, list[fx.Node]]:
    """The layer's structure relative to itself, and its external input nodes in first-use order.

    Node inputs become ("n", position in the layer) or ("x", external index);
    module targets are written relative to the layer's module path.
    """
    local = {n: i for i, n in enumerate(nodes)}
    ext: dict[fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in local:
                return ("n", local[a])
            return ("x", ext.setdefault(a, len(ext)))
        if type(a) in (tuple, list, immutable_list):
            return ("tuple" if type(a) is tuple else "list", tuple(arg(v) for v in a))
        if type(a) in (dict, immutable_dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        return _const(a)

    sig: list[tuple] = []
    for n in nodes:
        if n.op == "call_module":
            target = str(n.target)
            rel = target[len(key) + 1:] if key and target.startswith(key + ".") else ("abs", target)
            what: Any = (rel, _module_signature(gm.get_submodule(target)))
        elif n.op == "call_function" and _is_library_function(n.target):
            what = n.target
        elif n.op == "call_method":
            what = str(n.target)
        else:
            raise NotReplayable(f"node op {n.op}")
        sig.append((n.op, what, arg(n.args), arg(n.kwargs)))
    return tuple(sig), list(ext)


def _flatten(value: Any, leaves: list[torch.Tensor]) -> tuple:
    """The structure of a value with tensors taken out (in order) into ``leaves``."""
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN_TENSORS or not value.is_meta:
            raise NotReplayable("non-meta tensor or tensor subclass")
        leaves.append(value)
        return ("T",)
    if type(value) in (tuple, list):
        return (type(value), tuple(_flatten(v, leaves) for v in value))
    return _const(value)


def _build(struct: tuple, leaves: Any) -> Any:
    """Inverse of :func:`_flatten`: put tensors from the iterator ``leaves`` back."""
    if struct[0] == "T":
        return next(leaves)
    if struct[0] in (tuple, list):
        return struct[0](_build(s, leaves) for s in struct[1])
    return _unconst(struct)


def _unconst(struct: tuple) -> Any:
    """Inverse of :func:`_const`."""
    kind = struct[0]
    if kind == "c":
        return struct[2]
    if kind in ("tuple", "list"):
        items = [_unconst(s) for s in struct[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "slice":
        return slice(*(_unconst(s) for s in struct[1:]))
    return {k: _unconst(v) for k, v in struct[1]}


def tensor_meta(t: torch.Tensor) -> tuple:
    """Everything about a meta tensor that an op's result or autograd's saves can depend on."""
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad,
            t.grad_fn is None, t._base is not None, _storage_key(t)[1])


def input_signature(values: list[Any], state_keys: set) -> tuple[tuple, list[torch.Tensor]]:
    """Metadata of a layer's input values, with storage sharing among them and with model state."""
    leaves: list[torch.Tensor] = []
    structs = tuple(_flatten(v, leaves) for v in values)
    first: dict[Any, int] = {}
    metas = []
    for i, t in enumerate(leaves):
        key = _storage_key(t)[0]
        metas.append((tensor_meta(t), first.setdefault(key, i), key in state_keys))
    return (structs, tuple(metas)), leaves


# --------------------------------------------------------------------------- records


@dataclass
class LayerRecord:
    """What a fully measured layer leaves for its twins, in layer-local terms.

    ``events[i]`` are node i's save attempts as (kind, what, bytes, producer
    index): kind "lse" (a direct entry), "state" (never counted), "ext" (what =
    index of the input tensor leaf whose storage it was) or "int" (what = the
    storage, created inside the layer). ``results[i]`` describe node i's value
    at the end of the layer as (structure, leaves); a leaf is (tensor_meta,
    "int", storage, producer index) or (tensor_meta, "ext", input leaf index).
    """

    signature: tuple
    stats: list[NodeStats]
    events: list[list[tuple]]
    results: dict[int, tuple[tuple, list[tuple]]] = field(default_factory=dict)


def make_record(signature: tuple, nodes: list[fx.Node], inputs: list[torch.Tensor], meter: Any) -> LayerRecord:
    """Turn a measured layer's raw save events and live values into a :class:`LayerRecord`.

    Raises NotReplayable when a save touched a storage that existed before the
    layer without being one of its inputs (hidden state shared across layers).
    """
    local = {n: i for i, n in enumerate(nodes)}
    ext = {}
    for j, t in enumerate(inputs):
        ext.setdefault(_storage_key(t)[0], j)
    events: list[list[tuple]] = []
    for n in nodes:
        mine = []
        for key, nbytes, prod in meter.events.get(n, ()):
            if key is None:
                mine.append(("lse", None, nbytes, None))
            elif key in meter.state_keys:
                mine.append(("state", None, nbytes, None))
            elif key in ext:
                mine.append(("ext", ext[key], nbytes, None))
            elif prod in local:
                mine.append(("int", key, nbytes, local[prod]))
            else:
                raise NotReplayable("a save reached a storage from outside the layer's inputs")
        events.append(mine)
    record = LayerRecord(signature, [meter.stats[n] for n in nodes], events)
    for i, n in enumerate(nodes):
        if n in meter.env:
            try:
                record.results[i] = _describe(meter.env[n], ext, local, meter)
            except NotReplayable:
                pass
    return record


def _describe(value: Any, ext: dict, local: dict, meter: Any) -> tuple[tuple, list[tuple]]:
    leaves: list[torch.Tensor] = []
    struct = _flatten(value, leaves)
    descs = []
    for t in leaves:
        key = _storage_key(t)[0]
        if key in ext:
            descs.append((tensor_meta(t), "ext", ext[key]))
        elif key in meter.state_keys or meter.producer.get(key) not in local:
            raise NotReplayable("value shares storage with model state or outside tensors")
        else:
            descs.append((tensor_meta(t), "int", key, local[meter.producer[key]]))
    return struct, descs


# --------------------------------------------------------------------------- replay


class _Fabricator:
    """Builds meta tensors for a replayed layer's outgoing values, one storage per measured one."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.inputs = inputs
        self.owners: dict[Any, torch.Tensor] = {}  # measured storage -> tensor owning the new one

    def leaf(self, desc: tuple, group: list[tuple]) -> torch.Tensor:
        meta = desc[0]
        shape, stride, offset, dtype, requires_grad, is_leaf, is_view, _ = meta
        if desc[1] == "ext":
            base = self.inputs[desc[2]]
            t = base if tensor_meta(base) == meta else base.as_strided(shape, stride, offset)
        else:
            owner = self.owners.get(desc[2])
            if owner is None:
                owner = self.owners[desc[2]] = _new_owner([d[0] for d in group])
            t = owner if tensor_meta(owner) == meta else owner.as_strided(shape, stride, offset)
        if tensor_meta(t) != meta:
            raise NotReplayable("cannot rebuild an output's metadata")
        return t


def _new_owner(metas: list[tuple]) -> torch.Tensor:
    """A fresh storage for one measured storage: the non-view tensor on it, or a flat base for views."""
    plain = [m for m in metas if not m[6]]
    shape, stride, _, dtype, requires_grad, is_leaf, _, nbytes = plain[0] if plain else metas[0]
    if not plain:
        shape, stride = (nbytes // dtype.itemsize,), (1,)
        requires_grad = any(m[4] for m in metas)
        is_leaf = not requires_grad
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
    return t if is_leaf else t.clone()


def replay(record: LayerRecord, nodes: list[fx.Node], inputs: list[torch.Tensor], meter: Any) -> dict[fx.Node, Any]:
    """Replay a twin of ``record``: set its node stats on ``meter``; return the values used later.

    Everything that can fail (NotReplayable, a torch error) happens before the
    meter is touched, so the caller can fall back to executing the layer.
    """
    members = set(nodes)
    needed = [i for i, n in enumerate(nodes) if any(u not in members for u in n.users)]
    if any(i not in record.results for i in needed):
        raise NotReplayable("the measured layer did not keep a value this one passes on")
    groups: dict[Any, list[tuple]] = {}
    for i in needed:
        for d in record.results[i][1]:
            if d[1] == "int":
                groups.setdefault(d[2], []).append(d)
    fab = _Fabricator(inputs)
    values = {}
    for i in needed:
        struct, descs = record.results[i]
        values[nodes[i]] = _build(struct, iter([fab.leaf(d, groups.get(d[2], [])) for d in descs]))
    # commit: the new storages exist from here on, produced by the mapped nodes
    new_keys: dict[Any, Any] = {}
    for i in needed:
        for d, t in zip(record.results[i][1], _leaves(values[nodes[i]])):
            if d[1] == "int" and d[2] not in new_keys:
                new_keys[d[2]] = key = _storage_key(t)[0]
                meter.producer.setdefault(key, nodes[d[3]])
                meter.keep.append(t)
    token = object()
    for i, n in enumerate(nodes):
        meter.stats[n] = _replay_stats(record, i, n, nodes, inputs, new_keys, token, meter)
    return values


def stack_paths(node: fx.Node) -> tuple[str, ...]:
    """The module paths of a node's ``nn_module_stack``, outermost first, without repeats."""
    stack = node.meta.get("nn_module_stack") or {}
    paths: list[str] = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        path = path.split("@")[0]
        if path and path not in paths:
            paths.append(path)
    return tuple(paths)


def _leaves(value: Any) -> list[torch.Tensor]:
    leaves: list[torch.Tensor] = []
    _flatten(value, leaves)
    return leaves


def _replay_stats(record: LayerRecord, i: int, node: fx.Node, nodes: list[fx.Node], inputs: list[torch.Tensor],
                  new_keys: dict, token: object, meter: Any) -> NodeStats:
    """Node i's measured stats, with each save re-decided against the run's dedup state."""
    st = replace(record.stats[i], paths=stack_paths(node), saved=[])
    for kind, what, nbytes, prod in record.events[i]:
        if kind == "lse":
            st.saved.append((nbytes, node))
            continue
        if kind == "state":
            continue
        if kind == "ext":
            key = _storage_key(inputs[what])[0]
            producer = meter.producer.get(key, node)
        else:
            key = new_keys.get(what, (token, what))
            producer = nodes[prod]
        if key in meter.state_keys or key in meter.seen:
            continue
        meter.seen.add(key)
        st.saved.append((nbytes, producer))
    return st


__all__ = ["LayerRecord", "NotReplayable", "input_signature", "make_record", "replay", "static_signature"]
