"""The contract's rules for a plan priced compiled: which blocks run under torch.compile, where a block breaks
its graph at an exchange kept eager, and which meshes the compiled runtime runs (:mod:`autopar.runtime.compiled`
lowers them; pricing, admission and the solver read them here). Torch-free."""

from __future__ import annotations

from autopar.choice import CpAttention, Recompute
from autopar.contract import tp_applies
from autopar.graph import LayerGraph
from autopar.mesh import Mesh
from autopar.plan import Plan


def compiled_block_paths(graph: LayerGraph, plan: Plan) -> list[str]:
    """Module paths of the plan's repeated blocks (:attr:`LayerGraph.blocks`), in order: what a
    compiled plan (``training.compiled``) runs under torch.compile one by one, and pricing prices
    compiled; a recomputed one is checkpointed inside its compiled forward (``passes/recompute.py``).
    Empty for a plan priced eager."""
    if not plan.training.compiled:
        return []
    names = {lp.name for lp in plan.layers}
    return [layer.module_path for layer, block in zip(graph.layers, graph.blocks) if block and layer.name in names]


def compiled_break(graph: LayerGraph, i: int, mesh: Mesh, cp_attention: CpAttention) -> bool:
    """Whether layer ``i``, compiled, breaks its graph at an exchange kept eager (``torch.compiler.disable``):
    an MoE block's experts dispatch under ep (``passes/expert_dispatch.py``: data-dependent split sizes), any
    block's ring attention under cp (``passes/context_ring.py``: torch's private ring does not trace). Dynamo
    cannot break inside the checkpoint it traces (a checkpointed block with such a break ran wholly eagerly:
    no graph compiled over 10 steps), so such a block recomputes only in full (:data:`BREAK_RECOMPUTES`), with
    the nesting inverted: its module compiled around the break, and an eager non-reentrant checkpoint around
    that, whose backward reruns the compiled forward (``runtime/compiled.py``). A selective or alternate-mm
    policy would not see the ops inside the compiled code: not offered, and refused in a compiled plan."""
    if not graph.blocks[i]:
        return False
    return (mesh.ep > 1 and bool(graph[i].moe)) or (mesh.cp > 1 and cp_attention is CpAttention.RING)


# what a block compiled around an eager exchange (:func:`compiled_break`) recomputes: none, or in full
BREAK_RECOMPUTES = frozenset({Recompute.NONE, Recompute.FULL})


def compile_refusal(graph: LayerGraph | None, mesh: Mesh) -> str | None:
    """Why the compiled runtime (torch.compile per block, :mod:`autopar.runtime.compiled`) does not
    run ``mesh`` on ``graph`` (None when it does). A compiled search skips such meshes, and a
    compiled plan with one is refused before the first collective.

    Runs: DDP, FSDP2/ZeRO-1/2/3, full and selective recompute, pipelines (GPipe, 1F1B,
    interleaved 1F1B, also beside dp and ZeRO-3: each block compiled inside the stage module the
    pipeline lowering built, which calls the model's own block module), and tensor parallelism with
    and without sequence parallelism, also beside dp and ZeRO-3 (each block traced once under the
    sharding rules, :mod:`autopar.runtime.sharded_trace`; a recomputed one with its checkpoint
    around the traced graph), also inside a pipeline's stages (tp beside pp); expert parallelism
    (ep = 2 beside dp = 2: the block compiles around the experts' exchange, kept eager) and context
    parallelism (cp = 2: K/V all-gather and Ulysses traced whole, the ring kept eager inside the
    compiled block; such a block recomputes in full only, its checkpoint eager around the compiled
    module, :func:`compiled_break`); proven by
    ``tests/compile_cases.py`` against one eager process. Not: ep or cp beside tp, pp or each other
    (not run compiled), and a pipeline of a model whose export graph lost its layers' module calls
    (:func:`tp_applies`): its stages call no block module, so nothing would run compiled that was
    priced compiled. ``graph`` None: axes only."""
    why: list[str] = []
    axes = (("tp", mesh.tp), ("pp", mesh.pp), ("ep", mesh.ep), ("cp", mesh.cp))
    for name, axis, degree in (("expert parallelism", "ep", mesh.ep), ("context parallelism", "cp", mesh.cp)):
        beside = [f"{a}={n}" for a, n in axes if n > 1 and a != axis]
        if degree > 1 and beside:
            why.append(f"{name} ({axis}={degree}) beside {' and '.join(beside)}")
    if graph is not None and mesh.pp > 1 and not tp_applies(graph, mesh.pp):
        why.append(f"a pipeline (pp={mesh.pp}) of {graph.model_name}, whose stages are single ATen graphs "
                   "(torch.export could not keep its layers' module calls) that call no block module")
    return " and ".join(why) or None
