"""The search's configurations, each keyed by its cheap bound, their price tables built when first read.

A configuration under a split-backward schedule (``interleaved_zb``, ``zbv``, ``dualpipev``) has the times of
its sibling under GPipe or 1F1B, the same configuration but its schedule (:attr:`~.pricing.PriceTable.times_alike`
leaves the schedule out), and its cheap bound reads nothing else of it but its floor of w
(:func:`.pipeline_price.bubble_weight_floor`). So it is keyed from its sibling's table, and its own is built
only if the search reaches it: HF Llama 3 70B × 512 at 8,192 tokens keys 16,357 of them, of which the search
examines about 2,200 (most by the memory screen alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from autopar.cost_models.hardware import ClusterSpec
from autopar.cost_models.pipeline import Schedule
from autopar.graph import LayerGraph
from autopar.planning import hsdp_price, pipeline_price
from autopar.planning.bounds import balanced_step_s
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable
from autopar.planning.shared_prices import SharedPrices


@dataclass
class Candidates:
    """Configurations in the order of their cheap bound (ties in configuration order); ``[n]`` gives
    (cheap bound, configuration, table), the table built then if it was not."""

    graph: LayerGraph
    cluster: ClusterSpec
    training: TrainingSpec
    shared: SharedPrices
    entries: list[list] = field(default_factory=list)  # [cheap, configuration, table or None]
    index: dict[tuple[Configuration, Schedule], int] = field(default_factory=dict)  # schedule: not compared

    @classmethod
    def keyed(cls, graph: LayerGraph, configs: list[Configuration], cluster: ClusterSpec, training: TrainingSpec,
              shared: SharedPrices) -> Candidates:
        out = cls(graph, cluster, training, shared)
        siblings: dict[Configuration, tuple[PriceTable, float, float]] = {}  # the table, its layers' sum and most
        later = []
        for config in configs:
            if config.schedule.split_backward:
                later.append(config)
                continue
            table = out.table(config)
            fastest = table.fastest_time_mb_s()
            siblings.setdefault(config, (table, sum(fastest), max(fastest)))  # a schedule is not compared
            out.entries.append([_cheap(table, sum(fastest), max(fastest)), config, table])
        floors: dict[tuple[int, int], Fraction] = {}  # (sibling's id, chunks): its floor of w
        for config in later:  # keyed from a sibling's table where there is one (a pinned schedule has none)
            if (sibling := siblings.get(config)) is None:
                table = out.table(config)
                fastest = table.fastest_time_mb_s()
                out.entries.append([_cheap(table, sum(fastest), max(fastest)), config, table])
                continue
            table, total, slowest = sibling
            if (key := (id(table), config.schedule.chunks)) not in floors:
                floors[key] = pipeline_price.bubble_weight_floor(table, config.schedule)
            out.entries.append([_cheap(table, total, slowest, floors[key]), config, None])
        out.entries.sort(key=lambda e: (e[0], e[1]))
        out.index = {(e[1], e[1].schedule): n for n, e in enumerate(out.entries)}
        return out

    def table(self, config: Configuration) -> PriceTable:
        return PriceTable(self.graph, config, self.cluster, self.training, self.shared)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, n: int) -> tuple[float, Configuration, PriceTable]:
        entry = self.entries[n]
        if entry[2] is None:
            entry[2] = self.table(entry[1])
        return entry[0], entry[1], entry[2]

    def cheap(self, n: int) -> float:
        return self.entries[n][0]

    def configs(self) -> list[Configuration]:
        return [e[1] for e in self.entries]

    def twin_table(self, config: Configuration) -> PriceTable | None:
        """The table of ``config``'s HSDP twin (:func:`.hsdp_price.twin`) under the same schedule, if searched."""
        n = self.index.get((hsdp_price.twin(config), config.schedule))
        return None if n is None else self[n][2]


def _cheap(table: PriceTable, total: float, slowest: float, bubble_weight: Fraction | None = None) -> float:
    """The cheap bound: the fastest choice of every layer (summing to ``total``, the slowest ``slowest``),
    perfectly balanced stages, and a floor of w (``bubble_weight``: a split-backward schedule's, whose times
    are ``table``'s)."""
    return balanced_step_s(table, total, slowest, pipeline_price.bubble_weight_floor(table)
                           if bubble_weight is None else bubble_weight)


__all__ = ["Candidates"]
