"""Pipeline schedules: bubble and activations in flight.

For p stages, m microbatches and per-microbatch stage time t, a GPipe or 1F1B
step takes (m + p − 1)·t, a bubble fraction of (p − 1)/m; interleaved 1F1B
with v model chunks per rank takes (m + (p − 1)/v)·t, bubble (p − 1)/(m·v)
(Narayanan et al. 2021). Activations in flight on the rank holding stage s:
GPipe keeps all m; 1F1B keeps min(m, p − s); interleaved keeps the warm-up
forwards of Megatron's schedule, 2(p − s − 1) + (v − 1)·p + 1 chunk-microbatches
(capped at m·v), each holding about 1/v of the rank's layers.
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


@dataclass(frozen=True)
class Schedule:
    kind: ScheduleKind
    chunks: int = 1  # model chunks (virtual stages) per rank; >1 only for interleaved

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"a schedule needs at least one chunk per rank, got {self.chunks}")
        if self.chunks > 1 and self.kind is not ScheduleKind.INTERLEAVED_1F1B:
            raise ValueError(f"{self.kind.value} runs one chunk per rank, got {self.chunks}")
        if self.kind is ScheduleKind.INTERLEAVED_1F1B and self.chunks < 2:
            raise ValueError("interleaved 1F1B needs at least 2 chunks per rank")

    @property
    def name(self) -> str:
        return self.kind.value

    def __str__(self) -> str:
        return f"{self.kind.value}×{self.chunks}" if self.chunks > 1 else self.kind.value


def bubble_fraction(schedule: Schedule, pp: int, microbatches: int) -> Fraction:
    """Idle time over useful time: (p − 1)/(m·v)."""
    if pp <= 1:
        return Fraction(0)
    return Fraction(pp - 1, microbatches * schedule.chunks)


def step_time_multiplier(schedule: Schedule, pp: int, microbatches: int) -> Fraction:
    """Step time in units of one rank's per-microbatch time: m + (p − 1)/v."""
    return microbatches * (1 + bubble_fraction(schedule, pp, microbatches))


def in_flight(schedule: Schedule, pp: int, microbatches: int, rank: int) -> Fraction:
    """Microbatches of activations the pipeline rank ``rank`` holds at its peak.

    In units of one microbatch of all the rank's layers (for interleaved, each
    chunk-microbatch counts 1/v).
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
    warmup = 2 * (p - rank - 1) + (v - 1) * p + 1
    return Fraction(min(m * v, warmup), v)
