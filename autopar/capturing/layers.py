"""Which graph nodes make up which layer: capture's layer keys, shared by the whole-model trace
(:mod:`autopar.capturing.trace`) and the once-per-kind export (:mod:`autopar.capturing.stack_once`)."""

from __future__ import annotations

from collections import Counter

import torch.fx as fx
import torch.nn as nn

from autopar.capturing import twins
from autopar.capturing.moe import find_blocks

_SKIP_TARGETS = ("_guards_fn",)
_ATTENTION = (nn.MultiheadAttention,)  # attention modules a block may hold several of (self, cross)


def expanded_paths(model: nn.Module) -> set[str]:
    """Modules to open up: the root and every ancestor of a stack of repeated blocks.

    A stack is ≥2 sibling submodules of one class that are either composite
    (have children of their own, e.g. transformer blocks, ResNet blocks) or
    held in a ModuleList, or ≥2 composite modules of any classes held in a
    ModuleList outside every block of a stack (a hybrid's layers: Jamba's
    Mamba and attention decoder layers, one of each in a 2-layer model; not
    T5's self-attention, cross-attention and MLP inside its blocks). Repeated leaves (ln_1/ln_2, fc1/fc2) do not count,
    so a transformer block stays one layer; nor do an MoE block's experts
    (:mod:`autopar.capturing.moe`): the block is one layer with its router; nor, inside a block of a
    stack, PyTorch's own ``nn.MultiheadAttention`` children (``nn.TransformerDecoderLayer``'s self- and
    cross-attention are two of one class, yet the decoder layer is the block: its attentions and MLP make
    one layer, as an encoder layer's do). A block's other repeated children still open it (MLP-Mixer's
    token- and channel-mixing MLPs, a Swin stage's blocks).
    """
    expanded = {""}
    experts = {b.experts_path for b in find_blocks(model)}
    members: set[str] = set()  # the blocks of the stacks found (their insides are one layer each)
    mixed: list[str] = []
    for path, mod in model.named_modules():
        if path in experts:
            continue
        in_block = path in members and not isinstance(mod, nn.ModuleList)
        counts = Counter(
            type(child)
            for _, child in mod.named_children()
            if isinstance(mod, nn.ModuleList)
            or (next(child.children(), None) is not None and not (in_block and isinstance(child, _ATTENTION)))
        )
        if any(c >= 2 for c in counts.values()):
            _open(expanded, path)
            members.update(f"{path}.{n}" if path else n for n, _ in mod.named_children())
        elif isinstance(mod, nn.ModuleList) and sum(next(c.children(), None) is not None for c in mod) >= 2:
            mixed.append(path)
    for path in mixed:  # a hybrid's layers, unless inside a block (T5's self-attention, cross-attention, MLP)
        parts = path.split(".")
        if not any(".".join(parts[:i]) in members for i in range(1, len(parts))):
            _open(expanded, path)
    return expanded


def _open(expanded: set[str], path: str) -> None:
    parts = path.split(".") if path else []
    expanded.update(".".join(parts[:i]) for i in range(len(parts) + 1))


def is_compute(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module") and node.target not in _SKIP_TARGETS


def group_layers(
    gm: fx.GraphModule, model: nn.Module
) -> tuple[list[tuple[str | None, list[fx.Node]]], dict[fx.Node, int]]:
    """Runs of consecutive compute nodes with the same layer key; glue joins the next run."""
    expanded = expanded_paths(model)
    compute = [n for n in gm.graph.nodes if is_compute(n)]
    keys: list[str | None] = []
    for n in compute:
        key = next((p for p in twins.stack_paths(n) if p not in expanded), None)
        keys.append(key)
    nxt: str | None = None
    for i in range(len(keys) - 1, -1, -1):  # glue → following layer
        if keys[i] is None:
            keys[i] = nxt
        else:
            nxt = keys[i]
    prev: str | None = None
    for i, k in enumerate(keys):  # trailing glue → preceding layer
        if k is None:
            keys[i] = prev
        else:
            prev = k
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n, k in zip(compute, keys):
        if runs and runs[-1][0] == k:
            runs[-1][1].append(n)
        else:
            runs.append((k, [n]))
    node_layer = {n: i for i, (_, nodes) in enumerate(runs) for n in nodes}
    return runs, node_layer


def layer_names(runs: list[tuple[str | None, list[fx.Node]]]) -> list[str]:
    seen: Counter[str] = Counter()
    names = []
    for key, _ in runs:
        base = key if key is not None else "forward"
        seen[base] += 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


__all__ = ["expanded_paths", "group_layers", "is_compute", "layer_names"]
