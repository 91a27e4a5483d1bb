"""A layer call's compute time, forward and backward, op by op where capture recorded its ops.

Per microbatch of b samples, under a tensor-parallel style on tp ranks
(``cost_models.compute`` has each op's formula):

    forward  = Σ_GEMM count · t(m, n, k, batch) + Σ_attention count · t_attn(b·F / share)
               + t_mem(b · bytes / share, kernels) + rest
    backward = Σ_GEMM count · (t(m, k, n, batch) + t(k, n, m, batch))     dX = dY·Wᵀ, dW = Xᵀ·dY
               + Σ_attention count · t_attn_bwd(b·F / share) + t_mem(2 · b · bytes / share, 2 · kernels)
               + 2 · rest

Under torch.compile (a compiled block), the memory-bound term's bytes and kernels are scaled by
:data:`~autopar.cost_models.compute.COMPILED_MEMORY_BOUND_FRACTION` (fusion); GEMMs and attention
are priced as eager (inductor calls the same library kernels for them).

with each GEMM's shape after the style's sharding (:meth:`autopar.graph.OpRecord.gemm_shape`),
bytes rescaled from the captured dtype to the plan's (``act_scale``), and ``rest`` the layer's
counted FLOPs that no record covers, priced by the FLOPs model without its per-call overhead.
A layer without records, or a device without an ``op_model``, is priced by the FLOPs model
(:func:`autopar.cost_models.compute.compute_time_s`), as before per-op records existed.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.compute import (
    BACKWARD_FLOPS_FACTOR,
    COMPILED_MEMORY_BOUND_FRACTION,
    MEMORY_BOUND_BACKWARD_FACTOR,
    attention_time_s,
    compute_time_s,
    gemm_time_s,
    memory_bound_time_s,
)
from autopar.cost_models.hardware import DeviceSpec
from autopar.graph import Layer, OpKind, SampleDim


@dataclass(frozen=True)
class LayerCompute:
    """Forward and backward compute time of one layer call, seconds."""

    fwd_s: float
    bwd_s: float


def style_flops_per_sample(layer: Layer, style: str | None, tp: int) -> float:
    """The layer's forward FLOPs per sample on one rank under ``style`` (the style's sharded share split)."""
    if style is None or tp <= 1:
        return layer.flops_per_sample
    return layer.flops_per_sample - layer.tp_style(style).sharded_flops_per_sample * (1 - 1 / tp)


def op_flops_per_sample(layer: Layer, style: str | None, tp: int) -> float:
    """The forward FLOPs per sample one rank's recorded GEMM and attention kernels do under ``style``."""
    total = 0.0
    for op in layer.ops:
        if op.kind is OpKind.GEMM:
            total += op.gemm_flops_per_sample() * op.split(style, tp)
        elif op.kind is OpKind.ATTENTION:
            total += op.count * op.flops_per_sample * op.split(style, tp)
    return total


def layer_compute(layer: Layer, style: str | None, tp: int, microbatch: int, device: DeviceSpec,
                  dtype: str, act_scale: float = 1.0, cp: int = 1, *, compiled: bool = False) -> LayerCompute:
    """Forward and backward time of ``layer`` for one microbatch (module docstring), on one of ``cp``
    ranks that split the sequence: every op does 1/cp of the tokens; attention its S/cp queries
    against all S keys with an explicit causal mask (``passes/context_parallel.py``), so 1/cp of the
    full S × S work and no causal skip. ``compiled``: its memory-bound ops fused by torch.compile
    (:data:`COMPILED_MEMORY_BOUND_FRACTION`)."""
    flops = style_flops_per_sample(layer, style, tp)
    b = microbatch
    if device.op_model is None or not layer.ops:
        return LayerCompute(compute_time_s(b * flops / cp, device, dtype),
                            compute_time_s(BACKWARD_FLOPS_FACTOR * b * flops / cp, device, dtype))
    fwd = bwd = 0.0
    fused = COMPILED_MEMORY_BOUND_FRACTION if compiled else 1.0
    for op in layer.ops:
        if op.kind is OpKind.GEMM:
            m, n, k, batch = op.gemm_shape(b, style, tp)
            m, batch = (m / cp, batch) if op.per_sample is SampleDim.M else (m, batch / cp)
            fwd += op.count * gemm_time_s(m, n, k, batch, device, dtype)
            bwd += op.count * (gemm_time_s(m, k, n, batch, device, dtype)
                               + gemm_time_s(k, n, m, batch, device, dtype))
        elif op.kind is OpKind.ATTENTION:
            work = b * op.flops_per_sample * op.split(style, tp) / cp
            causal = op.causal and cp == 1
            fwd += op.count * attention_time_s(work, device, dtype, causal=causal)
            bwd += op.count * attention_time_s(work, device, dtype, backward=True, causal=causal)
        else:
            nbytes = b * op.bytes_per_sample * op.split(style, tp) * act_scale * fused / cp
            fwd += memory_bound_time_s(nbytes, device, op.count * fused)
            bwd += memory_bound_time_s(MEMORY_BOUND_BACKWARD_FACTOR * nbytes, device,
                                       MEMORY_BOUND_BACKWARD_FACTOR * op.count * fused)
    rest = max(0.0, flops - op_flops_per_sample(layer, style, tp)) * b / cp
    rate = device.peak_flops(dtype) * device.matmul_efficiency
    return LayerCompute(fwd + rest / rate, bwd + BACKWARD_FLOPS_FACTOR * rest / rate)
