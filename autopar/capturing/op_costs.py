"""What selective recompute keeps and re-runs, measured op by op while capture executes the graph.

Selective activation checkpointing (``passes/recompute.py``) keeps the outputs
of the matmul-class ATen ops (:data:`autopar.cost_models.compute.MATMUL_OPS`)
and re-runs every other op of the module in backward. :class:`OpRecorder`, a
``TorchDispatchMode`` inside capture's FLOP counter, sees the same ATen ops
that policy sees and charges each to the FX node running
(:class:`NodeOpCosts`): a matmul-class op's output storages (what is kept),
any other op's counted FLOPs and the bytes it reads and writes (what is
re-run; ops that only alias their inputs, views, move nothing). Fused
attention is recorded by capture itself (:meth:`NodeOpCosts.keep`): the
meta device runs its math decomposition, but GPUs run a fused kernel whose
outputs (the attention output and its log-sum-exp) are what SAC keeps.
:func:`selective_costs` sums a layer's nodes inside its module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.cost_models.compute import FUSED_ATTENTION_OPS, MATMUL_OPS
from autopar.graph import TPStyle


@dataclass
class NodeOpCosts:
    """One FX node's ATen ops as selective recompute sees them (totals for the example batch)."""

    kept: dict[Any, float] = field(default_factory=dict)  # storage key → bytes, matmul-class outputs
    rerun_flops: float = 0.0
    rerun_bytes: float = 0.0
    fused: dict[Any, float] = field(default_factory=dict)  # fused attention's outputs (kept by both policies)
    # each matmul-class op in order: (is aten::mm, {storage key: output bytes}, FLOPs, bytes read and written)
    matmuls: list[tuple[bool, dict[Any, float], float, float]] = field(default_factory=list)

    def keep(self, key: Any, nbytes: float) -> None:
        self.kept[key] = float(nbytes)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class OpRecorder(TorchDispatchMode):
    """Charges every ATen op to the node ``current()`` names (None: not charged, e.g. fused attention).

    ``storage_key`` identifies a tensor's storage (meta tensors too); ``flops()``
    reads the enclosing FLOP counter, which counts the op once this mode hands it on.
    """

    def __init__(self, current: Callable[[], fx.Node | None], flops: Callable[[], float],
                 storage_key: Callable[[torch.Tensor], tuple[Any, int]]):
        super().__init__()
        self.current, self.flops, self.storage_key = current, flops, storage_key
        self.costs: dict[fx.Node, NodeOpCosts] = {}

    def adopt(self, nodes: list[fx.Node], costs: Iterable[NodeOpCosts | None]) -> None:
        """Give a replayed twin layer's nodes the costs its measured twin's nodes had."""
        for n, c in zip(nodes, costs):
            if c is not None:
                self.costs[n] = c

    def keep_fused(self, node: fx.Node, out: torch.Tensor, lse_bytes: float) -> None:
        """Fused attention at ``node``: SAC keeps its output and its log-sum-exp."""
        costs = self.costs.setdefault(node, NodeOpCosts())
        key, nbytes = self.storage_key(out)
        costs.keep(key, nbytes)
        costs.keep(("logsumexp", node), lse_bytes)
        costs.fused.update({key: float(nbytes), ("logsumexp", node): float(lse_bytes)})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.flops()
        out = func(*args, **kwargs)
        node = self.current()
        if node is not None:
            self._charge(self.costs.setdefault(node, NodeOpCosts()), func, (args, kwargs), out,
                         self.flops() - before)
        return out

    def _charge(self, costs: NodeOpCosts, func: Any, inputs: Any, out: Any, flops: float) -> None:
        outs = _tensors(out)
        ins = _tensors(inputs)
        name = func._schema.name
        if name in MATMUL_OPS:
            for t in outs:
                costs.keep(*self.storage_key(t))
            kept = dict(self.storage_key(t) for t in outs)
            if name in FUSED_ATTENTION_OPS:
                costs.fused.update(kept)
            else:
                moved = float(sum(t.numel() * t.element_size() for t in ins + outs))
                costs.matmuls.append((name == "aten::mm", kept, float(flops), moved))
            return
        in_keys = {self.storage_key(t)[0] for t in ins}
        if not outs or (not func._schema.is_mutable and all(self.storage_key(t)[0] in in_keys for t in outs)):
            return  # a view or alias: nothing read or written
        costs.rerun_flops += float(flops)
        costs.rerun_bytes += float(sum(t.numel() * t.element_size() for t in ins + outs))


@dataclass(frozen=True)
class SelectiveCosts:
    """A layer's selective-recompute figures per sample (see :class:`autopar.graph.Layer`)."""

    saved_bytes: float = 0.0
    sharded_bytes: float = 0.0
    recompute_flops: float = 0.0
    recompute_bytes: float = 0.0
    recompute_sharded_bytes: float = 0.0
    alternate: SelectiveCosts | None = None  # the same under torchtitan's op-level policy

    def layer_fields(self) -> dict[str, float]:
        """As :class:`autopar.graph.Layer`'s ``selective_*_per_sample`` and ``alternate_*`` keywords."""
        alt = self.alternate or SelectiveCosts()
        return {"selective_saved_bytes_per_sample": self.saved_bytes,
                "selective_sharded_bytes_per_sample": self.sharded_bytes,
                "selective_recompute_flops_per_sample": self.recompute_flops,
                "selective_recompute_bytes_per_sample": self.recompute_bytes,
                "selective_recompute_sharded_bytes_per_sample": self.recompute_sharded_bytes,
                "alternate_saved_bytes_per_sample": alt.saved_bytes,
                "alternate_sharded_bytes_per_sample": alt.sharded_bytes,
                "alternate_recompute_flops_per_sample": alt.recompute_flops,
                "alternate_recompute_bytes_per_sample": alt.recompute_bytes,
                "alternate_recompute_sharded_bytes_per_sample": alt.recompute_sharded_bytes}


def between_projections(nodes: list[fx.Node], paths: Callable[[fx.Node], tuple[str, ...]],
                        style: TPStyle | None) -> set[fx.Node]:
    """The nodes a Megatron style runs on shards: inside a column projection, or fed by such a
    node, up to (not into) a row projection, whose output is the full-size partial sum."""
    if style is None or not style.row:
        return set()
    cols, rows = set(style.column), set(style.row)
    sharded: set[fx.Node] = set()
    for n in nodes:  # graph order: producers first
        mine = paths(n)
        if any(p in rows for p in mine):
            continue
        if any(p in cols for p in mine) or any(a in sharded for a in n.all_input_nodes):
            sharded.add(n)
    return sharded


def selective_costs(key: str | None, nodes: Iterable[fx.Node], costs: dict[fx.Node, NodeOpCosts],
                    paths: Callable[[fx.Node], tuple[str, ...]], styles: tuple[TPStyle, ...],
                    batch: int) -> SelectiveCosts:
    """Sum layer ``key``'s nodes inside its module (only those are checkpointed), per sample."""
    if key is None:
        return SelectiveCosts()
    inside = [n for n in nodes if key in paths(n)]
    megatron = next((s for s in styles if s.row), None)
    sharded = between_projections(inside, paths, megatron)
    kept: dict[Any, float] = {}
    kept_sharded: dict[Any, float] = {}
    flops = rerun = rerun_sharded = 0.0
    # torchtitan's op-level policy: fused attention and the odd-numbered aten::mm calls kept
    alt_kept: dict[Any, float] = {}
    alt_sharded: dict[Any, float] = {}
    alt_flops = alt_rerun = alt_rerun_sharded = 0.0
    mm_count = 0
    for n in inside:
        c = costs.get(n)
        if c is None:
            continue
        kept.update(c.kept)
        alt_kept.update(c.fused)
        if n in sharded:
            kept_sharded.update(c.kept)
            alt_sharded.update(c.fused)
            rerun_sharded += c.rerun_bytes
        flops += c.rerun_flops
        rerun += c.rerun_bytes
        for is_mm, outs, mm_flops, moved in c.matmuls:
            mm_count += is_mm
            if is_mm and mm_count % 2 == 1:
                alt_kept.update(outs)
                if n in sharded:
                    alt_sharded.update(outs)
                continue
            alt_flops += mm_flops
            alt_rerun += moved
            alt_rerun_sharded += moved if n in sharded else 0.0
    alternate = SelectiveCosts(sum(alt_kept.values()) / batch, sum(alt_sharded.values()) / batch,
                               (flops + alt_flops) / batch, (rerun + alt_rerun) / batch,
                               (rerun_sharded + alt_rerun_sharded) / batch)
    return SelectiveCosts(sum(kept.values()) / batch, sum(kept_sharded.values()) / batch,
                          flops / batch, rerun / batch, rerun_sharded / batch, alternate)
