"""The one-process reference ``verify`` compares a plan's run with: the same batches, the same splits.

Where the plan splits batch-coupled layers (:mod:`autopar.batch_coupling`: BatchNorm per microbatch,
a capacity MoE per dp rank's microbatch), one process runs each step as those same splits, the loss
and gradients their mean, as gradient accumulation does; elsewhere each step is the whole batch.

Where the plan keeps BatchNorm exact over dp (its statistics all-reduced, ``passes/batchnorm.py``),
the reference computes them with the same formula and adds the ranks' sums in the same order
(:func:`autopar.passes.batchnorm.summed_in_parts`), not with torch's BatchNorm kernel: a BatchNorm's
backward subtracts the batch mean of its gradient, so the rounding of its sums (each ~1e-7 of its
terms) reaches the gradients that cancellation leaves small. Measured on tests/zoo.py's ResNet at
width 64 (batch 32, 32×32 images, one process, first step): torch's fp32 kernel is 3.7e-4 from float64
(bn1.weight's gradient), these two-pass sums 5.0e-6; so one process on the kernel and ranks on the sums
differ by the kernel's rounding, not the plan's (issue 41 saw 2.38e-5 on a ResNet at ZeRO-3 over dp=2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autopar.inputs import call


def reference_groups(plan: Any, graph: Any) -> list | None:
    """The splits one process runs each step as (:func:`autopar.batch_coupling.groups`): the plan's
    batch-coupled layers each saw a split, so the reference runs the same splits; None: the whole batch."""
    from autopar import batch_coupling

    return batch_coupling.groups(graph, plan.mesh.dp, plan.microbatches, plan.training.batch_coupled)


def train_reference(model: nn.Module, batches: list, loss_fn: Any, optimizer: torch.optim.Optimizer,
                    plan: Any = None, graph: Any = None) -> dict[str, Any]:
    """``model`` trained in one process on ``batches``, each step whole or as the plan's splits (the
    module docstring); its losses, first-step gradients and final parameters."""
    from autopar.batch_coupling import synced, take
    from autopar.passes.batchnorm import summed_in_parts

    cut = reference_groups(plan, graph) if plan is not None and graph is not None else None
    if plan is not None and plan.mesh.dp > 1 and synced(plan.training.batch_coupled):
        summed_in_parts(model, plan.mesh.dp)  # BatchNorm's sums added as the dp all-reduce adds them
    losses, grads = [], {}
    for k, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        if cut is None:
            loss = loss_fn(call(model, x), y)
            loss.backward()
        else:
            size, dp, m = plan.training.global_batch, plan.mesh.dp, plan.microbatches
            loss = torch.zeros((), dtype=torch.float64)
            for group in cut:
                part = loss_fn(call(model, take(x, group, dp, m, size)), take(y, group, dp, m, size))
                (part / len(cut)).backward()
                loss += part.detach().double() / len(cut)
        if k == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


__all__ = ["reference_groups", "train_reference"]
