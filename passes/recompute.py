"""Recompute: activation checkpointing of the layers the contract says are recomputed, fully or selectively.

Takes a part of the model and the modules to checkpoint with their kind
(:meth:`autopar.contract.Layout.recompute_kinds`: the plan's ``recompute``
layers that can run it); returns their paths. ``full`` checkpoints the module
with the composable ``checkpoint``; ``selective`` passes it a ``context_fn``
from ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` whose
policy keeps the outputs of the matmul-class ops
(:data:`autopar.cost_models.compute.MATMUL_OPS`, the list capture prices by)
and recomputes everything else; ``alternate_mm`` passes torchtitan's op-level
policy (fused attention's outputs and every other ``mm`` output kept). What stays true: parameter FQNs and
state-dict keys are unchanged (the composable API installs hooks on the module
instead of wrapping it, unlike ``checkpoint_wrapper``), and the numbers are the
same — only what autograd keeps between forward and backward changes.

A block the plan runs under torch.compile (``plan.training.compiled``) is
checkpointed by :func:`checkpoint_forward` instead: its ``forward`` becomes a
call of ``torch.utils.checkpoint.checkpoint`` (non-reentrant, the same
``context_fn``) around the module's own forward, which the compiled runtime
then compiles (:mod:`autopar.runtime.compiled`), as torchtitan compiles a
block after wrapping it for activation checkpointing: dynamo traces the
checkpoint as a region and AOTAutograd's partitioner keeps only what the
policy saves. The composable hooks cannot stay around a compiled forward: a
selective policy's caching mode outside the compiled region sees the
compiled kernels' outputs mutated and fails in backward. A block compiled
around an eager exchange (``autopar.contract_compile.compiled_break``: the ring under
cp, the experts' dispatch under ep) is checkpointed the same way here, in full
only, and the compiled runtime then inverts the nesting: it compiles the
module's own forward (``__wrapped__``) and keeps this checkpoint eager around
the compiled callable, whose backward reruns the compiled forward (dynamo
cannot break inside a checkpoint it traces).

Layers without a module of their own (glue between modules, or the root)
cannot be checkpointed without an FX rewrite, so the contract never lets the
planner price them as recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch.nn as nn

from autopar.choice import Recompute
from autopar.contract import plan_layout
from autopar.cost_models.compute import FUSED_ATTENTION_OPS, MATMUL_OPS
from autopar.graph import LayerGraph
from autopar.plan import Plan


def recompute_paths(graph: LayerGraph, plan: Plan) -> list[str]:
    """Module paths of the layers the plan checkpoints (the contract's, every stage)."""
    return plan_layout(graph, plan).recompute_paths(graph)


def keep_matmul_outputs(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective policy: save what a matmul-class op returns, recompute any other op."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func._schema.name in MATMUL_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def alternate_context() -> tuple[Any, Any]:
    """torchtitan's op-level policy for one checkpointed call: keep fused attention's outputs and
    every other ``aten::mm`` output (the 1st, 3rd, …, counted apart in forward and in the
    recomputation, so both make the same choices), recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        name = func._schema.name
        if name == "aten::mm":
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in FUSED_ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def selective_context() -> tuple[Any, Any]:
    """A fresh (forward, recompute) context pair for one checkpointed call (composable
    ``checkpoint``'s ``context_fn``): the cache of kept outputs lives in the pair."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(keep_matmul_outputs)


# set on a module whose forward :func:`checkpoint_forward` replaced: its kind
CHECKPOINTED_FORWARD = "_autopar_checkpointed_forward"


def checkpointed(fn: Callable[..., Any], kind: Recompute) -> Callable[..., Any]:
    """``fn`` under ``torch.utils.checkpoint.checkpoint``, non-reentrant, with ``kind``'s policy: the
    form torch.compile traces as one checkpointed region. ``fn`` stays reachable as ``__wrapped__``
    (a tensor-parallel block is traced without the checkpoint, which then wraps the traced graph)."""
    from torch.utils.checkpoint import checkpoint

    policy = {Recompute.SELECTIVE: selective_context, Recompute.ALTERNATE_MM: alternate_context}.get(kind)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if policy is None:
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=policy, **kwargs)

    forward.__wrapped__ = fn  # type: ignore[attr-defined]
    return forward


def checkpoint_forward(module: nn.Module, kind: Recompute) -> None:
    """Replace ``module.forward`` (in place) with :func:`checkpointed` of it."""
    module.forward = checkpointed(module.forward, kind)  # type: ignore[method-assign]
    setattr(module, CHECKPOINTED_FORWARD, kind)


def checkpoint_modules(part: nn.Module, paths: list[str],
                       kinds: Mapping[str, Recompute] | None = None,
                       compiled: Collection[str] = ()) -> list[str]:
    """Checkpoint each module of ``paths`` in ``part`` in place (non-reentrant), selectively where
    ``kinds`` says so (default: full); returns ``paths``. Those in ``compiled`` (the blocks that
    will run under torch.compile) get :func:`checkpoint_forward`, the rest the composable hooks.

    Requires: run before FSDP (``fully_shard``), after tensor parallelism.
    """
    from torch.distributed._composable import checkpoint

    for path in paths:
        kind = (kinds or {}).get(path, Recompute.FULL)
        module = part.get_submodule(path)
        if path in compiled:
            checkpoint_forward(module, kind)
        elif kind is Recompute.SELECTIVE:
            checkpoint(module, context_fn=selective_context)
        elif kind is Recompute.ALTERNATE_MM:
            checkpoint(module, context_fn=alternate_context)
        else:
            checkpoint(module)
    return paths


def apply_recompute(model: nn.Module, graph: LayerGraph, plan: Plan) -> list[str]:
    """Checkpoint every module the plan recomputes, as it says (a one-part model); returns their paths."""
    kinds = plan_layout(graph, plan).recompute_kinds(graph)
    return checkpoint_modules(model, list(kinds), kinds)
