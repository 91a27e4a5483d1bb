"""Cost models: hardware and its presets, compute, communication, memory and pipeline schedules.

Pure functions of numbers and hardware specs; they know nothing of the solver
or the captured model, so they can be tested against public figures alone.
"""

from .communication import Collective, GroupPlacement, collective_time_s, p2p_time_s, place_group
from .compute import compute_time_s, efficiency
from .hardware import ClusterError, ClusterSpec, CostModelError, DeviceSpec, LinkSpec
from .memory import PRECISIONS, Precision, model_state_bytes, precision
from .pipeline import Schedule, ScheduleKind, bubble_fraction, in_flight, step_time_multiplier
from .presets import PRESETS, load_cluster

__all__ = [
    "PRECISIONS", "PRESETS", "ClusterError", "ClusterSpec", "Collective", "CostModelError",
    "DeviceSpec", "GroupPlacement", "LinkSpec", "Precision", "Schedule", "ScheduleKind",
    "bubble_fraction", "collective_time_s", "compute_time_s", "efficiency", "in_flight",
    "load_cluster", "model_state_bytes", "p2p_time_s", "place_group", "precision",
    "step_time_multiplier",
]
