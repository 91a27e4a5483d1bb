"""Cases for :mod:`distributed`: torch.compile per block (inductor's CPU backend) against one eager process.

Each case solves a compiled plan on rank 0 (``solve(..., compiled=True)``; sent to every rank),
trains the tiny GPT with ``autopar.compile(plan=...)`` — its blocks under ``torch.compile`` —
for :data:`STEPS` SGD-with-momentum steps, compares losses, first-step gradients and the
parameters after 3 steps with the unsharded eager model (equivalence_cases' reference), and
counts dynamo's graphs after each step (:data:`torch._dynamo.utils.counters`), from a reset
cache: the first step compiles one graph the two blocks share, later steps compile none. Both
cases run the same block shapes, so the second finds inductor's on-disk cache warm (test time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from equivalence_cases import (
    PP1,
    SGD,
    Spec,
    _max_rel,
    from_rank0,
    gpt_tiny,
    make_batch,
    run_reference,
)

import autopar
from autopar.graph import LayerGraph
from autopar.plan import Plan

STEPS = 5  # the first 3 compared with eager; the last 2 only count recompiles
COMPARED = 3


def _compiled_plan(spec: Spec, world_size: int) -> tuple[Plan, LayerGraph]:
    def make() -> tuple[str, dict]:
        torch.manual_seed(0)
        model, inputs = spec.build()
        graph = autopar.capture(model, inputs)
        plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", pins=list(spec.pins),
                             global_batch=spec.global_batch, compiled=True)
        return plan.to_json(), graph.to_dict()

    text, graph = from_rank0(make)
    return Plan.from_json(text), LayerGraph.from_dict(graph)


def compiled_equivalence(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        plan, graph = _compiled_plan(spec, world_size)
        torch._dynamo.reset()  # graphs counted from an empty cache, whatever ran before on this worker
        counters.clear()  # reset() leaves dynamo's counters as they were

        torch.manual_seed(0)
        model, inputs = spec.build()
        batches = [make_batch(inputs, model, spec.global_batch, seed=1 + k) for k in range(STEPS)]
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph,
                             optimizer=lambda p: torch.optim.SGD(p, **SGD))
        losses, graphs, grads, params = [], [], {}, {}
        for k, (x, y) in enumerate(batches):
            losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
            graphs.append(int(counters["stats"]["unique_graphs"]))
            if k == 0:
                grads = pm.full_grads()
            if k == COMPARED - 1:
                params = {k: v.clone() for k, v in pm.state_dict(full=True).items()}  # not views of live weights
        ref = from_rank0(lambda: run_reference(spec, lambda p: torch.optim.SGD(p, **SGD)))
        out: dict[str, Any] = {
            "compiled": list(pm.compiled), "plan_compiled": plan.training.compiled, "graphs": graphs,
            "mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp], "zero": sorted({l.choice.zero for l in plan.layers}),
            "losses": losses[:COMPARED], "ref_losses": ref["losses"],
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
        }
        out["grad_rel"], out["grad_worst"] = _max_rel(grads, ref["grads"])
        out["param_rel"], out["param_worst"] = _max_rel(params, ref["params"])
        from torch._dynamo.utils import guard_failures

        out["graph_breaks"] = {k: int(v) for k, v in counters["graph_break"].items()}
        out["guard_failures"] = [str(r)[:300] for reasons in guard_failures.values() for r in reasons]
        dist.barrier()
        torch._dynamo.reset()  # the next case on this worker compiles afresh
        counters.clear()
        return out

    return case


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "ddp": compiled_equivalence(Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=0", "microbatches=1"), 4)),
    "zero3": compiled_equivalence(Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4)),
}
