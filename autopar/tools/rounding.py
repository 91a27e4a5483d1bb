"""Rounding or a real difference: ``verify``'s float64 re-run of a plan that missed the fp32 bar.

Some models amplify fp32 rounding past ``verify``'s bar (1e-5) with no semantic difference at all. A
BatchNorm's backward subtracts the batch mean of its incoming gradient, so the rounding of sums whose
order the plan changes (a convolution's weight gradient summed over each rank's half of the batch and
then over the ranks, instead of over the whole batch at once) reaches the small remainder that the
cancellation leaves; three SGD-with-momentum steps carry it into the parameters. Measured on
tests/zoo.py's ResNet at width 64 (batch 32, 32×32 images, ZeRO-3 over dp=2): 4.8e-6 in the first
step's gradients, 3.4e-4 in ``bn1.bias`` after 3 steps, in fp32; the same run in float64 agrees to 4e-15.

So when the fp32 comparison misses its bar, ``verify`` runs the plan again with the model, its example
inputs and batches in float64 (the same initial weights: built as in fp32, then cast) on both sides.
Its bar is :data:`FLOAT64_TOLERANCE`, far below the fp32 bar: a semantic difference (statistics over the
wrong rows, a gradient missing a rank's share, a running statistic moved twice) shows as much in float64
as in fp32, and a computation run at fp32 precision or lower on one side only (a lost cast) shows as
≥ 1e-7, so only rounding at float64's own scale passes. Then the result is ``SAME_IN_FLOAT64``: the
plan computes one process's function, and fp32 rounds it differently, by an amount printed beside how far
one process's own fp32 run is from float64. A model that computes in fp32 on purpose (a router's
``.float()``) keeps fp32's rounding in both float64 runs and stays ``DIFFERENT``, said so.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

# float64's unit roundoff is 1.1e-16: amplified as fp32's was above (≈3e3×) it stays under 1e-12, while
# any fp32 step on one side only leaves ≥ 1e-7 (fp32's roundoff 6e-8)
FLOAT64_TOLERANCE = 1e-10


def to_float64(tree: Any) -> Any:
    """Every floating tensor of ``tree`` (inputs, targets, nested tuples and dicts) in float64."""
    return tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    tree)


def model_to_float64(model: nn.Module) -> nn.Module:
    """``model``'s floating parameters and buffers in float64, and float64 the default dtype of this
    process, so that tensors its forward makes (``torch.zeros(...)``, a mask) are float64 too."""
    torch.set_default_dtype(torch.float64)
    return model.to(torch.float64)


def rechecks(report: Any, tolerance: float, plan: Any) -> bool:
    """Whether an fp32 run missed the fp32 bar, so that a float64 re-run can tell rounding from a
    difference (a float8 plan rounds by design: its own bar)."""
    return not report.ok(tolerance) and plan.training.float8 is None


def verdict(fp32: Any, float64: Any, tolerance: float) -> str:
    """``SAME``, ``SAME_IN_FLOAT64`` or ``DIFFERENT``: the fp32 comparison, and the float64 re-run's
    (None where it did not run)."""
    if fp32.ok(tolerance):
        return "SAME"
    return "SAME_IN_FLOAT64" if float64 is not None and float64.ok(FLOAT64_TOLERANCE) else "DIFFERENT"


def lines(fp32: Any, float64: Any, tolerance: float) -> list[str]:
    """The float64 re-run's lines after the fp32 result (none where it did not run)."""
    if float64 is None:
        return []
    own = f"; one process's own fp32 run is {float64.fp32_ref_rel:.3g} from float64" \
        if float64.fp32_ref_rel is not None else ""
    head = (f"float64 re-run (model, inputs and batches in float64 on both sides): first-step gradients "
            f"{float64.grads.rel:.3g} ({float64.grads.worst}), parameters after {float64.steps} steps "
            f"{float64.params.rel:.3g} ({float64.params.worst}), loss {float64.loss_rel:.3g}{own}")
    if float64.ok(FLOAT64_TOLERANCE):
        return [head, f"OK: SAME as one process in float64, {float64.max_rel:.3g} <= {FLOAT64_TOLERANCE:g}: "
                      f"the {fp32.max_rel:.3g} in fp32 is rounding, not the plan (SAME_IN_FLOAT64)"]
    return [head, f"DIFFERENT in float64 too: {float64.max_rel:.3g} > {FLOAT64_TOLERANCE:g}, so not fp32's "
                  "rounding (or the model computes in fp32 or lower on purpose)"]


__all__ = ["FLOAT64_TOLERANCE", "lines", "model_to_float64", "rechecks", "to_float64", "verdict"]
