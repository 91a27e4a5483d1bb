"""autopar: a declarative auto-parallelization compiler for PyTorch training.

capture → price → solve → Plan (→ lower, in :mod:`autopar.passes`).

Public names are imported lazily (PEP 562): ``autopar show plan.json`` and
other torch-free uses must not pay the seconds that importing torch costs.
The capture function lives in :mod:`autopar.capturing`, so no submodule
shares a name with a public function.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "capture": "autopar.capturing",
    "BaselineResult": "autopar.planning.api", "compare": "autopar.planning.api", "plan_model": "autopar.planning.api",
    "solve": "autopar.planning.api", "reprice": "autopar.planning.api",
    "ClusterError": "autopar.cost_models.hardware", "ClusterSpec": "autopar.cost_models.hardware",
    "DeviceSpec": "autopar.cost_models.hardware", "LinkSpec": "autopar.cost_models.hardware",
    "load_cluster": "autopar.cost_models.presets",
    "AutoparError": "autopar.errors", "CaptureError": "autopar.errors",
    "InfeasibleError": "autopar.errors", "PinError": "autopar.errors", "PlanError": "autopar.errors",
    "SpecError": "autopar.errors",
    "Layer": "autopar.graph", "LayerGraph": "autopar.graph", "TPStyle": "autopar.graph",
    "Pins": "autopar.pins",
    "Plan": "autopar.plan",
    "Mesh": "autopar.mesh", "MeshError": "autopar.errors", "LayerChoice": "autopar.choice",
    "compile": "autopar.runtime", "ParallelModel": "autopar.runtime",
    "latest_checkpoint": "autopar.runtime",
    "UnknownDeviceWarning": "autopar.runtime.launch",
    "BatchError": "autopar.errors", "LaunchError": "autopar.errors",
    "LoweringError": "autopar.errors", "CompileError": "autopar.errors",
    "CheckpointError": "autopar.errors", "WeightsError": "autopar.errors",
    "InputsError": "autopar.errors", "LossError": "autopar.errors",
    "DataError": "autopar.errors", "MetricsError": "autopar.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name on first use and cache it on the package."""
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
