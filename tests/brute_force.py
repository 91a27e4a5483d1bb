"""Brute force over a configuration's plans, sharing only the price table and ``evaluate`` with the solver: every
configuration, every placement of pipeline cuts and every strategy (dominated or not) of every layer — where the
solver chooses the root units' one ZeRO stage, each stage in turn (the contract runs every root unit at one
stage) — keeping the fastest plan whose every rank fits in the budget. ``tests/planning/test_solver.py`` and
``test_zero_bubble_search.py`` hold the solver and its bounds to it."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace

import numpy as np

from autopar import contract
from autopar.cost_models.hardware import GiB
from autopar.cost_models.presets import PRESETS
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.planning import edges
from autopar.planning.configs import cut_positions, enumerate_configs
from autopar.planning.configuration import TrainingSpec
from autopar.planning.pricing import PriceTable


def _distinct_rows(rows: np.ndarray) -> np.ndarray:
    """Each distinct row once: ``np.unique(rows, axis=0)``'s set, in another order, without its sort of
    rows as raw bytes (two thirds of this file's time)."""
    rows = rows[np.lexsort(rows.T[::-1])]
    repeats = np.zeros(len(rows), dtype=bool)
    repeats[1:] = (rows[1:] == rows[:-1]).all(axis=1)
    return rows[~repeats]


def _pareto(times: np.ndarray, tails: np.ndarray) -> tuple[list[float], list[float]]:
    """The (time, tail) pairs no other pair beats on both, fastest first: in order of time (then
    tail), each pair whose tail is below every tail before it."""
    order = np.lexsort((tails, times))
    times, tails = times[order], tails[order]
    before = np.minimum.accumulate(np.concatenate(([np.inf], tails[:-1])))
    keep = tails < before
    return times[keep].tolist(), tails[keep].tolist()


def _rank_frontier(table: PriceTable, layers: list[int], rank: int, budget: int,
                   root_zero: int | None = None) -> list[tuple[float, float, int]]:
    """Every (time, tail) one rank can reach within budget, by enumerating all strategy combinations.

    Memory is the layers' coefficients, the rank's workspace and FSDP2's buffers, held once if
    any layer needs them (a reduce-scatter buffer from ZeRO-1 on, a prefetch buffer for ZeRO-3).
    Each (time, tail) comes with the highest ZeRO stage of the rank's FSDP2 units, at whose level
    the plan's first and last units are exposed (added once the ranks are combined).
    """
    times, tails = np.zeros(1), np.zeros(1)
    mems, needs = np.full(1, table.rank_workspace_bytes(rank), dtype=np.int64), np.zeros(1, dtype=np.int64)
    levels = np.zeros(1, dtype=np.int64)
    root = contract.wrapping(table.graph, table.config.mesh.pp).root
    for i in layers:
        ks = [k for k in range(len(table.choices[i]))  # every root unit runs at one stage
              if root_zero is None or not root[i] or table.choices[i][k].zero == root_zero]
        t = np.array([table.prices[i][k].time_mb_s for k in ks])
        x = np.array([table.prices[i][k].tail_s for k in ks])
        m = np.array([table.memory_coefficient(i, k, rank) for k in ks], dtype=np.int64)
        z = np.array([table.choices[i][k].zero for k in ks])
        b = (z >= 1).astype(np.int64) + (z == 3)
        e = np.array([edges.edge_level(table, i, k) for k in ks], dtype=np.int64)
        times = np.add.outer(times, t).ravel()
        tails = np.add.outer(tails, x).ravel()
        mems = np.add.outer(mems, m).ravel()
        needs = np.maximum.outer(needs, b).ravel()
        levels = np.maximum.outer(levels, e).ravel()
        # identical layers make many combinations sum alike: keep each distinct sum once
        rows = _distinct_rows(np.stack([times.round(15), tails.round(15), mems.astype(np.float64),
                                        needs.astype(np.float64), levels.astype(np.float64)], axis=1))
        times, tails = rows[:, 0], rows[:, 1]
        mems, needs, levels = rows[:, 2].astype(np.int64), rows[:, 3].astype(np.int64), rows[:, 4].astype(np.int64)
    buffers = np.array([table.buffer_bytes(b) for b in contract.Buffers], dtype=np.int64)
    ok = mems + buffers[needs] <= budget
    front: list[tuple[float, float, int]] = []  # the objective only grows with each: a Pareto set per level
    for level in sorted(set(levels[ok].tolist())):
        at = ok & (levels == level)
        front += [(t, x, level) for t, x in zip(*_pareto(times[at], tails[at]))]
    return front


def configs_and_root_stages(graph: LayerGraph, world: int, cluster, training: TrainingSpec):
    """Every configuration, and where the solver chooses the root units' one ZeRO stage, each stage."""
    for config in enumerate_configs(graph, world, cluster, training, Pins()):
        free = config.data_parallel.sharded and not config.data_parallel.root_zero
        for root_zero in contract.ROOT_STAGES if free else [None]:
            yield config, root_zero


def brute_force(graph: LayerGraph, world: int, cluster, training: TrainingSpec, budget: int) -> float:
    return min((config_best(PriceTable(graph, config, cluster, training), root_zero, budget)
                for config, root_zero in configs_and_root_stages(graph, world, cluster, training)), default=math.inf)


def config_best(table: PriceTable, root_zero: int | None, budget: int) -> float:
    """The fastest plan of one configuration (at one root ZeRO stage), every choice tried."""
    graph, config, best = table.graph, table.config, math.inf
    cuts_ok = cut_positions(graph)
    frontier = functools.cache(  # many placements of the cuts give a rank the same layers
        lambda layers, j: _rank_frontier(table, list(layers), j, budget, root_zero))
    for cuts in itertools.combinations(cuts_ok, config.stages - 1):
        bounds = [0, *cuts, len(graph)]
        stages = [s for s in range(config.stages) for _ in range(bounds[s], bounds[s + 1])]
        p2p = [0.0] * config.mesh.pp
        for q in cuts:
            p2p[config.rank_of_stage(stages[q - 1])] += table.p2p_s(q, stages[q])
            p2p[config.rank_of_stage(stages[q])] += table.p2p_s(q, stages[q])
        fronts = []
        for j in range(config.mesh.pp):
            layers = [i for i, s in enumerate(stages) if config.rank_of_stage(s) == j]
            fronts.append([(t + p2p[j], x, z) for t, x, z in frontier(tuple(layers), j)])
        if any(not f for f in fronts):
            continue
        for combo in itertools.product(*fronts):
            edge = edges.edge_exposed_s(table, max(z for *_, z in combo))
            best = min(best, table.step_time_s([t for t, *_ in combo], max(x for _, x, _ in combo) + edge))
    return best


def tiny_cluster(memory_gib: float, gpus: int = 4, cores: int = 0):
    c = PRESETS["a100-80g"]
    return replace(c, gpus_per_node=gpus, cores_per_node=cores,
                   device=replace(c.device, memory_bytes=int(memory_gib * GiB)))
