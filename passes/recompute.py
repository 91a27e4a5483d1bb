"""Recompute: activation checkpointing of the layers the contract says are recomputed.

Takes a part of the model and the module paths to checkpoint
(:meth:`autopar.contract.Layout.recompute_paths`: the plan's ``recompute``
layers that have a module of their own); returns those paths. What stays
true: parameter FQNs and state-dict keys are unchanged (the composable
``checkpoint`` API installs hooks on the module instead of wrapping it,
unlike ``checkpoint_wrapper``), and the numbers are the same — only what
autograd keeps between forward and backward changes.

Layers without a module of their own (glue between modules, or the root)
cannot be checkpointed without an FX rewrite, so the contract never lets the
planner price them as recomputed.
"""

from __future__ import annotations

import torch.nn as nn

from autopar.contract import plan_layout
from autopar.graph import LayerGraph
from autopar.plan import Plan


def recompute_paths(graph: LayerGraph, plan: Plan) -> list[str]:
    """Module paths of the layers the plan checkpoints (the contract's, every stage)."""
    return plan_layout(graph, plan).recompute_paths(graph)


def checkpoint_modules(part: nn.Module, paths: list[str]) -> list[str]:
    """Checkpoint each module of ``paths`` in ``part`` in place (non-reentrant); returns ``paths``.

    Requires: run before FSDP (``fully_shard``), after tensor parallelism.
    """
    from torch.distributed._composable import checkpoint

    for path in paths:
        checkpoint(part.get_submodule(path))
    return paths


def apply_recompute(model: nn.Module, graph: LayerGraph, plan: Plan) -> list[str]:
    """Checkpoint every module the plan recomputes (a one-part model); returns their paths."""
    return checkpoint_modules(model, recompute_paths(graph, plan))
