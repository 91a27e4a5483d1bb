"""The facts admission needs about this run (:class:`autopar.admission.Here`), read from torch and the model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.admission import Here
from autopar.runtime.balance import biased_routers


def device_facts(device: torch.device | None = None) -> dict[str, Any]:
    """This process's device (None: the current CUDA device, else the CPU): its type, and a CUDA device's
    compute capability and name."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None or device.type == "cpu":
        return {"device": "cpu"}
    if device.type != "cuda":
        return {"device": device.type}
    return {"device": "cuda", "capability": tuple(torch.cuda.get_device_capability(device)),
            "device_name": torch.cuda.get_device_name(device)}


def here(world_size: int, launched: bool, *, model: nn.Module | None = None, torch_compile: bool | None = None,
         float8: Any = None, moe_bias_update: Any = 0.0, device: torch.device | None = None,
         read_device: bool = True) -> Here:
    """What this run is (the ranks launched, the device) and asks (compile, float8, the MoE bias step);
    the model's biased routers are counted only when a bias step is asked (a non-number is left for
    admission to refuse). ``read_device`` False: the device is not asked about (only float8 needs it)."""
    counted = (len(biased_routers(model)) if model is not None and isinstance(moe_bias_update, (int, float))
               and not isinstance(moe_bias_update, bool) and moe_bias_update > 0 else 0)
    return Here(world_size=world_size, launched_world=dist.get_world_size() if launched else None,
                torch_compile=torch_compile, float8=float8, moe_bias_update=moe_bias_update,
                biased_routers=counted, **(device_facts(device) if read_device else {}))


__all__ = ["device_facts", "here"]
