"""torch.compile per block, after the parallel lowering (issue 24, first slice).

Each repeated block of the plan (:attr:`autopar.graph.LayerGraph.blocks`:
the layers of the stack, which FSDP2 also shards one by one) has its
``forward`` replaced by ``torch.compile`` of it, as torchtitan compiles per
block: the engines' hooks (DDP's gradient hooks, FSDP2's all-gather before
and reshard after each block) stay outside the compiled region and run as
they do eagerly, and blocks of one kind share one compiled graph (dynamo
treats a module's parameters as graph inputs), so a change in one block's
plan does not recompile the model.

A block the plan recomputes (full, selective or alternate-mm) is compiled
with its checkpoint inside: the recompute pass gave it a forward that calls
``torch.utils.checkpoint.checkpoint`` around the module's own
(:func:`autopar.passes.recompute.checkpoint_forward`), so dynamo traces the
checkpointed region and AOTAutograd's partitioner keeps what the policy
saves, as torchtitan compiles a block after wrapping it for activation
checkpointing. Layers that are not blocks run eagerly, with the composable
checkpoint hooks where they are recomputed.

Each block compiles whole (``fullgraph=True``), so a block priced compiled
never runs half eager behind dynamo's back. A block whose code forces a graph
break (an op or side effect dynamo cannot trace) runs eagerly instead, from
its first call on: :class:`CompiledBlock` warns once, naming the block and
the break, and :attr:`autopar.runtime.model.ParallelModel.plan`'s notes say
so; a tensor-parallel block ``make_fx`` cannot trace runs eagerly under the
sharding rules for that call signature, told the same way
(:class:`~autopar.runtime.sharded_trace.ShardedTrace`). Side effects inside
a checkpointed block (Hugging Face's ``kernels`` package sets and resets a
context variable in every wrapped forward, from transformers 5.25) are traced
once and not replayed in the backward's recompute (dynamo's
``skip_fwd_side_effects_in_bwd_under_checkpoint``, set only while a compiled
block runs); without it dynamo breaks the graph at the checkpoint and the
whole block ran eagerly, uncounted.

What runs compiled is proven for DDP and FSDP2/ZeRO-1/2/3, with and without
full and selective recompute, for pipelines (GPipe, 1F1B, interleaved
1F1B, beside dp with ZeRO-3; the project's GPT and a Hugging Face Llama): a
pipeline's stage modules call the model's own block modules (``fx-layers`` and
``export-layers`` splits), so each block is compiled where its stage calls it
and the schedule, its sends and its gradient scaling stay eager; and for tensor
parallelism with and without sequence parallelism (tp = 2, and beside dp = 2
with ZeRO-3; the GPT and Llama), with selective recompute (with sp), and
inside each stage of a pp = 2 1F1B pipeline with full recompute (the GPT; the
Llama without recompute, by hand). A tensor-parallel block's own forward runs
under the sharding rules' ``TorchFunctionMode``, which rewrites ops in Python
per call and which dynamo cannot trace (with it active, dynamo failed inside
``ShardMode.__torch_function__``, "cls_source must not be None for MRO walk",
at the mode's first ``@property``; past it lie tags set on tensors, ``id()``-keyed
books and a thread-local mode stack, not tried one by one); so the block is traced once under the mode by
``make_fx`` into a graph of local ops and custom-op collectives, and that graph
is compiled (:mod:`autopar.runtime.sharded_trace`). A recomputed
tensor-parallel block is traced without its checkpoint (``make_fx`` would
flatten it into the forward) and the checkpoint then wraps the traced graph,
so dynamo traces that checkpointed region as it does any recomputed block's.
Expert and context parallelism run compiled too (ep = 2 beside dp = 2 on a
Hugging Face Mixtral, also with full recompute under ZeRO-3; cp = 2 by K/V
all-gather and by the ring, each also with full recompute, on the GPT, Ulysses
on a Llama). All-gather and Ulysses trace whole:
dynamo traces the cp attention mode and the functional collectives. The
experts' exchange (``passes/expert_dispatch.py``: data-dependent split sizes,
which traced would recompile every step) and the ring
(``passes/context_ring.py``: torch's private ring does not trace) run under
``torch.compiler.disable``, and a plan with either compiles its blocks with
``fullgraph=False`` (:func:`breaks_at_exchanges`), each block around that one
break. Such a block is recomputed in full only, with the nesting inverted
(:func:`autopar.contract_compile.compiled_break`): dynamo cannot break inside the
checkpoint it traces (the checkpointed block ran wholly eagerly: no graph
compiled over 10 steps), so the block's own forward is compiled around the
break and an eager non-reentrant ``torch.utils.checkpoint.checkpoint`` wraps
the compiled callable; its backward reruns the compiled forward (guards hit,
no recompile: graphs flat over 10 steps) and the eager exchange with it, and
the RNG state is restored before the rerun (``preserve_rng_state``: dropout in
the compiled graphs replayed bit for bit, measured on a toy block). A
selective or alternate-mm policy cannot see the ops inside the compiled
graphs, so those kinds are neither offered nor run there.
The tests compare 3 SGD steps with eager within 1e-5 and count recompiles over 10.
:mod:`autopar.admission` (`compiled_refusals`) refuses every other lowering
(:func:`autopar.contract_compile.compile_refusal`) with a
:class:`~autopar.errors.CompileError` before the first collective: expert or
context parallelism beside tp, pp or each other, selective or alternate-mm
recompute of a block that breaks at an eager exchange, and pipelines whose stages call no
block module (an export graph without its layers' module calls;
``passes/pipeline.py`` refuses the split's own FX fallback the same way).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch.nn as nn

from autopar.contract_compile import compiled_block_paths, compiled_break
from autopar.errors import CompileError
from autopar.graph import LayerGraph
from autopar.plan import Plan

# "1": ``compile``'s torch_compile defaults to True (set by ``autopar run --compile``)
COMPILE_ENV = "AUTOPAR_TORCH_COMPILE"


def requested(torch_compile: bool | None) -> bool | None:
    """``torch_compile`` as given, else True when ``autopar run --compile`` launched this process."""
    if torch_compile is None and os.environ.get(COMPILE_ENV) == "1":
        return True
    return torch_compile


def block_paths(graph: LayerGraph, plan: Plan) -> list[str]:
    """Module paths of the plan's repeated blocks, in order: the modules compiled one by one
    (:func:`autopar.contract_compile.compiled_block_paths`; empty for a plan priced eager)."""
    return compiled_block_paths(graph, plan)


class CompiledBlock:
    """A block's ``forward`` under ``torch.compile(fullgraph=fullgraph)``, or its eager ``forward`` from the
    first graph break on (module docstring; ``fullgraph`` False only where the plan breaks blocks at an
    exchange kept eager, :func:`breaks_at_exchanges`: there a break elsewhere in the user's code runs
    that part eagerly, and no note says so). ``broken`` is the break's first line (None while compiled);
    ``on_break(path, reason)`` is told once."""

    def __init__(self, path: str, eager: Callable[..., Any], on_break: Callable[[str, str], None] | None = None,
                 fullgraph: bool = True, **options: Any) -> None:
        import torch

        self.path, self.eager, self.on_break = path, eager, on_break
        self.compiled = torch.compile(eager, fullgraph=fullgraph, **options)
        self.broken: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken is not None:
            return self.eager(*args, **kwargs)
        import torch._dynamo

        try:
            with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
                return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as exc:  # raised while tracing, before the block ran
            self.broken = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"torch.compile: block {self.path!r} runs eagerly (the plan priced it compiled): "
                      f"{self.broken}", stacklevel=2)
        if self.on_break is not None:
            self.on_break(self.path, self.broken)
        return self.eager(*args, **kwargs)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own. Dynamo keeps its cache, guards and recompile limit per code
    object; every :func:`~autopar.passes.recompute.checkpointed` wrapper shares one, and each traced
    graph is a class of its own, so without this each further trace would count as a recompile of one
    frame (and a ``fullgraph`` compile fails at the limit)."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def breaks_at_exchanges(plan: Plan) -> bool:
    """Whether the plan's blocks compile around eager exchanges (graph breaks, module docstring): the experts'
    all-to-all dispatch under ep, the ring under cp's ring attention."""
    from autopar.choice import CpAttention

    return plan.mesh.ep > 1 or (plan.mesh.cp > 1 and plan.cp_attention is CpAttention.RING)


def compile_plan_blocks(parts: list[nn.Module], graph: LayerGraph, plan: Plan,
                        on_break: Callable[[str, str], None] | None = None) -> list[str]:
    """The plan's blocks in ``parts`` compiled (:func:`compile_blocks`; none for a plan priced eager), whole
    unless the plan breaks them at an eager exchange (:func:`breaks_at_exchanges`)."""
    if not plan.training.compiled:
        return []
    broken = {layer.module_path for layer in graph
              if compiled_break(graph, layer.index, plan.mesh, plan.cp_attention)}
    return compile_blocks(parts, block_paths(graph, plan), on_break, fullgraph=not breaks_at_exchanges(plan),
                          checkpoint_outside=broken)


def compile_blocks(parts: list[nn.Module], paths: list[str], on_break: Callable[[str, str], None] | None = None,
                   fullgraph: bool = True, checkpoint_outside: Collection[str] = (), **options: Any) -> list[str]:
    """Replace each block's ``forward`` with a :class:`CompiledBlock` of it (in place; the module, its
    hooks, FQNs and state-dict keys are unchanged); returns the paths compiled. ``fullgraph`` False: the
    block may break at the exchanges kept eager (:func:`breaks_at_exchanges`). A checkpointed block of
    ``checkpoint_outside`` (one that breaks there, :func:`autopar.contract_compile.compiled_break`; full recompute
    only) keeps its checkpoint eager around the compiled forward (module docstring)."""
    from autopar.choice import Recompute
    from autopar.passes.recompute import CHECKPOINTED_FORWARD, checkpointed
    from autopar.passes.tensor_parallel import SHARDED_RUN
    from autopar.runtime.sharded_trace import ShardedTrace

    done: list[str] = []
    shared: dict = {}  # recompute kind -> a tensor-parallel block's trace -> its compiled runner (matching blocks)
    for part in parts:
        for path in paths:
            try:
                block = part.get_submodule(path)
            except AttributeError:  # not in this part
                continue
            run = getattr(block, SHARDED_RUN, None)
            if run is not None:  # tensor parallel: compile the forward as traced under the sharding rules
                # a recomputed block is traced without its checkpoint, which then wraps the traced graph inside
                # the compiled region (as a block that is not tensor parallel is compiled with its checkpoint)
                kind = getattr(block, CHECKPOINTED_FORWARD, None)
                eager = block.forward if kind is None else block.forward.__wrapped__

                def wrap(fn: Callable[..., Any], kind: Any = kind) -> Callable[..., Any]:
                    return fn if kind is None else _own_code(checkpointed(fn, kind))

                block.forward = ShardedTrace(  # type: ignore[method-assign]
                    block, eager, run, lambda gm, path=path, wrap=wrap: CompiledBlock(path, wrap(gm), on_break,
                                                                                       fullgraph, **options),
                    shared.setdefault(kind, {}), path=path, on_break=on_break, wrap=wrap)
            elif path in checkpoint_outside and (kind := getattr(block, CHECKPOINTED_FORWARD, None)) is not None:
                if kind is not Recompute.FULL:  # admission refused it before the lowering
                    raise CompileError(f"block {path!r} breaks at an eager exchange: {kind} recompute does not run "
                                       "compiled there (full does)")
                compiled = CompiledBlock(path, block.forward.__wrapped__, on_break, fullgraph, **options)
                block.forward = checkpointed(compiled, kind)  # type: ignore[method-assign]
            else:
                block.forward = CompiledBlock(path, block.forward, on_break, fullgraph,  # type: ignore[method-assign]
                                              **options)
            done.append(path)
    return done


__all__ = ["COMPILE_ENV", "CompiledBlock", "block_paths", "breaks_at_exchanges", "compile_blocks",
           "compile_plan_blocks", "requested"]
