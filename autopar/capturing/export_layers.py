"""torch.export with each layer kept one call of the model's own module.

A model that FX cannot trace (Hugging Face's) is captured with
``torch.export``, whose graph inlines every module into ATen ops: hooks on a
layer's module (tensor parallelism's sharding rules, checkpoint, FSDP) would
never run inside a pipeline stage cut from it. Exported again with the
layers' call signatures preserved and unflattened, the graph calls each
layer module; :func:`export_with_layer_calls` inlines everything else back
into one graph and puts the model's own eager layer modules in place of the
exported ones, so a stage cut from it calls them — unless a layer is called
with a tensor the graph never computes (:func:`_dropped_inputs`): its call
could not be made again as traced, so the stages keep the inlined graph.
"""

from __future__ import annotations

import contextlib
import io
import operator
import warnings

import torch
import torch.fx as fx
import torch.nn as nn


@contextlib.contextmanager
def no_stack_traces():
    """Capture's exports without each node's Python stack trace (``torch.fx.config``): nothing in
    autopar reads ``meta["stack_trace"]``, and symbolizing one per traced op took ~5% of capturing
    Llama 3 70B. A torch without the switch (2.11 has none: seen on a GPU machine's image) exports as it
    always does."""
    config = getattr(fx, "config", None)
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _inline(root: nn.Module, graph: fx.Graph, keep: set[str], prefix: str = "") -> None:
    """Inline, in place, every ``call_module`` of ``graph`` (a module of ``root`` at ``prefix``)
    whose target is not in ``keep``; targets and ``get_attr`` paths become ``root``-relative."""
    for node in list(graph.nodes):
        if node.op in ("get_attr", "call_module") and prefix:
            node.target = f"{prefix}.{node.target}"
        if node.op != "call_module" or node.target in keep:
            continue
        child = root.get_submodule(node.target)
        sub = getattr(child, "graph", None)
        if not isinstance(sub, fx.Graph):
            continue
        env: dict[fx.Node, fx.Node] = {}
        placeholders = [n for n in sub.nodes if n.op == "placeholder"]
        if len(placeholders) != len(node.args) or node.kwargs:
            raise ValueError(f"cannot inline {node.target}: its call does not pass flat arguments")
        with graph.inserting_before(node):
            for ph, arg in zip(placeholders, node.args):
                env[ph] = arg  # type: ignore[assignment]
            result = None
            for n in sub.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    result = fx.map_arg(n.args[0], lambda a: env[a])
                    continue
                new = graph.node_copy(n, lambda a: env[a])
                if new.op in ("get_attr", "call_module"):
                    new.target = f"{node.target}.{n.target}"
                env[n] = new
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(result, (tuple, list)):
                user.replace_all_uses_with(result[user.args[1]])  # type: ignore[index]
                graph.erase_node(user)
        if node.users:
            if isinstance(result, fx.Node):
                node.replace_all_uses_with(result)
            else:
                raise ValueError(f"cannot inline {node.target}: its output is used whole")
        graph.erase_node(node)
        # the copied nodes may call further modules to inline: one pass over the whole graph inlines
        # them and every later node (this loop's list holds nodes that pass may erase: T5's decoder
        # was inlined twice, and its stages fell back to inlined ATen graphs)
        _inline(root, graph, keep)
        return


def _own_state(flat: nn.Module, model: nn.Module) -> None:
    """Point every parameter and buffer of ``flat`` outside the layers at the model's own object."""
    mine = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    for name, _ in [*flat.named_parameters(remove_duplicate=False), *flat.named_buffers()]:
        if name in mine:
            owner, _, attr = name.rpartition(".")
            module = flat.get_submodule(owner) if owner else flat
            if isinstance(mine[name], nn.Parameter):
                module._parameters[attr] = mine[name]
            else:
                module._buffers[attr] = mine[name]


def _dropped_inputs(ep: torch.export.ExportedProgram, layers: set[str]) -> list[str]:
    """Tensors a layer is called with that the exported graph never reads (no ATen op takes them:
    ``nn.TransformerEncoder``'s causal mask, once attention runs ``is_causal=True``). Unflattened, the
    layer's call gets None in their place, and the module called eagerly is not the call that was
    traced (its attention asks for the mask its ``is_causal`` hint needs)."""
    from torch.export.graph_signature import TensorArgument

    read = {n.name for n in ep.graph.nodes if n.users}
    return [f"{entry.fqn}: {a.name}" for entry in ep.module_call_graph
            if entry.fqn in layers and entry.signature is not None
            for a in entry.signature.inputs if isinstance(a, TensorArgument) and a.name not in read]


def export_with_layer_calls(model: nn.Module, args: tuple, kwargs: dict, layers: set[str],
                            exported: torch.export.ExportedProgram | None = None) -> fx.GraphModule | None:
    """The export graph of ``model`` with every module path in ``layers`` one ``call_module`` of the
    model's own module (its parameters the model's objects); None when torch.export cannot keep
    those call signatures. ``exported``: an export of ``model`` already preserving (at least)
    those call signatures, used instead of exporting again."""
    if not layers:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unflatten's notes on its own get_attr nodes
            ep = exported if exported is not None else torch.export.export(
                model, args, kwargs=kwargs, strict=False, preserve_module_call_signature=tuple(sorted(layers)))
            if _dropped_inputs(ep, layers):
                return None
            flat = torch.export.unflatten(ep)
        graph = flat.graph
        _inline(flat, graph, layers)
        for path in layers:
            flat.set_submodule(path, model.get_submodule(path))
        _own_state(flat, model)
        for node in graph.nodes:
            if node.op == "call_module":
                node.meta["nn_module_stack"] = {node.target: (node.target, type(model.get_submodule(node.target)))}
        graph.eliminate_dead_code()
        return fx.GraphModule(flat, graph, type(model).__name__)
    except Exception:  # noqa: BLE001 - the caller keeps the inlined export graph
        return None


__all__ = ["export_with_layer_calls"]
