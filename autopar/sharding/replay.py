"""Run a stack's twin blocks once, not once each, in a meta forward that only watches what passes between them.

:func:`autopar.sharding.check.record_links` runs the whole model on meta to see
whether each block's hidden state is the very tensor the block before it
returned; Llama 3 70B's 80 decoder layers made that ~6,700 torch calls. What
it watches is the model's code *between* blocks, not inside them, so inside
:func:`replayed_twins` a block of the stack whose kind
(:func:`autopar.capturing.stack_once.block_kind` and its entries in the
config's per-block lists, the same test the capture relies on to write a
stack from one block of each kind) and whose input shapes match an earlier
block's is not run: it returns fresh meta tensors of the shapes that earlier
block returned, and hands back any input it returned (the same object, so
identity between blocks is kept).

Why this is exact for that purpose: twins run the same ops on inputs of the
same shapes, so they return the same shapes; on meta no value exists for the
code between blocks to branch on. A block whose inputs or outputs hold
anything but tensors and plain values (a cache object it could update in
place) is always run, as is every block of a model whose stack
``stack_once`` would not take (hooks, a block with its own ``forward``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.stacks import Unsupported, find_stack, stack_kinds

_PLAIN = (int, float, bool, str, type(None))


def _key(a: tuple, k: dict) -> tuple | None:
    """The input's structure and shapes, or None when a leaf is neither a tensor nor a plain value."""
    leaves, spec = pytree.tree_flatten((a, k))
    parts: list[Any] = [spec]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.stride(), x.dtype, x.device.type))
        elif type(x) in _PLAIN:
            parts.append((type(x).__name__, x))
        else:
            return None
    return tuple(parts)


def _template(a: tuple, k: dict, out: Any) -> tuple | None:
    """How to rebuild ``out`` for a twin: each leaf an input it returned (by position), a fresh
    meta tensor's shape, or a plain value; None if it holds anything else."""
    ins = pytree.tree_leaves((a, k))
    leaves, spec = pytree.tree_flatten(out)
    recipe: list[tuple] = []
    for x in leaves:
        at = next((i for i, y in enumerate(ins) if y is x), None)
        if at is not None:
            recipe.append(("input", at))
        elif isinstance(x, torch.Tensor) and x.is_meta and x._base is None:
            recipe.append(("new", tuple(x.shape), x.stride(), x.dtype))
        elif type(x) in _PLAIN:
            recipe.append(("plain", x))
        else:
            return None
    return spec, recipe


def _rebuild(template: tuple, a: tuple, k: dict) -> Any:
    spec, recipe = template
    ins = pytree.tree_leaves((a, k))
    leaves = [ins[r[1]] if r[0] == "input" else r[1] if r[0] == "plain"
              else torch.empty_strided(r[1], r[2], dtype=r[3], device="meta") for r in recipe]
    return pytree.tree_unflatten(leaves, spec)


def _stack_kinds(model: nn.Module) -> dict[int, Any]:
    """id(block) → its kind, for the blocks of the model's stack; empty when capture's
    once-per-kind export would not take that stack either."""
    found = find_stack(model)
    if found is None:
        return {}
    try:
        kinds = stack_kinds(model, found[1])
    except Unsupported:
        return {}
    return {id(b): kind for b, kind in zip(found[1], kinds)}


def replayed_twins(model: nn.Module, watched: list[str]) -> contextlib.AbstractContextManager[None]:
    """Within, a meta forward runs each kind of stack block once per input shape (see the module).
    A block with a ``watched`` module inside it always runs (a skipped body would skip its hooks).
    The blocks' kinds are read now, before the caller hooks them (a hooked block has no kind)."""
    kinds = _stack_kinds(model)
    inside: set[int] = set()
    for p in watched:  # every ancestor of a watched module, not only its parent
        while "." in p:
            p = p.rpartition(".")[0]
            inside.add(id(model.get_submodule(p)))
    return _replayed(model, {i: k for i, k in kinds.items() if i not in inside})


@contextlib.contextmanager
def _replayed(model: nn.Module, kinds: dict[int, Any]) -> Iterator[None]:
    if not kinds or not all(p.is_meta for p in model.parameters()):
        yield
        return
    seen: dict[tuple, tuple] = {}
    patched = []

    def stub(block: nn.Module) -> Any:
        real = block.forward

        def forward(*a: Any, **k: Any) -> Any:
            key = _key(a, k)
            key = None if key is None else (kinds[id(block)], key)
            if key is not None and key in seen:
                return _rebuild(seen[key], a, k)
            out = real(*a, **k)
            template = _template(a, k, out) if key is not None else None
            if template is not None:
                seen[key] = template
            return out
        return forward

    for block in model.modules():
        if id(block) in kinds:
            block.forward = stub(block)  # type: ignore[method-assign]
            patched.append(block)
    try:
        yield
    finally:
        for block in patched:
            del block.forward
