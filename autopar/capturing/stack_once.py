"""Export a stack of repeated blocks once per kind of block, not once per block.

``torch.export`` of a Hugging Face model costs about 0.15 s per decoder
block, on meta as on real tensors: Llama 3 70B's 80 blocks took ~20 s of a
plan. A stack of blocks whose modules are identical up to their index (same
classes, simple attributes, parameter shapes; the block's entry in the
config's per-block lists, such as ``layer_types``, counted as part of it) traces to the same ATen ops in the same
order, so the model is exported with the shortest *prefix* of its stack in
which every kind of block appears after the first block (the first reads the
embedding, the later ones the block before them: those are the pattern), and
the graph of the whole stack is then written out from it: block ``j`` is a copy of the
prefix's block of its kind, its parameters renamed ``stack.j.*``, its input
the previous block's output, everything else (rotary tables, masks) the
same values the prefix's blocks read.

A prefix keeps every block's index, so code that looks a block's kind up by
``layer_idx`` and code that enumerates the stack agree. Anything outside the
expected shape — a block with hooks, several values passed between blocks, a
block reading one two back, model code between blocks — returns None and the
caller exports the whole model as before. The result is then the graph the
whole export would give, node names aside: ``tests/capturing`` checks that
capture's layers, edges and costs are the same both ways.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.capturing import twins
from autopar.capturing.export_layers import export_with_layer_calls, no_stack_traces
from autopar.capturing.layers import expanded_paths, group_layers, is_compute
from autopar.stacks import Unsupported as _Unsupported
from autopar.stacks import block_kind, find_stack, stack_kinds


@contextlib.contextmanager
def _prefix(model: nn.Module, path: str, stack: nn.ModuleList, k: int):
    """The model with only the first ``k`` blocks of its stack (and its config saying so)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    config = getattr(model, "config", None)
    saved = {a: getattr(config, a) for a in ("num_hidden_layers", "layer_types")
             if config is not None and hasattr(config, a)}
    setattr(parent, name, nn.ModuleList(list(stack)[:k]))
    try:
        if "num_hidden_layers" in saved and saved["num_hidden_layers"] == len(stack):
            config.num_hidden_layers = k
        if isinstance(saved.get("layer_types"), (list, tuple)) and len(saved["layer_types"]) == len(stack):
            config.layer_types = list(saved["layer_types"])[:k]
        yield
    finally:
        setattr(parent, name, stack)
        for attr, value in saved.items():
            setattr(config, attr, value)


def _in_block(node: fx.Node, path: str) -> int | None:
    """The stack index of the block whose module ran ``node``, else None."""
    pat = re.compile(re.escape(path) + r"\.(\d+)(?:[.@]|$)")
    for p in twins.stack_paths(node):
        m = pat.match(p)
        if m:
            return int(m.group(1))
    return None


def _rename(text: str, path: str, src: int, dst: int) -> str:
    """``text`` with a leading ``path.src`` (followed by ``.``, ``@`` or nothing) made ``path.dst``
    (string tests, not a regular expression: it runs ~40,000 times on Llama 3 70B)."""
    old = f"{path}.{src}"
    if text.startswith(old) and (len(text) == len(old) or text[len(old)] in ".@"):
        return f"{path}.{dst}{text[len(old):]}"
    return text


def _write_stack(gm: fx.GraphModule, path: str, kinds: list[int], k: int, is_compute: Any) -> fx.Graph:
    """The whole stack's graph from the prefix's: see the module docstring."""
    graph = gm.graph
    block_of: dict[fx.Node, int] = {}
    nodes: list[list[fx.Node]] = [[] for _ in range(k)]
    order = [n for n in graph.nodes if is_compute(n)]
    for n in order:
        b = _in_block(n, path)
        if b is not None:
            block_of[n] = b
            nodes[b].append(n)
    if any(not ns for ns in nodes):
        raise _Unsupported("a block of the prefix ran no op")
    first = order.index(nodes[0][0])
    last = order.index(nodes[-1][-1])
    if any(n not in block_of for n in order[first:last + 1]) or \
            any(block_of[a] > block_of[b] for a, b in zip(order[first:last], order[first + 1:last + 1])):
        raise _Unsupported("model code runs between the blocks")
    outs: list[fx.Node] = []
    for b, ns in enumerate(nodes):
        leaving = [n for n in ns if any(block_of.get(u) != b for u in n.users)]
        if len(leaving) != 1:
            raise _Unsupported(f"block {b} passes on {len(leaving)} values")
        outs.append(leaving[0])
    rep = {kinds[b]: b for b in range(1, k)}  # each kind's block that reads the block before it
    prefix = re.compile(re.escape(path) + r"\.(\d+)\.")

    new = fx.Graph()
    new._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    full_outs: list[fx.Node] = []

    def glue_arg(a: fx.Node) -> fx.Node:
        if a in block_of:
            if a is not outs[-1]:
                raise _Unsupported("model code after the stack reads inside a block")
            return full_outs[-1]
        return env[a]

    def emit(j: int, r: int) -> None:
        local: dict[fx.Node, fx.Node] = {}
        attrs: dict[str, fx.Node] = {}

        def arg(a: fx.Node) -> fx.Node:
            if a in local:
                return local[a]
            if a in block_of:
                if r >= 1 and a is outs[r - 1]:
                    return full_outs[j - 1]
                raise _Unsupported("a block reads a value of an earlier block other than its output")
            if a.op == "get_attr" and prefix.match(str(a.target)):
                if not str(a.target).startswith(f"{path}.{r}."):
                    raise _Unsupported("a block reads another block's parameters")
                target = _rename(str(a.target), path, r, j)
                if target not in attrs:
                    attrs[target] = new.get_attr(target)
                return attrs[target]
            return env[a]

        for n in nodes[r]:
            c = new.node_copy(n, arg)
            stack = n.meta.get("nn_module_stack")
            if stack:
                c.meta["nn_module_stack"] = {
                    _rename(str(key), path, r, j): ((_rename(v[0], path, r, j), *v[1:]) if isinstance(v, tuple)
                                                    else _rename(str(v), path, r, j))
                    for key, v in stack.items()}
            local[n] = c
        full_outs.append(local[outs[r]])

    for n in graph.nodes:
        if n.op == "get_attr" and prefix.match(str(n.target)):
            continue  # a block's parameter: each written block gets its own
        if n in block_of:
            if n is nodes[0][0]:
                for j in range(len(kinds)):
                    emit(j, j if j < k else rep[kinds[j]])
            continue
        env[n] = new.node_copy(n, glue_arg)
    return new


def _owner(model: nn.Module, gm: fx.GraphModule, target: str) -> Any:
    """What a ``get_attr``/``call_module`` target names: the model's own object, else the export's."""
    for root in (model, gm):
        obj: Any = root
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise _Unsupported(f"no {target} on the model or its export")


def _layer_candidates(model: nn.Module) -> set[str]:
    """Modules that may be layers: the children of the modules capture opens up (its layer keys)."""
    expanded = expanded_paths(model)
    return {p for p, _ in model.named_modules() if p and p not in expanded and p.rpartition(".")[0] in expanded}


def export_once_per_kind(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule | None:
    """The whole model's export graph, exporting one prefix of its block stack (None: not possible).

    Its parameters are the model's own; ``meta["layer_calls"]`` says whether
    the export keeps each of capture's layers one module call (answered for
    the prefix, which holds for the whole when its blocks are equal).
    """
    def layer_keys(g: fx.GraphModule) -> list[str | None]:
        return [key for key, _ in group_layers(g, model)[0]]

    found = find_stack(model)
    if found is None:
        return None
    path, stack = found
    try:
        kinds = stack_kinds(model, stack)
        # the shortest prefix where every kind has a block after the first one
        k = max(2, 1 + max(next((i for i in range(1, len(kinds)) if kinds[i] == kd), 0) for kd in set(kinds)))
        if k >= len(stack):
            return None
        with _prefix(model, path, stack, k):
            # one export serves both: its graph, and (unflattened) whether each layer stays one call
            candidates = _layer_candidates(model)
            with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings(), no_stack_traces():
                warnings.simplefilter("ignore")
                ep = torch.export.export(model, args, kwargs=kwargs, strict=False,
                                         preserve_module_call_signature=tuple(sorted(candidates)))
                gm_k = ep.module()
            keys = {key for key in layer_keys(gm_k) if key}
            calls = export_with_layer_calls(model, args, kwargs, keys, ep if keys <= candidates else None)
            graph = _write_stack(gm_k, path, kinds, k, is_compute)
        targets = {str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
        # lazy: capture interprets the graph node by node and never calls its forward, so the Python
        # code of an 80-block graph (~0.3 s to generate) is written only if something does
        gm = _LazyGraphModule({t: _owner(model, gm_k, t) for t in targets}, graph, type(model).__name__)
        expected = [f"{path}.{j}" for j in range(len(stack))]
        if [key for key in dict.fromkeys(layer_keys(gm)) if key and key.startswith(path + ".")] != expected:
            return None
        gm.meta["layer_calls"] = calls is not None
        return gm
    except Exception:  # noqa: BLE001 - _Unsupported or an export failure: the caller exports the whole model
        return None


__all__ = ["block_kind", "export_once_per_kind"]
