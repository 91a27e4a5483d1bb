"""What the price tables of one search share (:class:`SharedPrices`).

A search prices hundreds of configurations; many repeat a tp degree, a
microbatch size and a tp group, and every one asks each layer's recompute
kinds again. One :class:`SharedPrices` per search, handed to every
:class:`~autopar.planning.pricing.PriceTable` it builds, keeps those answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.choice import LayerChoice, Recompute
from autopar.graph import Layer, LayerGraph


@dataclass
class SharedPrices:
    """Prices and answers a search's tables share, each keyed by everything it depends on."""

    # (layer id, style, sp, tp, microbatch, tp group, activation scale, dtype, cluster id) → (the layer,
    # kept so its id is not reused; the style's forward, backward, forward tp and backward tp
    # seconds, and saved activation bytes)
    styles: dict[tuple, tuple[Layer, tuple[float, float, float, float, float]]] = field(default_factory=dict)
    recomputes: dict[tuple[int, int, int], tuple[Recompute, ...]] = field(default_factory=dict)  # (graph id, layer, pp)
    dp_collectives: dict[tuple, float] = field(default_factory=dict)  # PriceTable.dp_collectives_s's arguments
    # (graph id, cluster id, training id, configuration: equal whatever the schedule) → (the graph, kept so its
    # id is not reused; every layer's choices and their pricing.LayerPrice rows, PriceTable._rows: pricing
    # imports this module, so the row type is not named here)
    rows: dict[tuple, tuple[LayerGraph, tuple[list[list[LayerChoice]], list[list]]]] = \
        field(default_factory=dict)
    # (graph id, cluster id, training id, mesh, microbatches, cp method) → (the graph; PriceTable.fastest_time_mb_s)
    fastest: dict[tuple, tuple[LayerGraph, list[float]]] = field(default_factory=dict)
    # the same key → (the graph; pipeline_price.phase_times: T_F, T_B, T_W of a microbatch through every layer),
    # and (that key, "floor", chunks) → (the graph; pipeline_price.bubble_weight_floor)
    phases: dict[tuple, tuple[LayerGraph, Any]] = field(default_factory=dict)
    groups: dict[tuple, tuple[Any, tuple]] = field(default_factory=dict)  # (cluster id, mesh): PriceTable._groups
    # (cluster id, wait share) → (the cluster, kept so its id is not reused; pipeline_price.paced_cluster's)
    paced: dict[tuple, tuple[Any, Any]] = field(default_factory=dict)
    # memory_floor.memory_floor_bytes's rows, least states and least activations, each keyed by what it reads
    floors: dict[tuple, tuple[LayerGraph, Any]] = field(default_factory=dict)
    choices: dict[tuple, tuple[Layer, list[LayerChoice]]] = field(default_factory=dict)  # (layer id, zeros, mesh)
    # (PriceTable.alike, layer pins' id) → (the pins, kept so their id is not reused; choices.allowed_choices)
    allowed: dict[tuple, tuple[list, list[list[int]]]] = field(default_factory=dict)


__all__ = ["SharedPrices"]
