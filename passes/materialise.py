"""Materialise a meta-device model after sharding: each rank allocates only its own shards.

Takes a module whose parameters may be on the meta device (already sharded by
the passes), returns nothing; what stays true: FQNs and shapes are unchanged,
values come from ``init_fn`` or each module's ``reset_parameters()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device,
                init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Allocate a sharded meta model on ``device`` (each rank only its shards) and initialise it.

    ``init_fn(model)`` if given, else ``reset_parameters()`` on every module that has it.
    Buffers computed in ``__init__`` (e.g. rotary tables) are not recomputed: pass an ``init_fn``.
    """
    model.to_empty(device=device)
    if init_fn is not None:
        init_fn(model)
        return
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
