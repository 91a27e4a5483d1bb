"""The order the search takes configurations in: best bound first, each bound tightened when it is reached.

Every configuration starts at its cheap bound (fastest strategy per layer, perfectly balanced,
priced without pricing every choice: :meth:`PriceTable.fastest_time_mb_s`). The one at the front
is then priced in full and put back at its pooled bound (:func:`.bounds.pooled_bound_s`: memory
pooled over ranks, the exposed data-parallel tail counted), which is never below the cheap one.
A configuration leaves the queue when its pooled bound is at the front, so configurations come
out in order of the pooled bound, and only those whose cheap bound is below it are priced in
full. The cheap bound alone ordered DeepSeek-V3 on 1,024 H100s so badly once ep was searched
inside pipelines (its exposed ZeRO-3 traffic, up to 8 of a 12 s step, is no part of it) that the
first plans found were 12 s ones and 61-layer pipelines were solved against them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from autopar.cost_models.hardware import ClusterSpec
from autopar.graph import LayerGraph
from autopar.planning.bounds import balanced_step_s, pooled_bound_s
from autopar.planning.choices import allowed_choices
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable
from autopar.planning.shared_prices import SharedPrices

Entry = tuple[float, Configuration, PriceTable, list[list[int]] | None]  # bound, config, table, allowed


class BoundOrder:
    """Configurations by nondecreasing pooled bound; configurations no pinned strategy runs are dropped."""

    def __init__(
        self,
        graph: LayerGraph,
        configs: list[Configuration],
        cluster: ClusterSpec,
        training: TrainingSpec,
        layer_pins: list[dict],
        budget: int | None,
        cuts_ok: list[int],
    ):
        self.layer_pins, self.budget, self.cuts_ok = layer_pins, budget, cuts_ok
        self.configs = configs
        shared = SharedPrices()
        self._tie = itertools.count()
        self._heap: list[tuple[float, Configuration, int, PriceTable, list[list[int]] | None]] = []
        for config in configs:
            table = PriceTable(graph, config, cluster, training, shared)
            fastest = table.fastest_time_mb_s()
            self._heap.append(
                (balanced_step_s(table, sum(fastest), max(fastest)), config, next(self._tie), table, None)
            )
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Entry]:
        while self._heap:
            bound, config, _, table, allowed = heapq.heappop(self._heap)
            if allowed is not None:
                yield bound, config, table, allowed
                continue
            allowed = allowed_choices(table, self.layer_pins)
            if any(not ks for ks in allowed):
                continue
            tighter = max(bound, pooled_bound_s(table, allowed, self.budget, self.cuts_ok))
            heapq.heappush(self._heap, (tighter, config, next(self._tie), table, allowed))

    def rest(self) -> list[Entry]:
        """What is left, each at the bound it has reached (allowed None: not priced yet), by bound."""
        return [(b, c, t, a) for b, c, _, t, a in sorted(self._heap)]
