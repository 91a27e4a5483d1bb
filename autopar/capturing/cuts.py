"""Where a pipeline may be cut: the values that would cross each cut, and whether they can be sent.

A cut after layer i is offered when every value crossing it can be carried
between pipeline stages (:mod:`autopar.capturing.boundary`): a tensor, or a
tuple, list, dict, dataclass or ``ModelOutput`` of tensors with ``None`` s
and Python scalars, whose tensors have the batch (or 1, broadcast over it) as
dim 0, so that each microbatch gets a value of its own shape. A cut is also
withdrawn where a buffer written during the step by a layer on one side is
read by a layer on the other: the reading stage's copy of that buffer is
never written on its rank, so it would read stale or uninitialised memory.
Each withdrawn cut keeps its reason (``Layer.cut_blocked_by``): the plan's
notes and a pinned stage that needs the cut say it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from autopar.sharding.detect import NodeStats

_INPUT = -1  # layer index of placeholders (values that enter the model)
Crossing = tuple[int, set[int], int, str]  # (source layer, consumer layers, bytes, why it cannot be sent or '')


def _why_not(name: str, st: NodeStats, batch: int) -> str:
    """Why the value of node ``name`` cannot cross a cut ('' when it can)."""
    if st.is_tensor:
        if st.out_first_dim in (batch, 1):
            return ""
        return (f"{name}, a tensor whose dim 0 ({st.out_first_dim}) is not the batch ({batch}): "
                "microbatches cannot split it")
    if st.unsendable:
        return f"{name}, a {st.unsendable}, which has no form as tensors to send"
    if not st.holds_tensor:
        return ""  # a constant (None, a scalar, a shape): the receiving stage rebuilds it
    bad = [d for d in st.leaf_first_dims if d not in (batch, 1)]
    if bad:
        return f"{name}, holding a tensor whose dim 0 ({bad[0]}) is not the batch ({batch})"
    return ""


def crossings(gm: fx.GraphModule, node_layer: dict[fx.Node, int], stats: dict[fx.Node, NodeStats],
              n_layers: int, batch: int) -> list[Crossing]:
    """Every value that leaves the layer (or input) that made it: (src, consumers, bytes, why unsendable).

    A tuple consumed through ``getitem`` in another layer crosses element by
    element, so each consumed element is its own value (an element nobody
    reads, like an LSTM's final state unpacked into ``_``, crosses nowhere).
    """
    items: dict[tuple[fx.Node, Any], Crossing] = {}
    for user in gm.graph.nodes:
        if user.op == "output":
            dst = n_layers
        elif user in node_layer:
            dst = node_layer[user]
        else:
            continue
        for src in user.all_input_nodes:
            if src.op == "get_attr" or (src.op != "placeholder" and src not in node_layer):
                continue
            a = node_layer.get(src, _INPUT)
            if a == dst:
                continue
            st = stats.get(src, NodeStats())
            key: tuple[fx.Node, Any] = (src, None)
            name = src.name
            if not st.is_tensor and user.target is operator.getitem and user.args[0] is src:
                if not user.users:
                    continue
                key, st, name = (src, user.args[1]), stats.get(user, NodeStats()), user.name
            prev = items.get(key)
            consumers = prev[1] if prev else set()
            consumers.add(dst)
            items[key] = (a, consumers, st.out_bytes if st.is_tensor else st.leaf_bytes, _why_not(name, st, batch))
    return list(items.values())


def layer_costs(crossings: list[Crossing], n_layers: int, names: list[str],
                ) -> tuple[list[float], list[float], list[bool], dict[tuple[int, int], float], dict[int, str]]:
    """Input bytes per layer, boundary bytes and cuttability after each layer, edges, and why a cut
    the dataflow allows is withdrawn."""
    inputs = [0.0] * n_layers
    boundary = [0.0] * n_layers
    cut_ok = [i < n_layers - 1 for i in range(n_layers)]
    edges: dict[tuple[int, int], float] = {}
    blocked: dict[int, str] = {}
    for src, consumers, nbytes, why in crossings:
        for dst in consumers:
            if dst < n_layers:
                inputs[dst] += nbytes
                if src >= 0:
                    edges[(src, dst)] = edges.get((src, dst), 0.0) + nbytes
        for i in range(max(src, 0), min(max(consumers), n_layers - 1)):
            boundary[i] += nbytes
            if why and cut_ok[i]:
                blocked[i] = f"a cut after {names[i]} would carry {why}"
            cut_ok[i] = cut_ok[i] and not why
    boundary[n_layers - 1] = 0.0
    return inputs, boundary, cut_ok, edges, blocked


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` writes its first argument in place (``x.add_(…)``, ``aten.copy_``, ``out=``)."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.arguments and schema.arguments[0].alias_info is not None:
        return bool(schema.arguments[0].alias_info.is_write)
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def block_buffer_writes(gm: fx.GraphModule, node_layer: dict[fx.Node, int], names: list[str],
                        cut_ok: list[bool], blocked: dict[int, str]) -> None:
    """Withdraw, in place, every cut between a layer writing a buffer during the step and another
    layer reading it (the reading stage's copy would never be written on its rank)."""
    by_target: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            by_target.setdefault(str(n.target), []).append(n)
    for target, attrs in by_target.items():
        users = [(a, u) for a in attrs for u in a.users if u in node_layer]
        writers = {node_layer[u] for a, u in users if _writes(u) and u.args and u.args[0] is a}
        if not writers:
            continue
        readers = {node_layer[u] for _, u in users} - writers
        for w in writers:
            for r in readers:
                for i in range(min(w, r), max(w, r)):
                    if cut_ok[i]:
                        blocked[i] = (f"a cut after {names[i]} would leave buffer {target}, written by "
                                      f"{names[w]} during the step, unwritten where {names[r]} reads it")
                    cut_ok[i] = False


__all__ = ["block_buffer_writes", "crossings", "layer_costs"]
