"""Cases for :mod:`distributed`: each expert layout of :mod:`moe_layouts` trained under ZeRO-3 over dp=2
(ep=1) and under ep=2 beside ZeRO-3 over dp=2 (2 microbatches), against one process.

One case per model, both plans in it: rank 0 captures the model once and solves both plans (the
ep plan pins ep=2, so the planner itself must offer it: a layout ep cannot split is refused there,
at plan time, and the case reports that refusal instead of training). Each plan trains 3 SGD-with-momentum
steps on the same global batch as the one-process reference each rank runs itself; every rank reports its
losses, first-step full gradients and final full parameters against it (``equivalence_cases``' bars).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equivalence_cases as ec
import torch
import torch.distributed as dist
from equivalence_cases import Spec
from moe_layouts import LAYOUT_MODELS

import autopar
from autopar.errors import AutoparError
from autopar.graph import LayerGraph
from autopar.plan import Plan

PLANS = {
    "zero3": ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=2", "microbatches=1", "ep=1"),
    "ep2": ("pp=1", "tp=1", "recompute=none", "zero=3", "dp=2", "microbatches=2", "ep=2"),
}


# gpt-oss also at pp=2 cut after its rotary embedding, whose (cos, sin) tuple crosses the cut (it crashed with
# "'tuple' object has no attribute 'contiguous'" while HF's grouped_mm failed the boundary's fake run)
EXTRA = {"gpt_oss": {"pp2_rotary": ("pp=2", "dp=1", "tp=1", "microbatches=2", "schedule=1f1b", "recompute=none",
                                    "model.rotary_emb:stage=0", "model.layers.0:stage=1")}}


def _plans(spec: Spec, world_size: int, more: dict[str, tuple[str, ...]]) -> tuple[LayerGraph, dict[str, Plan | str]]:
    """Rank 0 captures once and solves each plan (a refusal kept as its one line); every rank gets them."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model, inputs = spec.build()
        graph = autopar.capture(model, inputs)
        plans: dict[str, str] = {}
        for kind, pins in (PLANS | more).items():
            try:
                plans[kind] = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", pins=list(pins),
                                            global_batch=spec.global_batch).to_json()
            except AutoparError as exc:
                plans[kind] = f"refused: {exc}"
        box[0] = (graph.to_dict(), plans)
    dist.broadcast_object_list(box, src=0)
    graph = LayerGraph.from_dict(box[0][0])
    return graph, {k: v if v.startswith("refused: ") else Plan.from_json(v) for k, v in box[0][1].items()}


def layouts_case(name: str) -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        spec = Spec(LAYOUT_MODELS[name], (), 4)
        graph, plans = _plans(spec, world_size, EXTRA.get(name, {}))
        opt = lambda p: torch.optim.SGD(p, **ec.SGD)  # noqa: E731
        ref = ec.run_reference(spec, opt)
        out: dict[str, Any] = {"facts": [(m.weights, m.call.name, m.ep_refusal) for layer in graph
                                         for m in layer.moe]}
        for kind, plan in plans.items():
            if isinstance(plan, str):
                out[kind] = {"refused": plan}
                continue
            got = ec.run_parallel(spec, plan, graph, opt)
            grad_rel, grad_worst = ec._max_rel(got["grads"], ref["grads"])
            param_rel, param_worst = ec._max_rel(got["params"], ref["params"])
            out[kind] = {"mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.ep, plan.mesh.tp],
                         "stages": [lp.stage for lp in plan.layers],
                         "zero": sorted({lp.choice.zero for lp in plan.layers}),
                         "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
                         "grad_rel": grad_rel, "grad_worst": grad_worst, "param_rel": param_rel,
                         "param_worst": param_worst, "local_param_bytes": got["local_param_bytes"],
                         "param_bytes": ref["param_bytes"]}
        return out

    return case


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {name: layouts_case(name) for name in LAYOUT_MODELS}


# further plans of the same models, each an equivalence case of its own (run on demand: W=2 for pp2,
# W=4 for ep2tp2, ep=2 beside tp=2 over dp=2 at ZeRO-3, and pp2ep2, ep=2 inside the stages of pp=2)
MORE = {"pp2": (("pp=2", "dp=1", "tp=1", "microbatches=2", "schedule=1f1b", "recompute=none"), 1),
        "ep2tp2": (("pp=1", "dp=2", "tp=2", "zero=3", "microbatches=1", "recompute=none"), 2),
        "pp2ep2": (("pp=2", "dp=2", "tp=1", "zero=0", "microbatches=2", "schedule=1f1b", "recompute=none",
                    "ep=2"), 1)}
CASES |= {f"{name}/{kind}": ec.equivalence(Spec(LAYOUT_MODELS[name], pins, 4, ep=ep))
          for name in LAYOUT_MODELS for kind, (pins, ep) in MORE.items()}


def _compiled(name: str) -> Callable[[int, int], dict[str, Any]]:
    """ep=2 over dp=2 with the blocks compiled (torch.compile per block, the exchange eager inside)."""
    from compile_cases import compiled_equivalence

    return compiled_equivalence(Spec(LAYOUT_MODELS[name], ("pp=1", "dp=2", "tp=1", "zero=0", "microbatches=1",
                                                           "recompute=none"), 4, ep=2))


CASES |= {f"{name}/ep2_compiled": (lambda n: lambda rank, ws: _compiled(n)(rank, ws))(name) for name in LAYOUT_MODELS}

# gpt-oss at pp=2 at each cut the planner offers on its 6 layers (embedding, rotary, 2 blocks, norm, head)
_PP2 = ("pp=2", "dp=1", "tp=1", "microbatches=2", "schedule=1f1b", "recompute=none")
_CUTS = {"embed": ("model.embed_tokens:stage=0", "model.rotary_emb:stage=1"),
         "rotary": ("model.rotary_emb:stage=0", "model.layers.0:stage=1"),
         "last": ("model.layers.1:stage=0", "model.norm:stage=1")}
CASES |= {f"gpt_oss/pp2_{cut}": ec.equivalence(Spec(LAYOUT_MODELS["gpt_oss"], _PP2 + pins, 4))
          for cut, pins in _CUTS.items()}
