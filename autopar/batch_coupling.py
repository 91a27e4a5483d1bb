"""Layers whose output depends on the batch they see, and how a plan runs them: one rule.

A BatchNorm in training normalises with its batch's statistics; a GShard/Switch capacity MoE
(capacity factor × top-k < experts) drops the tokens over an expert's capacity, computed from the
tokens of one call. Split the batch (dp ranks, microbatches) and each split sees another batch, so
the numbers change. The plan's :class:`~autopar.choice.BatchCoupling` says what happens:

- **exact**: one device's numbers. BatchNorm's statistics are all-reduced over the dp group
  (``passes/batchnorm.py``, priced); nothing else can be exact (microbatches run one after another,
  so no statistic of the whole batch exists when the first runs; a capacity over every rank's tokens
  would need each rank's routing before any rank dispatches), so such plans are not offered
  (:func:`refusal`).
- **split**: every coupled layer runs on its own split, a dp rank's microbatch, as plain data
  parallelism does (no collective).
- **auto** (the default): exact where the runtime can be (BatchNorm over the whole dp group), split
  where it cannot (per microbatch; a capacity block per dp rank's microbatch, as GShard, Switch and
  DeepSpeed-MoE compute capacity per device). No model people train data parallel is refused dp.

A plan that splits says so in one line (:func:`semantics`), and ``verify`` compares it with one
process that runs the same splits (:func:`groups`, :func:`take`): each step's global batch as the
groups the coupled layers saw, the gradient the mean of the groups'.

Context parallelism is refused beside a coupled layer whatever the choice: its splits are a share of
each sequence, which no one-process run of whole samples reproduces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autopar.choice import BatchCoupling
from autopar.inputs import Inputs, normalise

Cell = tuple[int, int]  # (dp rank, microbatch): the rows one call of a split layer sees


@dataclass(frozen=True)
class Coupled:
    """A layer whose output depends on its batch: ``kind`` is ``norm`` (BatchNorm) or ``capacity``."""

    layer: str
    kind: str
    why: str  # one line: what couples it (the capacity block's refusal text, the norm's channels)


def coupled(layers: Iterable[Any]) -> list[Coupled]:
    """The batch-coupled layers of a graph, in order."""
    out = []
    for layer in layers:
        if layer.sync_norm_channels:
            out.append(Coupled(layer.name, "norm", f"{layer.name} (BatchNorm of {layer.sync_norm_channels} channels)"))
        out += [Coupled(layer.name, "capacity", m.split_refusal) for m in layer.moe if m.split_refusal]
    return out


def synced(policy: BatchCoupling) -> bool:
    """Whether BatchNorm's statistics are all-reduced over the dp group (exact and auto)."""
    return policy is not BatchCoupling.SPLIT


def refusal(layers: Iterable[Any], mesh: Any, microbatches: int, policy: BatchCoupling) -> str | None:
    """Why a plan of ``mesh`` and ``microbatches`` cannot run the coupled layers as ``policy`` asks
    (None when it can); the planner offers no such plan, the runtime refuses one handed to it."""
    found = coupled(layers)
    if not found or mesh.dp * mesh.cp * microbatches <= 1:
        return None
    split = f"dp={mesh.dp} × cp={mesh.cp} × microbatches={microbatches} splits the batch"
    if mesh.cp > 1:
        return (f"{split}, but {found[0].layer} depends on the batch it sees and cp would hand it a share of each "
                "sequence, which no one-device run reproduces; plan cp=1")
    cap = next((c for c in found if c.kind == "capacity"), None)
    norm = next((c for c in found if c.kind == "norm"), None)
    if policy is BatchCoupling.EXACT:
        if cap is not None:
            return f"{split}, but {cap.why}, or pin batch_coupled=split (capacity per split, as GShard computes it)"
        if microbatches > 1:
            return (f"{split}, but {norm.layer} (BatchNorm) would normalise each microbatch by its own statistics "  # type: ignore[union-attr]
                    "(microbatches run one after another: no statistic of the whole batch exists when the first "
                    "runs); plan microbatches=1, or pin batch_coupled=split")
        return None
    if policy is BatchCoupling.AUTO and cap is not None and norm is not None and mesh.dp > 1:
        return (f"{split}, but {norm.layer} (BatchNorm, its statistics over the dp group) and {cap.layer} "
                "(capacity per dp rank) would see different splits; pin batch_coupled=split")
    return None


def groups(layers: Iterable[Any], dp: int, microbatches: int, policy: BatchCoupling) -> list[list[Cell]] | None:
    """The splits each call of the coupled layers sees, as lists of cells; None where they see the
    whole global batch (no coupled layer, nothing split, or exact)."""
    found = coupled(layers)
    cells = [[(r, i)] for r in range(dp) for i in range(microbatches)]
    if not found or dp * microbatches == 1:
        return None
    if any(c.kind == "capacity" for c in found) or not synced(policy):
        return cells
    if microbatches == 1:
        return None  # BatchNorm over the whole dp group: the global batch
    return [[(r, i) for r in range(dp)] for i in range(microbatches)]


def semantics(layers: Iterable[Any], dp: int, microbatches: int, policy: BatchCoupling, global_batch: int) -> str:
    """The plan's line for its coupled layers where they see splits ("" where they see the whole batch)."""
    layers = list(layers)
    found, cut = coupled(layers), groups(layers, dp, microbatches, policy)
    if cut is None:
        if found and dp > 1:
            return (f"batch-coupled layers ({_names(found)}): exact (batch_coupled={policy.value}): BatchNorm's "
                    f"statistics all-reduced over the dp group of {dp}, priced")
        return ""
    size = global_batch // len(cut)
    where = "each dp rank's microbatch" if len(cut[0]) == 1 else "each microbatch of the whole dp group"
    return (f"batch-coupled layers ({_names(found)}): split (batch_coupled={policy.value}): each sees {where}, "
            f"{len(cut)} splits of {size} samples, not the global batch of {global_batch}; verify compares with "
            "one process running the same splits (pin batch_coupled=exact for one device's numbers where a plan "
            "can keep them)")


def _names(found: list[Coupled]) -> str:
    names = list(dict.fromkeys(f"{c.layer} ({'BatchNorm' if c.kind == 'norm' else 'capacity MoE'})" for c in found))
    return ", ".join(names[:3]) + (f", … (+{len(names) - 3})" if len(names) > 3 else "")


def take(inputs: Any, group: list[Cell], dp: int, microbatches: int, batch: int) -> Inputs | torch.Tensor:
    """The rows of ``inputs`` (a global batch of ``batch`` samples) the cells of ``group`` hold, in order:
    dp rank r's share is the r-th of ``dp`` chunks, its microbatch i the i-th of ``microbatches`` chunks
    of that (as the runtime cuts them)."""
    per_rank = batch // dp
    per_mb = per_rank // microbatches
    rows = torch.cat([torch.arange(r * per_rank + i * per_mb, r * per_rank + (i + 1) * per_mb) for r, i in group])

    def one(v: Any) -> Any:
        return v.index_select(0, rows.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() and \
            v.shape[0] == batch else v
    if isinstance(inputs, torch.Tensor):  # targets
        return one(inputs)
    inputs = normalise(inputs)
    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(v) for v in inputs)


__all__ = ["Cell", "Coupled", "coupled", "groups", "refusal", "semantics", "synced", "take"]
