"""Compute time of a layer call from its FLOPs.

time = flops / (peak · η(work)), η(work) = η_max · work / (work + work_½):
large layer calls reach the device's fitted ``matmul_efficiency`` (η_max);
calls doing ``half_efficiency_flops`` of work reach half of it, which is why
tiny microbatches or thin tensor-parallel shards do not speed up for free.
"""

from __future__ import annotations

from .hardware import DeviceSpec

BACKWARD_FLOPS_FACTOR = 2.0  # backward = grad wrt inputs + grad wrt weights (2× forward)


def efficiency(work_flops: float, device: DeviceSpec) -> float:
    if work_flops <= 0:
        return device.matmul_efficiency
    half = device.half_efficiency_flops
    return device.matmul_efficiency * work_flops / (work_flops + half)


def compute_time_s(flops: float, device: DeviceSpec, dtype: str) -> float:
    """Time of one layer call doing ``flops`` FLOPs (the call's size sets its efficiency)."""
    if flops <= 0:
        return 0.0
    return flops / (device.peak_flops(dtype) * efficiency(flops, device))
