"""Compute time of a layer call from its FLOPs.

time = flops / (peak · η(flops)),  η(flops) = η_max · flops / (flops + flops_½)

which is the same as time = (flops + flops_½) / (peak · η_max): large calls
reach the device's fitted ``matmul_efficiency`` (η_max), and every call pays a
fixed overhead worth ``half_efficiency_flops`` of work (kernel launches, thin
matmuls), which is why tiny microbatches or thin tensor-parallel shards do not
speed up for free.
"""

from __future__ import annotations

from .hardware import DeviceSpec

BACKWARD_FLOPS_FACTOR = 2.0  # backward = grad wrt inputs + grad wrt weights (2× forward)


def efficiency(work_flops: float, device: DeviceSpec) -> float:
    """Fraction of peak reached by one call doing ``work_flops``."""
    if work_flops <= 0:
        return 0.0
    return device.matmul_efficiency * work_flops / (work_flops + device.half_efficiency_flops)


def compute_time_s(flops: float, device: DeviceSpec, dtype: str) -> float:
    """Time of one layer call doing ``flops`` FLOPs (no FLOPs, no time)."""
    if flops <= 0:
        return 0.0
    return (flops + device.half_efficiency_flops) / (device.peak_flops(dtype) * device.matmul_efficiency)


# ATen ops whose outputs selective activation checkpointing keeps (torch's schema names, as a
# TorchDispatchMode sees them): the matmul class — GEMMs, convolutions and fused attention,
# whose work grows faster than the bytes they write, so recomputing them costs far more than
# keeping them (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models"; torchtitan's op-level SAC save list). Capture prices by this list and
# the recompute pass lowers by it, so what is priced is what runs. CompositeImplicit ops
# (linear, matmul) never reach a dispatch mode: they arrive as mm/addmm/bmm.
MATMUL_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
    "aten::convolution",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
})


# The fused attention kernels among MATMUL_OPS: torchtitan's op-level SAC keeps their outputs and every
# other ``aten::mm`` output, recomputing the rest (torchtitan/distributed/activation_checkpoint.py,
# ``_save_list`` and "Saves output of all compute ops, except every second mm").
FUSED_ATTENTION_OPS = frozenset(op for op in MATMUL_OPS if "attention" in op)


def memory_bound_time_s(nbytes: float, device: DeviceSpec) -> float:
    """Time of memory-bound work (elementwise ops, norms, softmax) reading and writing ``nbytes``:
    bytes over the device's memory bandwidth (the roofline's bandwidth side)."""
    return max(nbytes, 0.0) / device.memory_bandwidth_bytes_s
