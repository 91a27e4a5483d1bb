"""What torch's split-backward pipeline schedules run: their actions, simulated.

The zero-bubble schedules (``interleaved_zb``, ``zbv``, ``dualpipev``:
:mod:`.pipeline`) are priced from the action lists torch itself generates for
each rank (``_calculate_single_rank_operations`` of
``torch.distributed.pipelining.schedules``), not from the papers' closed
forms: what runs is what is priced. Two things are read from them:

- **The step.** Each rank runs its actions in order; an action starts when
  its rank is free and what it waits for is done: a forward F(s, i) waits for
  F(s − 1, i); an input backward B(s, i) (or a full backward, B and W in one)
  for B(s + 1, i), on the last stage for F(s, i); a weight backward W(s, i)
  for B(s, i). Durations are a chunk's F, B and W times; torch runs
  DualPipeV's overlapped F&B pairs one after the other, so a pair takes
  F + B. Sends are left out here (the step model adds each rank's sends to its
  per-microbatch time).
- **The activations in flight.** Along a rank's actions, a chunk-microbatch
  counts from its forward until its weight backward (or full backward): torch's
  input backward keeps the autograd graph for the weight backward that follows.

:func:`bubble_weight` turns the simulated step of equal stages into the w of
the step model m·T + w·(S − T) (``autopar.planning.pricing``): with equal
stages S − T = (p − 1)·T, so w = (step/T − m)/(p − 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any

DENOMINATOR = 1000  # w is a Fraction with at most this denominator (the solver needs integer coefficients)


def _torch_schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


@lru_cache(maxsize=256)
def actions(kind: str, pp: int, microbatches: int, chunks: int) -> dict[int, tuple[Any, ...]]:
    """Per pipeline rank, torch's compute actions for the schedule named ``kind`` (``ScheduleKind`` values
    ``interleaved_zb``, ``zbv``, ``dualpipev``; None: an idle slot), as its constructor makes them; built
    without stages, from the same methods (torch 2.13's attributes)."""
    sched = _torch_schedules()
    p, m = pp, microbatches
    if kind == "interleaved_zb":
        s = object.__new__(sched.ScheduleInterleavedZeroBubble)
        s.pp_group_size, s.n_local_stages, s._n_microbatches = p, chunks, m
        s.number_of_rounds = max(1, m // p)
        s.microbatches_per_round = m // s.number_of_rounds
        s.pipeline_order = {r: s._calculate_single_rank_operations(r) for r in range(p)}
        order = s._add_bubbles_to_actions(chunks * p)
    elif kind in ("zbv", "dualpipev"):
        cls = sched.ScheduleZBVZeroBubble if kind == "zbv" else sched.ScheduleDualPipeV
        s = object.__new__(cls)
        s.pp_group_size, s._n_microbatches, s.num_stages, s._num_stages = p, m, 2 * p, 2 * p
        order = {r: s._calculate_single_rank_operations(r) for r in range(p)}
    else:
        raise ValueError(f"{kind} is priced by its formula, not simulated")
    return {r: tuple(order[r]) for r in range(p)}


def _flat(rank_actions: Sequence[Any]) -> list[tuple[int, str, int]]:
    """(stage, kind, microbatch) in run order: "F", "B" (input backward), "W" (weight backward),
    "BW" (full backward); overlapped pairs as their parts."""
    out = []
    for a in rank_actions:
        if a is None:
            continue
        parts = a.sub_actions if a.sub_actions else (a,)
        for part in parts:
            kind = part.computation_type.value
            out.append((part.stage_index, {"F": "F", "I": "B", "W": "W", "B": "BW"}[kind], part.microbatch_index))
    return out


def simulate(schedule: Any, pp: int, microbatches: int,
             times: Sequence[tuple[float, float, float]]) -> float:
    """The step of ``schedule`` (a :class:`~.pipeline.Schedule`) with stage s taking ``times[s]`` = (F, B, W)
    a microbatch."""
    order = actions(schedule.kind.value, pp, microbatches, schedule.chunks)
    last = pp * schedule.chunks - 1
    queues = {r: _flat(order[r]) for r in range(pp)}
    done: dict[tuple[int, str, int], float] = {}
    clock, head = [0.0] * pp, [0] * pp

    def waits_for(stage: int, kind: str, mb: int) -> tuple[int, str, int] | None:
        if kind == "F":
            return (stage - 1, "F", mb) if stage > 0 else None
        if kind == "W":
            return (stage, "B", mb)
        return (stage, "F", mb) if stage == last else (stage + 1, "B", mb)

    remaining = sum(len(q) for q in queues.values())
    while remaining:
        progress = False
        for r in range(pp):
            while head[r] < len(queues[r]):
                stage, kind, mb = queues[r][head[r]]
                dep = waits_for(stage, kind, mb)
                if dep is not None and dep not in done:
                    break
                f, b, w = times[stage]
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + {"F": f, "B": b, "W": w, "BW": b + w}[kind]
                done[(stage, "F" if kind == "F" else "W" if kind == "W" else "B", mb)] = clock[r]
                if kind == "BW":
                    done[(stage, "W", mb)] = clock[r]
                head[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError(f"{schedule} on pp={pp} with m={microbatches}: torch's actions deadlock")
    return max(clock)


@lru_cache(maxsize=1024)
def bubble_weight(schedule: Any, pp: int, microbatches: int, f: float, b: float, w: float) -> Fraction:
    """w of the step model for a rank whose layers take F = ``f``, B = ``b``, W = ``w`` a microbatch
    (any unit; only their ratios count), its chunks splitting them equally."""
    if pp <= 1:
        return Fraction(0)
    total = f + b + w
    if total <= 0:
        return Fraction(0)
    v = schedule.chunks
    step = simulate(schedule, pp, microbatches, [(f / v, b / v, w / v)] * (pp * v))
    weight = (step / total - microbatches) / (pp - 1)
    return Fraction(max(weight, 0.0)).limit_denominator(DENOMINATOR)


@lru_cache(maxsize=256)
def peak_in_flight(schedule: Any, pp: int, microbatches: int) -> tuple[Fraction, ...]:
    """Per pipeline rank, the most chunk-microbatches of activations held at once, over v (in units of
    one microbatch of all the rank's layers)."""
    order = actions(schedule.kind.value, pp, microbatches, schedule.chunks)
    out = []
    for r in range(pp):
        live = peak = 0
        for _, kind, _ in _flat(order[r]):
            live += 1 if kind == "F" else -1 if kind in ("W", "BW") else 0
            peak = max(peak, live)
        out.append(Fraction(peak, schedule.chunks))
    return tuple(out)


def zb_h1_bubble(pp: int, f: float, b: float, w: float) -> float:
    """ZB-H1's bubble for equal stages with T_W ≤ T_F, (p − 1)(T_F + T_B − T_W) (Qi et al. 2024, §3.1): the
    yardstick the tests hold torch's one-chunk ``interleaved_zb`` to."""
    return (pp - 1) * (f + b - w)
