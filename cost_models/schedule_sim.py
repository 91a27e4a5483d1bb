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


@lru_cache(maxsize=256)
def flat_actions(kind: str, pp: int, microbatches: int, chunks: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Per pipeline rank, :func:`actions` as (stage, kind, microbatch) in run order (:func:`_flat`): what the
    simulation and the activations in flight read, flattened once per schedule (a search asks each of a
    configuration's bubble and in-flight counts: flattening torch's actions again each time was most of it)."""
    order = actions(kind, pp, microbatches, chunks)
    return tuple(tuple(_flat(order[r])) for r in range(pp))


def simulate(schedule: Any, pp: int, microbatches: int,
             times: Sequence[tuple[float, float, float]]) -> float:
    """The step of ``schedule`` (a :class:`~.pipeline.Schedule`) with stage s taking ``times[s]`` = (F, B, W)
    a microbatch."""
    queues = flat_actions(schedule.kind.value, pp, microbatches, schedule.chunks)
    last = pp * schedule.chunks - 1
    # when each (stage, microbatch) forward and input backward ended (-1: not yet); nothing waits for a W
    width = microbatches
    fwd_end, bwd_end = [-1.0] * ((last + 1) * width), [-1.0] * ((last + 1) * width)
    clock, head = [0.0] * pp, [0] * pp
    remaining = sum(len(q) for q in queues)
    while remaining:
        progress = False
        for r in range(pp):
            queue, at, now = queues[r], head[r], clock[r]
            while at < len(queue):
                stage, kind, mb = queue[at]
                if kind == "F":  # waits for the previous stage's forward
                    ready = fwd_end[(stage - 1) * width + mb] if stage > 0 else 0.0
                elif kind == "W":  # waits for its own input backward
                    ready = bwd_end[stage * width + mb]
                else:  # B or BW: the next stage's input backward, or on the last stage its own forward
                    ready = fwd_end[stage * width + mb] if stage == last else bwd_end[(stage + 1) * width + mb]
                if ready < 0:
                    break
                f, b, w = times[stage]
                now = max(now, ready) + (f if kind == "F" else b if kind == "B" else w if kind == "W" else b + w)
                if kind == "F":
                    fwd_end[stage * width + mb] = now
                elif kind != "W":
                    bwd_end[stage * width + mb] = now
                at += 1
                remaining -= 1
                progress = True
            head[r], clock[r] = at, now
        if not progress:
            raise RuntimeError(f"{schedule} on pp={pp} with m={microbatches}: torch's actions deadlock")
    return max(clock)


def steady_microbatches(pp: int, microbatches: int) -> int:
    """The microbatch count whose simulated w is every larger count's: 2p where m ≥ 2p, else m itself.

    From 2p microbatches on, torch's three split-backward schedules are in their steady phase: every further
    microbatch adds exactly F + B + W to each rank's busy time, and its warm-up and cool-down, which set w,
    stay as they are (interleaved_zb from p already, in rounds of p; zbv and dualpipev from 2p, their warm-up's
    3p − rank − 1 forwards filled). So w at m ≥ 2p is w at 2p (2p divides into rounds of p and is dualpipev's
    least count), which keeps a search's simulations at most 2p microbatches: torch's action lists at m = 512
    cost up to 0.7 s each. tests/cost_models/test_zero_bubble_memory.py holds w at m to w at 2p over a grid of
    (pp, m, chunks, F : B : W)."""
    return min(microbatches, 2 * pp)


@lru_cache(maxsize=1024)
def bubble_weight(schedule: Any, pp: int, microbatches: int, f: float, b: float, w: float) -> Fraction:
    """w of the step model for a rank whose layers take F = ``f``, B = ``b``, W = ``w`` a microbatch
    (any unit; only their ratios count), its chunks splitting them equally; simulated at
    :func:`steady_microbatches`, whose w is the same."""
    return simulated_bubble_weight(schedule, pp, steady_microbatches(pp, microbatches), f, b, w)


def simulated_bubble_weight(schedule: Any, pp: int, microbatches: int, f: float, b: float, w: float) -> Fraction:
    """w as :func:`bubble_weight` gives it, simulated at ``microbatches`` itself."""
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
    out = []
    for rank_actions in flat_actions(schedule.kind.value, pp, microbatches, schedule.chunks):
        live = peak = 0
        for _, kind, _ in rank_actions:
            live += 1 if kind == "F" else -1 if kind in ("W", "BW") else 0
            peak = max(peak, live)
        out.append(Fraction(peak, schedule.chunks))
    return tuple(out)


def zb_h1_bubble(pp: int, f: float, b: float, w: float) -> float:
    """ZB-H1's bubble for equal stages with T_W ≤ T_F, (p − 1)(T_F + T_B − T_W) (Qi et al. 2024, §3.1): the
    yardstick the tests hold torch's one-chunk ``interleaved_zb`` to."""
    return (pp - 1) * (f + b - w)
