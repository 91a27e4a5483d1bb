"""Cases for :mod:`distributed`: batch-coupled layers (issue 41 item 4) trained on 2 ranks against one process
that runs the same splits (:mod:`autopar.tools.reference`, what ``verify`` runs).

A Switch-style capacity MoE that drops tokens (capacity factor 1 × top-1 < 8 experts) under dp=2 with two
microbatches (capacity per dp rank's microbatch, the default), and the same with ep=2, tests/zoo.py's ResNet
at pp=2 over four microbatches (BatchNorm per microbatch), at ZeRO-3 over dp=2 pinned ``batch_coupled=split``
(each rank its own statistics, as plain data parallelism) and at ZeRO-3 over dp=2 exact (statistics over the
dp group). Each reports its distance from the same-split reference (the bar) and from one process on the whole
batch (which the splits must actually change, or the case proves nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import moe_cases
import torch
import torch.nn as nn
import zoo
from equivalence_cases import SGD, Spec, _batches, _max_rel, from_rank0, plan_for, run_parallel, run_reference

from autopar.runtime import default_loss
from autopar.tools.reference import reference_groups, train_reference


def switch_dropping8() -> tuple[nn.Module, tuple]:
    return moe_cases.GShardGPT(**{**moe_cases.GSHARD, "num_experts": 8}, top_k=1, capacity_factor=1.0), \
        (torch.zeros(2, 16, dtype=torch.long),)


def resnet() -> tuple[nn.Module, tuple]:
    return zoo.ResNetSmall(zoo.CLASSES), (torch.zeros(2, 3, 16, 16),)


PP1 = ("pp=1", "recompute=none", "tp=1")
SPECS: dict[str, Spec] = {
    "switch_dp2_mb2": Spec(switch_dropping8, PP1 + ("dp=2", "zero=0", "microbatches=2", "ep=1"), 8),
    # the same under ep=2: each rank dispatches its own microbatch with its own capacity, as under dp alone
    "switch_ep2_mb2": Spec(switch_dropping8, PP1 + ("dp=2", "zero=0", "microbatches=2", "ep=2"), 8),
    "resnet_pp2_mb4": Spec(resnet, ("pp=2", "dp=1", "tp=1", "microbatches=4", "recompute=none"), 8,
                           classes=zoo.CLASSES),
    "resnet_dp2_split": Spec(resnet, PP1 + ("dp=2", "zero=3", "microbatches=1", "batch_coupled=split"), 8,
                             classes=zoo.CLASSES),
    "resnet_dp2_exact": Spec(resnet, PP1 + ("dp=2", "zero=3", "microbatches=1", "batch_coupled=exact"), 8,
                             classes=zoo.CLASSES),
}


def same_splits(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = plan_for(spec, world_size)
        got = run_parallel(spec, plan, graph, lambda p: torch.optim.SGD(p, **SGD))

        def references() -> tuple[dict, dict]:
            torch.manual_seed(0)
            model, inputs = spec.build()
            batches = _batches(spec, inputs, model)
            split = train_reference(model, batches, spec.loss or default_loss,
                                    torch.optim.SGD(model.parameters(), **SGD), plan, graph)
            return split, run_reference(spec, lambda p: torch.optim.SGD(p, **SGD))
        ref, whole = from_rank0(references)
        cut = reference_groups(plan, graph)
        return {"mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp], "ep": plan.mesh.ep,
                "microbatches": plan.microbatches,
                "splits": len(cut) if cut else 1, "notes": list(plan.notes),
                "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
                "grad_rel": _max_rel(got["grads"], ref["grads"]),
                "param_rel": _max_rel(got["params"], ref["params"]),
                "whole_grad_rel": _max_rel(got["grads"], whole["grads"])}
    return case


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: same_splits(v) for k, v in SPECS.items()}
