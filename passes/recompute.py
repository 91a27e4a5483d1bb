"""Recompute: activation checkpointing of the layers a plan marks ``recompute``.

Takes the model, the LayerGraph and the Plan; returns the module paths
checkpointed. What stays true: parameter FQNs and state-dict keys are
unchanged (the composable ``checkpoint`` API installs hooks on the module
instead of wrapping it, unlike ``checkpoint_wrapper``), and the numbers are
the same — only what autograd keeps between forward and backward changes.

Layers without a module of their own (glue between modules, or the root) are
not checkpointed: that would need an FX rewrite.
"""

from __future__ import annotations

import torch.nn as nn

from autopar.graph import LayerGraph
from autopar.plan import Plan


def recompute_paths(graph: LayerGraph, plan: Plan) -> list[str]:
    """Module paths of the layers the plan checkpoints (those that have a module)."""
    by_name = {l.name: l for l in graph}
    paths = []
    for lp in plan.layers:
        layer = by_name.get(lp.name)
        if lp.recompute and layer is not None and layer.module_path:
            if layer.module_path not in paths:
                paths.append(layer.module_path)
    return paths


def apply_recompute(model: nn.Module, graph: LayerGraph, plan: Plan) -> list[str]:
    """Checkpoint each ``recompute`` layer's module in place (non-reentrant); returns their paths.

    Requires: run before FSDP (``fully_shard``), after tensor parallelism.
    """
    from torch.distributed._composable import checkpoint

    paths = recompute_paths(graph, plan)
    for path in paths:
        checkpoint(model.get_submodule(path))
    return paths
