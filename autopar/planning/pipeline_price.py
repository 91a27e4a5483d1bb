"""The pipeline schedule's terms of the step and the memory: w in m·T + w·(S − T), and microbatches in flight.

GPipe, 1F1B and interleaved 1F1B: w = 1/v with v chunks per rank (Narayanan et al. 2021). The
split-backward schedules (``interleaved_zb``, ``zbv``, ``dualpipev``: :mod:`autopar.cost_models.pipeline`)
are simulated on torch's own actions (:mod:`autopar.cost_models.schedule_sim`) with the plan's ratio
T_F : T_B : T_W, summed over the layers as each is priced under its first choice:

    T_F = Σ forward,   T_W = Σ weight_share · backward,   T_B = Σ (forward + backward + recompute) − T_F − T_W

A layer's W is its weight gradients' GEMMs, dW = Xᵀ·dY: one GEMM of its forward's FLOPs for every
forward GEMM against a weight (capture's records whose rows grow with the tokens; a batched
activation × activation GEMM, attention by hand, has none), so its share of the backward is those
GEMMs' forward FLOPs over twice the layer's forward FLOPs (backward does twice the forward's work);
a layer without records: half its backward if it has parameters. The recomputed forward runs in B
(the input backward unpacks the checkpoint).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from autopar.cost_models import schedule_sim
from autopar.graph import Layer, OpKind, SampleDim

PriceTable = Any  # planning.pricing.PriceTable, which imports this module


def weight_share(layer: Layer) -> float:
    """The share of ``layer``'s backward that is its weight gradients (see the module docstring)."""
    if not layer.param_count:
        return 0.0
    if not layer.ops or layer.flops_per_sample <= 0:
        return 0.5
    weights = sum(op.gemm_flops_per_sample() for op in layer.ops
                  if op.kind is OpKind.GEMM and op.per_sample is SampleDim.M)
    return min(0.5, weights / (2 * layer.flops_per_sample))


def phase_times(table: PriceTable) -> tuple[float, float, float]:
    """(T_F, T_B, T_W) of one microbatch through every layer, each under its first choice."""
    f = b = w = 0.0
    for layer, row in zip(table.graph, table.prices):
        price = row[0]
        backward = price.compute_mb_s - price.forward_mb_s
        f += price.forward_mb_s
        w += weight_share(layer) * backward
        b += backward - weight_share(layer) * backward
    return f, b, w


def bubble_weight(table: PriceTable) -> Fraction:
    """w in step = m·T + w·(S − T) (``planning.pricing``'s step model) for the table's schedule."""
    c = table.config
    if c.mesh.pp <= 1:
        return Fraction(0)
    if not c.schedule.split_backward:
        return Fraction(1, c.schedule.chunks)
    return schedule_sim.bubble_weight(c.schedule, c.mesh.pp, c.microbatches, *phase_times(table))
