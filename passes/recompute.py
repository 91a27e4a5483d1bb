"""Recompute: activation checkpointing of the layers the contract says are recomputed, fully or selectively.

Takes a part of the model and the modules to checkpoint with their kind
(:meth:`autopar.contract.Layout.recompute_kinds`: the plan's ``recompute``
layers that can run it); returns their paths. ``full`` checkpoints the module
with the composable ``checkpoint``; ``selective`` passes it a ``context_fn``
from ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` whose
policy keeps the outputs of the matmul-class ops
(:data:`autopar.cost_models.compute.MATMUL_OPS`, the list capture prices by)
and recomputes everything else. What stays true: parameter FQNs and
state-dict keys are unchanged (the composable API installs hooks on the module
instead of wrapping it, unlike ``checkpoint_wrapper``), and the numbers are the
same — only what autograd keeps between forward and backward changes.

Layers without a module of their own (glue between modules, or the root)
cannot be checkpointed without an FX rewrite, so the contract never lets the
planner price them as recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from autopar.cost_models.compute import MATMUL_OPS

from autopar.contract import plan_layout
from autopar.graph import LayerGraph
from autopar.plan import Plan, Recompute


def recompute_paths(graph: LayerGraph, plan: Plan) -> list[str]:
    """Module paths of the layers the plan checkpoints (the contract's, every stage)."""
    return plan_layout(graph, plan).recompute_paths(graph)


def keep_matmul_outputs(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective policy: save what a matmul-class op returns, recompute any other op."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func._schema.name in MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """A fresh (forward, recompute) context pair for one checkpointed call (composable
    ``checkpoint``'s ``context_fn``): the cache of kept outputs lives in the pair."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(keep_matmul_outputs)


def checkpoint_modules(part: nn.Module, paths: list[str],
                       kinds: Mapping[str, Recompute] | None = None) -> list[str]:
    """Checkpoint each module of ``paths`` in ``part`` in place (non-reentrant), selectively where
    ``kinds`` says so (default: full); returns ``paths``.

    Requires: run before FSDP (``fully_shard``), after tensor parallelism.
    """
    from torch.distributed._composable import checkpoint

    for path in paths:
        kind = (kinds or {}).get(path, Recompute.FULL)
        module = part.get_submodule(path)
        if kind is Recompute.SELECTIVE:
            checkpoint(module, context_fn=selective_context)
        else:
            checkpoint(module)
    return paths


def apply_recompute(model: nn.Module, graph: LayerGraph, plan: Plan) -> list[str]:
    """Checkpoint every module the plan recomputes, as it says (a one-part model); returns their paths."""
    kinds = plan_layout(graph, plan).recompute_kinds(graph)
    return checkpoint_modules(model, list(kinds), kinds)
