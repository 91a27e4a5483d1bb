"""autopar: a declarative auto-parallelization compiler for PyTorch training.

capture → price → solve → Plan (→ lower, in :mod:`autopar.passes`).
"""

from autopar.capture import capture  # the function shadows its module, on purpose
from autopar.api import BaselineResult, compare, plan_model, solve
from autopar.cost_models.hardware import ClusterError, ClusterSpec, DeviceSpec, LinkSpec, load_cluster
from autopar.errors import AutoparError, CaptureError, InfeasibleError, PinError, PlanError, SpecError
from autopar.graph import Layer, LayerGraph, TPStyle
from autopar.pins import Pins
from autopar.plan import Plan


__version__ = "0.1.0"
__all__ = [
    "AutoparError", "BaselineResult", "CaptureError", "ClusterError", "ClusterSpec", "DeviceSpec",
    "InfeasibleError", "Layer", "LayerGraph", "LinkSpec", "PinError", "Pins", "Plan", "PlanError",
    "SpecError", "TPStyle", "capture", "compare", "load_cluster", "plan_model", "solve",
]
