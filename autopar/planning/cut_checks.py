"""Cuts capture withdrew (a boundary that cannot be sent, a buffer written across it): said in the
plan's notes, and one line when stage pins need one of them."""

from __future__ import annotations

from typing import Any

from autopar.errors import PinError
from autopar.graph import LayerGraph


def check_stage_pins(graph: LayerGraph, layer_pins: list[dict[str, Any]]) -> None:
    """A :class:`PinError` naming the value (and its type) when two stage-pinned layers can only be
    put on different stages by a cut capture withdrew."""
    pinned = [(i, p["stage"]) for i, p in enumerate(layer_pins) if p.get("stage") is not None]
    for (a, sa), (b, sb) in zip(pinned, pinned[1:]):
        if sa == sb:
            continue
        between = graph.layers[a:b]
        if any(l.can_cut_after for l in between):
            continue
        why = next((l.cut_blocked_by for l in reversed(between) if l.cut_blocked_by), "")
        if why:
            raise PinError(f"{graph.layers[a].name} is pinned to stage {sa} and {graph.layers[b].name} to "
                           f"stage {sb}, but {why}")


def withdrawn_cut_notes(graph: LayerGraph) -> tuple[str, ...]:
    """Cuts withdrawn for what would cross them (runs of the same reason folded into one note)."""
    reasons = [l.cut_blocked_by for l in graph
               if l.cut_blocked_by and " is tied between layers " not in l.cut_blocked_by]
    unique = list(dict.fromkeys(reasons))
    return tuple(f"pipeline cut not offered: {why}" for why in unique[:4]) + (
        (f"… and {len(unique) - 4} more cuts not offered",) if len(unique) > 4 else ())


__all__ = ["check_stage_pins", "withdrawn_cut_notes"]
