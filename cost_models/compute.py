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
