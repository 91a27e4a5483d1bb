"""Pipeline schedules: stage placement, bubble and activations in flight.

For p stages, m microbatches and per-microbatch stage time t, a GPipe or 1F1B
step takes (m + p − 1)·t, a bubble fraction of (p − 1)/m; interleaved 1F1B
with v model chunks per rank takes (m + (p − 1)/v)·t, bubble (p − 1)/(m·v)
(Narayanan et al. 2021). Activations in flight on the rank holding stage s:
GPipe keeps all m; 1F1B keeps min(m, p − s); interleaved keeps the warm-up
forwards of Megatron's schedule, 2(p − s − 1) + (v − 1)·p + 1 chunk-microbatches
(capped at m·v), each holding about 1/v of the rank's layers.

The zero-bubble schedules split each backward into B (the input gradient)
and W (the weight gradient, which nothing downstream waits for) and fill the
bubble with W (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):

- ``interleaved_zb``: torch's ``ScheduleInterleavedZeroBubble`` (the paper's
  ZB-H1 per chunk, v ≥ 1 chunks per rank, looped placement s on s mod p).
  ZB-H1's bubble is (p − 1)(T_F + T_B − T_W) for T_W ≤ T_F, a third of 1F1B's
  (p − 1)(T_F + T_B + T_W) when T_F = T_B = T_W, at 1F1B's peak memory (torch
  defers later ranks' W, so its ranks each hold up to p microbatches).
- ``zbv``: torch's ``ScheduleZBVZeroBubble``, two chunks per rank in a V:
  stage s and 2p − 1 − s on rank s (the paper's ZB-V, near-zero bubble at
  1F1B's memory when T_F = T_B = T_W).
- ``dualpipev``: torch's ``ScheduleDualPipeV`` (DeepSeek-V3 technical report,
  §3.2.1, Table 2: DualPipe's bubble (PP/2 − 1)(F&B + B − 3W), activations
  PP + 1; its V variant keeps one copy of the parameters, two chunks per
  rank in the V; at least 2p microbatches). torch runs its overlapped F&B
  pairs one after the other (no second stream), so they are priced as F + B,
  and the table's bubble, which counts an overlapped pair as one F&B, is
  not what torch's DualPipeV runs.

What these cost is not taken from the papers' formulas but from the actions
torch generates, simulated with the plan's F, B and W times
(:mod:`autopar.cost_models.schedule_sim`); the formulas above are what the
tests hold the simulation to.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from fractions import Fraction


class ScheduleKind(Enum):
    NONE = "none"  # pp = 1: microbatches are plain gradient accumulation
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    INTERLEAVED_ZB = "interleaved_zb"  # ZB-H1 per chunk, B and W split (torch's ScheduleInterleavedZeroBubble)
    ZBV = "zbv"  # ZB-V: two chunks per rank in a V (torch's ScheduleZBVZeroBubble)
    DUALPIPE_V = "dualpipev"  # DeepSeek's DualPipe, V variant (torch's ScheduleDualPipeV)


# schedules that split a backward into input (B) and weight (W) gradients
SPLIT_BACKWARD = frozenset({ScheduleKind.INTERLEAVED_ZB, ScheduleKind.ZBV, ScheduleKind.DUALPIPE_V})
# schedules whose ranks hold stages s and 2p − 1 − s (torch's "v" stage-to-rank style)
V_SHAPED = frozenset({ScheduleKind.ZBV, ScheduleKind.DUALPIPE_V})
# schedules with several chunks (virtual stages) per rank: any count ≥ 2, any ≥ 1, or exactly 2
MULTI_CHUNK = frozenset({ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.INTERLEAVED_ZB}) | V_SHAPED


@dataclass(frozen=True)
class Schedule:
    kind: ScheduleKind
    chunks: int = 1  # model chunks (virtual stages) per rank

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"a schedule needs at least one chunk per rank, got {self.chunks}")
        if self.chunks > 1 and self.kind not in MULTI_CHUNK:
            raise ValueError(f"{self.kind.value} runs one chunk per rank, got {self.chunks}")
        if self.kind is ScheduleKind.INTERLEAVED_1F1B and self.chunks < 2:
            raise ValueError("interleaved 1F1B needs at least 2 chunks per rank")
        if self.kind in V_SHAPED and self.chunks != 2:
            raise ValueError(f"{self.kind.value} runs exactly 2 chunks per rank (a V), got {self.chunks}")

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def v_shape(self) -> bool:
        return self.kind in V_SHAPED

    @property
    def split_backward(self) -> bool:
        return self.kind in SPLIT_BACKWARD

    def rank_of_stage(self, stage: int, pp: int) -> int:
        """The pipeline rank holding virtual stage ``stage`` (:func:`stage_rank`)."""
        return stage_rank(stage, pp, self.v_shape)

    def __str__(self) -> str:
        return f"{self.kind.value}×{self.chunks}" if self.chunks > 1 else self.kind.value


def stage_rank(stage: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank of virtual stage ``stage``: looped, s mod p; in a V (two chunks a rank),
    s for s < p and 2p − 1 − s after (torch's ``generate_stage_to_rank_mapping``, styles "loop"
    and "v")."""
    if pp <= 1:
        return 0
    if not v_shape:
        return stage % pp
    lap, at = divmod(stage, pp)
    return at if lap % 2 == 0 else pp - 1 - at


def rank_stages(rank: int, pp: int, stages: int, v_shape: bool = False) -> list[int]:
    """The virtual stages pipeline rank ``rank`` holds, in order."""
    return [s for s in range(stages) if stage_rank(s, pp, v_shape) == rank]


def schedule_refusal(kind: ScheduleKind, pp: int, microbatches: int, chunks: int) -> str | None:
    """Why torch's schedule ``kind`` cannot run ``microbatches`` on ``pp`` ranks of ``chunks`` chunks
    (its constructor's checks, and what autopar offers of the looped ones), or None."""
    m, p = microbatches, pp
    if kind is ScheduleKind.ONE_F_ONE_B and m < p:
        return f"1f1b needs at least pp={p} microbatches, got {m}"
    if kind in (ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.INTERLEAVED_ZB) and m % p:
        return f"{kind.value} needs microbatches divisible by pp={p}, got {m}"
    if kind is ScheduleKind.DUALPIPE_V and m < 2 * p:
        return f"dualpipev needs at least as many microbatches as stages (2 × pp = {2 * p}), got {m}"
    return None


def bubble_fraction(schedule: Schedule, pp: int, microbatches: int) -> Fraction:
    """Idle time over useful time for GPipe, 1F1B and interleaved 1F1B: (p − 1)/(m·v). The split-backward
    schedules' bubble depends on T_F : T_B : T_W (:func:`autopar.cost_models.schedule_sim.bubble_weight`)."""
    if pp <= 1:
        return Fraction(0)
    if schedule.split_backward:
        raise ValueError(f"{schedule.kind.value}'s bubble depends on its F, B and W times: use schedule_sim")
    return Fraction(pp - 1, microbatches * schedule.chunks)


def step_time_multiplier(schedule: Schedule, pp: int, microbatches: int) -> Fraction:
    """Step time in units of one rank's per-microbatch time: m + (p − 1)/v."""
    return microbatches * (1 + bubble_fraction(schedule, pp, microbatches))


def in_flight(schedule: Schedule, pp: int, microbatches: int, rank: int) -> Fraction:
    """Microbatches of activations the pipeline rank ``rank`` holds at its peak.

    In units of one microbatch of all the rank's layers (for several chunks a rank, each
    chunk-microbatch counts 1/v). The split-backward schedules count, along torch's own actions
    for the rank, the chunk-microbatches forwarded whose weight gradient has not run (torch's
    input-gradient backward retains the autograd graph for it): :func:`.schedule_sim.peak_in_flight`.
    """
    m, p, v = microbatches, pp, schedule.chunks
    if not 0 <= rank < max(p, 1):
        raise ValueError(f"pipeline rank {rank} outside 0..{p - 1}")
    if p <= 1 or schedule.kind is ScheduleKind.NONE:
        return Fraction(1)
    if schedule.kind is ScheduleKind.GPIPE:
        return Fraction(m)
    if schedule.kind is ScheduleKind.ONE_F_ONE_B:
        return Fraction(min(m, p - rank))
    if schedule.split_backward:
        return split_backward_in_flight(schedule, p, m, rank)
    warmup = 2 * (p - rank - 1) + (v - 1) * p + 1
    return Fraction(min(m * v, warmup), v)


def split_backward_in_flight(schedule: Schedule, pp: int, microbatches: int, rank: int) -> Fraction:
    """The most chunk-microbatches, over v, that rank ``rank`` of a split-backward schedule holds: the peak
    along torch's actions (:func:`.schedule_sim.peak_in_flight`, a chunk-microbatch held from its forward to its
    weight backward) in closed form, so a search need not generate torch's action lists to screen memory
    (they cost up to 0.7 s a configuration at m = 512). Read off torch 2.13's ``_calculate_single_rank_operations``
    and held to its actions over p ≤ 16, m ≤ 128 by tests/cost_models/test_zero_bubble_memory.py:

    - ``interleaved_zb`` (``ScheduleInterleavedZeroBubble``: ``_get_1f1b_rank_ops`` with ``enable_zero_bubble``,
      then ``_add_bubbles_to_actions``): p·v, i.e. p microbatches on every rank, where the paper's ZB-H1 holds
      1F1B's p − rank (Qi et al. 2024, §3.1): torch defers the later ranks' W;
    - ``zbv`` (``ScheduleZBVZeroBubble``: warm-ups of 2(p − rank) − 1, rank and p − rank forwards): m + 1 + rank,
      at most 2m and 2p, i.e. p microbatches at most, the paper's ZB-V at 1F1B's memory (§6);
    - ``dualpipev`` (``ScheduleDualPipeV``, its W queued until the cool-down): 2p + 1 chunk-microbatches on every
      rank, the DeepSeek-V3 report's PP + 1 (§3.2.1, Table 2) with its PP the 2p stages of the V.
    """
    m, p, v = microbatches, pp, schedule.chunks
    if schedule.kind is ScheduleKind.INTERLEAVED_ZB:
        held = p * v
    elif schedule.kind is ScheduleKind.ZBV:
        held = min(m + 1 + rank, 2 * m, 2 * p)
    elif schedule.kind is ScheduleKind.DUALPIPE_V:
        held = 2 * p + 1
    else:
        raise ValueError(f"{schedule.kind.value} does not split its backward")
    return Fraction(held, v)
