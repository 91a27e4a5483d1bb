"""Configurations: every mesh, microbatch count, schedule and data-parallel mode the pins allow.

A configuration (:class:`~autopar.planning.pricing.MeshConfig`) is what one
CP-SAT model is solved for: pp × dp × tp = world size (tp within a node
unless pinned), a microbatch count m dividing the per-replica batch, a
schedule (GPipe only where 1F1B cannot run, since under this cost model 1F1B
has GPipe's time and never more memory; interleaved 1F1B with 2 or 4 chunks
per rank), and each data-parallel mode the contract offers
(:func:`autopar.contract.data_parallel_modes`).
"""

from __future__ import annotations

import math

from autopar import contract
from autopar.cost_models.hardware import ClusterSpec
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.errors import PinError
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.planning.pricing import MeshConfig, TrainingSpec

INTERLEAVED_CHUNKS = (2, 4)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cut_positions(graph: LayerGraph) -> list[int]:
    """Positions q (cut before layer q) where a pipeline may be cut."""
    return [i + 1 for i, layer in enumerate(graph.layers[:-1]) if layer.can_cut_after]


def enumerate_configs(graph: LayerGraph, world_size: int, cluster: ClusterSpec,
                      training: TrainingSpec, pins: Pins) -> list[MeshConfig]:
    """Every configuration the pins allow; raises PinError naming why none remain."""
    pins.check_form()
    pinned = [(k, getattr(pins, k)) for k in ("pp", "dp", "tp") if getattr(pins, k) is not None]
    product = math.prod(v for _, v in pinned)
    if world_size % product:
        names = " × ".join(f"{k}={v}" for k, v in pinned)
        total = f" = {product}" if len(pinned) > 1 else ""
        raise PinError(f"world size {world_size} is not a multiple of the pinned {names}{total}")
    if len(pinned) == 3 and product != world_size:
        raise PinError(f"pinned pp × dp × tp = {product} but the world size is {world_size}")
    max_stages = len(cut_positions(graph)) + 1
    pinned_zeros = [pin.get("zero") for pin in pins.resolve_layers([layer.name for layer in graph])]
    configs: list[MeshConfig] = []
    for tp in [pins.tp] if pins.tp else [d for d in _divisors(world_size) if cluster.gpus_per_node % d == 0]:
        for pp in [pins.pp] if pins.pp else _divisors(world_size // tp):
            if (world_size // tp) % pp or pp > max_stages:
                continue
            dp = world_size // (tp * pp)
            floor = contract.root_floor(graph, pinned_zeros, pp)
            if pins.dp not in (None, dp) or training.global_batch % dp:
                continue
            per_replica = training.global_batch // dp
            for m in [pins.microbatches] if pins.microbatches else _divisors(per_replica):
                if per_replica % m:
                    continue
                configs += [MeshConfig(pp, dp, tp, m, s, mode) for s in _schedules(pp, m, max_stages, pins)
                            for mode in contract.data_parallel_modes(graph, pp, dp, floor)]
    if not configs:
        raise PinError(why_no_config(graph, world_size, training, pins, max_stages))
    return configs


def _schedules(pp: int, m: int, max_stages: int, pins: Pins) -> list[Schedule]:
    if pp == 1:
        return [Schedule(ScheduleKind.NONE)] if pins.schedule in (None, ScheduleKind.NONE) else []
    out: list[Schedule] = []
    want = pins.schedule
    if want is ScheduleKind.GPIPE or (want is None and m < pp):
        out.append(Schedule(ScheduleKind.GPIPE))
    if want in (None, ScheduleKind.ONE_F_ONE_B) and m >= pp and pins.chunks is None:
        out.append(Schedule(ScheduleKind.ONE_F_ONE_B))
    if want in (None, ScheduleKind.INTERLEAVED_1F1B) and m % pp == 0:
        for v in [pins.chunks] if pins.chunks else INTERLEAVED_CHUNKS:
            if pp * v <= max_stages:
                out.append(Schedule(ScheduleKind.INTERLEAVED_1F1B, v))
    return out


def _blocked(graph: LayerGraph) -> str:
    reasons = list(dict.fromkeys(l.cut_blocked_by for l in graph if l.cut_blocked_by))
    return f"; no cut goes where {'; '.join(reasons[:2])}" if reasons else ""


def why_no_config(graph: LayerGraph, world: int, training: TrainingSpec, pins: Pins, max_stages: int) -> str:
    b = training.global_batch
    if pins.pp and pins.pp * (pins.chunks or 1) > max_stages:
        return (f"pp={pins.pp}{f' × chunks={pins.chunks}' if pins.chunks else ''} needs "
                f"{pins.pp * (pins.chunks or 1)} pipeline stages but the model can be cut into at "
                f"most {max_stages} (it has {max_stages - 1} places a cut may go)" + _blocked(graph))
    if pins.dp and b % pins.dp:
        return f"batch size {b} does not divide over the pinned dp={pins.dp}"
    if pins.dp and pins.microbatches and b % (pins.dp * pins.microbatches):
        return (f"batch size {b} does not divide into the pinned dp={pins.dp} × "
                f"microbatches={pins.microbatches}")
    if pins.microbatches:
        return (f"batch size {b} cannot give microbatches={pins.microbatches} on any data-parallel "
                f"degree of world size {world} that the other pins allow")
    if pins.schedule or pins.chunks:
        return (f"no mesh for world size {world} and batch size {b} can run the pinned schedule "
                f"({pins.schedule.value if pins.schedule else 'interleaved_1f1b'}); interleaved "
                "1F1B needs microbatches divisible by pp")
    mesh = [(k, getattr(pins, k)) for k in ("pp", "dp", "tp") if getattr(pins, k)]
    if not mesh:
        return (f"no mesh pp × dp × tp = {world} divides batch size {b}; use a batch size divisible "
                "by the data-parallel degree")
    named = " × ".join(f"{k}={v}" for k, v in mesh)
    free = [k for k in ("pp", "dp", "tp") if not getattr(pins, k)]
    if free == ["dp"]:  # pp and tp pinned: dp is what is left of the world size
        dp = world // (pins.pp * pins.tp)
        return (f"the pinned {named} leave dp={dp} for world size {world}, which does not divide batch "
                f"size {b}; use a batch size divisible by {dp}")
    return (f"no mesh pp × dp × tp = {world} with the pinned {named} divides batch size {b}; use a "
            "batch size divisible by the data-parallel degree")
