"""A model's stack of repeated blocks, and which of its blocks are alike.

Blocks of one kind (same classes, simple attributes up to their index,
parameter shapes, and their entry in the config's per-block lists) trace to
the same ops in the same order. Capture exports one block of each kind
(:mod:`autopar.capturing.stack_once`) and the sharding engine's meta forwards
run one of each (:mod:`autopar.sharding.replay`): both read this one test.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

# block attributes that only number the block: equal blocks differ in them
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
_SIMPLE = (int, float, bool, str, type(None))


class Unsupported(Exception):
    """The model is outside what the once-per-kind export handles; export it whole."""


def _value_key(value: Any) -> Any:
    if type(value) in _SIMPLE:
        return (type(value).__name__, value)
    if type(value) in (tuple, list) and all(type(v) in _SIMPLE for v in value):
        return (type(value).__name__, tuple(value))
    return None


def block_kind(block: nn.Module, extra: Any = None) -> tuple:
    """What decides a block's traced graph: classes, simple attributes (not its index), tensors."""
    parts: list[Any] = [extra]
    for path, sub in block.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or "forward" in vars(sub):
            raise Unsupported(f"{path or 'block'} has hooks or its own forward")
        attrs = tuple(sorted((k, _value_key(v)) for k, v in vars(sub).items()
                             if not k.startswith("_") and k not in _INDEX_NAMES and _value_key(v) is not None))
        parts.append((path, type(sub), attrs))
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        parts.append((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad))
    return tuple(parts)


def find_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ModuleList of ≥3 composite blocks of one class (a transformer's decoder layers)."""
    best: tuple[str, nn.ModuleList] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 3 or not path:
            continue
        classes = {type(b) for b in mod}
        if len(classes) != 1 or next(mod[0].children(), None) is None:
            continue
        if best is None or len(mod) > len(best[1]):
            best = (path, mod)
    return best


def stack_kinds(model: nn.Module, stack: nn.ModuleList) -> list[int]:
    """Each block's kind: its :func:`block_kind` and its entry in every per-block list of the model's
    config (``layer_types``, ``sliding_window_pattern`` lists, ...), which code may read by index."""
    config = getattr(model, "config", None)
    lists = sorted((k, v) for k, v in (vars(config).items() if config is not None else ())
                   if isinstance(v, (list, tuple)) and len(v) == len(stack))
    keys: dict[tuple, int] = {}
    return [keys.setdefault(block_kind(b, tuple((k, _value_key(v[i]) or repr(v[i])) for k, v in lists)), len(keys))
            for i, b in enumerate(stack)]


__all__ = ["Unsupported", "block_kind", "find_stack", "stack_kinds"]
