"""Cases for :mod:`distributed`: every model of the zoo at every pipeline cut the planner offers at pp=2.

One case per model (``cut_matrix_cases:<model>``): rank 0 captures the model once and lists the
cuts capture offers; for each, a plan with the stages pinned at that cut trains 3 SGD-with-momentum
steps on 2 ranks and is compared with one process (trained once per model: the reference does not
depend on the cut). The result maps each cut (the layer it follows) to the worst relative
difference of first-step gradients, parameters after 3 steps and the first loss, or to the error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from cut_cases import PP2, gemma3_tied, lstm, stage_pins
from equivalence_cases import SGD, Spec, _max_rel, from_rank0, run_parallel, run_reference
from zoo import BEYOND, CLASSES, MODELS_ALL, OWN_LOSS, build

import autopar
from autopar.graph import LayerGraph
from autopar.plan import Plan

EXTRA: dict[str, Callable[[], tuple]] = {"lstm_lm": lstm, "hf_gemma3_tied": gemma3_tied}


def _builder(name: str) -> Callable[[], tuple]:
    return EXTRA[name] if name in EXTRA else (lambda: build(name))


def every_cut(name: str) -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        classes = CLASSES if name == "hf_vit" else None
        # the zoo's models beyond token ids in, logits out: batches as verify makes them; BatchNorm
        # normalises over one microbatch, so those run one (one device's whole-batch statistics)
        pins = PP2
        if name == "resnet_bn":
            pins = tuple("microbatches=1" if p.startswith("microbatches=") else
                         "schedule=gpipe" if p.startswith("schedule=") else p for p in PP2)
        base = Spec(_builder(name), pins, 4, classes=classes, synthetic=name in BEYOND or name in OWN_LOSS,
                    loss=OWN_LOSS[name][2] if name in OWN_LOSS else None)

        def plans() -> list[tuple[str, str, str]]:
            torch.manual_seed(0)
            model, inputs = base.build()
            graph = autopar.capture(model, inputs)
            names = [l.name for l in graph]
            out = []
            for layer in graph.layers[:-1]:
                if layer.can_cut_after:
                    pins = list(base.pins) + list(stage_pins(names, layer.name))
                    plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=4, pins=pins)
                    out.append((layer.name, plan.to_json(), graph.to_dict()))
            return out

        ref = from_rank0(lambda: run_reference(base, lambda p: torch.optim.SGD(p, **SGD)))
        results: dict[str, Any] = {}
        for cut, plan_json, graph_dict in from_rank0(plans):
            try:
                got = run_parallel(base, Plan.from_json(plan_json), LayerGraph.from_dict(graph_dict),
                                   lambda p: torch.optim.SGD(p, **SGD))
                loss = abs(got["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
                results[cut] = max(loss, _max_rel(got["grads"], ref["grads"])[0],
                                   _max_rel(got["params"], ref["params"])[0])
            except Exception as exc:  # noqa: BLE001 - one cut's failure is a cell of the table
                results[cut] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        return {"cuts": results}

    return case


MODELS = [*MODELS_ALL, *EXTRA]
CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {m: every_cut(m) for m in MODELS}
