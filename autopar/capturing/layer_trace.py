"""Layer tracing for the pipeline stage split: trace a model keeping each layer one module call.

:func:`trace_layers` traces as :func:`~autopar.capturing.trace.capture` does and
names each node's layer; when FX can, it re-traces with every layer module a
leaf so that the hooks passes install on those modules run. Used by
:mod:`autopar.passes.stage_split`.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.capturing import moe
from autopar.capturing.export_layers import export_with_layer_calls
from autopar.capturing.hf_masks import eager_causal_masks
from autopar.capturing.layers import group_layers, layer_names
from autopar.capturing.torch_transformer import as_training_runs
from autopar.capturing.tracing import _leaf_trace, _split_inputs, _trace
from autopar.errors import CaptureError

# --------------------------------------------------------------------------- tracing for lowering


class _LayerTracer(fx.Tracer):
    """``symbolic_trace`` with each layer's module kept as one ``call_module`` node (a leaf)."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def _node_layers(gm: fx.GraphModule, model: nn.Module) -> dict[str, str]:
    runs, _ = group_layers(gm, model)
    return {n.name: name for name, (_, nodes) in zip(layer_names(runs), runs) for n in nodes}


def _trace_layer_leaves(model: nn.Module, node_layer: dict[str, str], gm: fx.GraphModule) -> fx.GraphModule | None:
    """Re-trace with every layer module a leaf; None unless that yields the same layers in order."""
    runs, _ = group_layers(gm, model)
    leaves = {key for key, _ in runs if key is not None}
    try:
        tracer = _LayerTracer(leaves)
        graph = tracer.trace(model)
        leaf_gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception:  # noqa: BLE001 - e.g. a tuple output unpacked by Python code: keep the full trace
        return None
    if list(dict.fromkeys(_node_layers(leaf_gm, model).values())) != list(dict.fromkeys(node_layer.values())):
        return None
    return leaf_gm


def _export_layers(model: nn.Module, args: tuple, kwargs: dict, node_layer: dict[str, str],
                   gm: fx.GraphModule) -> fx.GraphModule | None:
    """The export graph with each layer one call of its module, when the layers come out the same."""
    runs, _ = group_layers(gm, model)
    out = export_with_layer_calls(model, args, kwargs, {key for key, _ in runs if key})
    if out is None or list(dict.fromkeys(_node_layers(out, model).values())) != \
            list(dict.fromkeys(node_layer.values())):
        return None
    return out


def trace_layers(model: nn.Module, example_inputs: tuple | dict | torch.Tensor,
                 ) -> tuple[fx.GraphModule, dict[str, str], str]:
    """Trace ``model`` as :func:`~autopar.capturing.capture` does and name each compute node's layer.

    Returns ``(gm, node_layer, tracer)``: ``node_layer`` maps a node's name to
    the name of its layer (the names :func:`capture` gives; placeholders,
    ``get_attr`` and output nodes have none). ``tracer`` is ``"fx-layers"``
    when the model is FX-traceable with each layer's module kept as one
    ``call_module`` node — the layer modules are then called, so hooks that
    passes install on them (tensor parallel, checkpoint, FSDP) run — else
    ``"export-layers"`` (a ``torch.export`` graph calling each layer's module, see
    :mod:`autopar.capturing.export_layers`), ``"fx"`` (layers inlined) or ``"export"`` (ATen graph of
    ``torch.export``). The graph module holds the model's own parameter
    objects under their original FQNs. Raises :class:`~autopar.errors.CaptureError` like capture.
    """
    args, kwargs = _split_inputs(model, example_inputs)
    # Hugging Face's causal masks, and torch.nn's transformer modules, as capture traced them
    with eager_causal_masks(model, args, kwargs), as_training_runs(model):
        return _trace_layers(model, args, kwargs)


def _trace_layers(model: nn.Module, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, dict[str, str], str]:
    try:
        gm, _, tracer = _trace(model, args, kwargs)
    except CaptureError as first:
        # MoE blocks whose routing loop no tracer follows: kept whole, as capture's stand-in trace keeps them
        blocks = {b.path for b in moe.find_blocks(model)}
        if not blocks:
            raise
        try:
            gm, _, tracer = _leaf_trace(model, args, kwargs, blocks)
        except CaptureError:
            raise first from None
    node_layer = _node_layers(gm, model)
    if tracer == "fx":
        leaf_gm = _trace_layer_leaves(model, node_layer, gm)
        if leaf_gm is not None:
            return leaf_gm, _node_layers(leaf_gm, model), "fx-layers"
    if tracer == "export":
        layer_gm = _export_layers(model, args, kwargs, node_layer, gm)
        if layer_gm is not None:
            return layer_gm, _node_layers(layer_gm, model), "export-layers"
    return gm, node_layer, tracer


__all__ = ["trace_layers"]
