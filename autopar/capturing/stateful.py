"""Layers whose forward changes the model's state: recompute would run that change twice.

A BatchNorm in training mode moves its running mean and variance on every
forward; checkpointing its layer re-runs the forward in backward and moves
them a second time, so the model's running statistics would differ from one
device's. Such layers are not offered recompute (``Layer.recompute_refusal``
says why; :func:`autopar.contract.recompute_applies` reads it).
"""

from __future__ import annotations

import torch.nn as nn


def recompute_refusal(model: nn.Module, path: str | None) -> str:
    """Why the layer at ``path`` may not be recomputed, or "" when it may."""
    if path is None:
        return ""
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return ""
    for name, module in layer.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            where = f"{path}.{name}" if name else path
            return (f"{where} ({type(module).__name__}) updates its running statistics on every forward: "
                    "recompute would update them twice")
    return ""


def batch_norm_channels(model: nn.Module, path: str | None) -> tuple[int, ...]:
    """The channel count of each BatchNorm (1d/2d/3d) in the layer at ``path``: under dp each
    all-reduces its batch statistics (:mod:`autopar.passes.batchnorm`), priced by pricing."""
    if path is None:
        return ()
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return ()
    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return tuple(m.num_features for m in layer.modules() if isinstance(m, kinds))


__all__ = ["batch_norm_channels", "recompute_refusal"]
