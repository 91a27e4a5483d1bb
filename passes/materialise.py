"""Materialise a meta-device model after sharding: each rank allocates only its own shards.

Takes a module whose parameters may be on the meta device (already sharded by
the passes), returns nothing; what stays true: FQNs and shapes are unchanged,
parameter values come from ``init_fn`` or each module's ``reset_parameters()``,
and every buffer holds a real value — never ``torch.empty``'s leftovers:

* a buffer that already has values (not on meta) keeps them;
* one on meta is filled by ``init_fn`` / ``reset_parameters()`` (BatchNorm's
  running statistics), else recomputed by building its module again on the
  CPU from the module's own ``config`` (Hugging Face's rotary ``inv_freq``,
  computed in ``__init__``) and copying the fresh module's buffer;
* one that none of these writes is a :class:`LoweringError` naming it. Each is
  filled with a sentinel first (NaN, or the dtype's least integer), so an
  unwritten buffer is seen, not read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from autopar.errors import LoweringError


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


def _rebuilt_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of ``module`` built again on the CPU from its ``config`` ({} when it has none)."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    try:
        with torch.device("cpu"):
            fresh = type(module)(config)
    except Exception:  # noqa: BLE001 - a constructor that wants more than its config: no recipe
        return {}
    return dict(fresh.named_buffers(recurse=False))


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device,
                init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Allocate a sharded meta model on ``device`` (each rank only its shards) and initialise it.

    ``init_fn(model)`` if given, else ``reset_parameters()`` on every module that has it; buffers
    as the module docstring says. Raises :class:`LoweringError` for a buffer nothing gives a value.
    """
    real = {(id(m), name): b for m in model.modules() for name, b in m._buffers.items()
            if b is not None and not b.is_meta}
    model.to_empty(device=device)
    blank: list[tuple[str, nn.Module, str]] = []
    for path, m in model.named_modules():
        for name, b in m._buffers.items():
            if b is None:
                continue
            if (id(m), name) in real:
                m._buffers[name] = real[(id(m), name)].to(device)
            else:
                _sentinel(b)
                blank.append((path, m, name))
    if init_fn is not None:
        init_fn(model)
    else:
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    rebuilt: dict[int, dict[str, torch.Tensor]] = {}
    for path, m, name in blank:
        b = m._buffers[name]
        if b is None or not _unwritten(b):
            continue
        fresh = rebuilt.setdefault(id(m), _rebuilt_buffers(m)).get(name)
        if fresh is None or fresh.shape != b.shape:
            where = f"{path}.{name}" if path else name
            raise LoweringError(f"buffer {where} of the meta-device model gets no real value here (neither "
                                "init_fn, reset_parameters nor its module's constructor sets it): build the "
                                "model on the CPU, or pass an init_fn that sets it")
        b.copy_(fresh)
