"""Which plans ``autopar tune`` measures: the chosen one and the most different runners-up ranked close."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.plan import Plan, RunnerUp


@dataclass
class Candidate:
    """One plan tune considers: the pins that fix it, where it came from, and what it predicted and measured."""

    pins: tuple[str, ...]
    plan: Plan
    source: str  # "solved" (the first plan), "runner-up", "refit" (the plan solved under the refit cluster)
    predicted_before_s: float
    predicted_after_s: float | None = None
    status: str | None = None  # ok, oom, failed; None: not run (the budget ran out first)
    measured_s: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    error: str = ""

    @property
    def predicted_bytes(self) -> int:
        return max(self.plan.predicted.memory_per_rank_bytes, default=0)

    def to_dict(self) -> dict[str, object]:
        return {"pins": list(self.pins), "source": self.source, "mesh": self.plan.mesh.to_dict(),
                "microbatches": self.plan.microbatches, "schedule": self.plan.schedule.value,
                "status": self.status, "predicted_before_s": self.predicted_before_s,
                "predicted_after_s": self.predicted_after_s, "measured_s": self.measured_s,
                "peak_bytes": self.peak_bytes, "predicted_bytes": self.predicted_bytes,
                **({"reserved_bytes": self.reserved_bytes} if self.reserved_bytes is not None else {}),
                **({"error": self.error} if self.error else {})}


def plan_pins(plan: Plan) -> tuple[str, ...]:
    """The pins that fix ``plan``'s configuration (as a runner-up's do): its mesh, microbatches, schedule."""
    pins = [f"{name}={degree}" for name, degree in plan.mesh.items()] + [f"microbatches={plan.microbatches}"]
    if plan.mesh.pp > 1:
        pins.append(f"schedule={plan.schedule.value}")
    if plan.chunks > 1:
        pins.append(f"chunks={plan.chunks}")
    return tuple(pins)


def key(plan: Plan) -> str:
    """What makes two plans the same plan to run: mesh, schedule, microbatches and every layer's choice."""
    return json.dumps([plan.mesh.to_dict(), plan.microbatches, plan.schedule.value, plan.chunks,
                       plan.cp_attention.value, [l.to_dict() for l in plan.layers]], sort_keys=True)


def pick(runners_up: Sequence[RunnerUp], top: int) -> list[RunnerUp]:
    """Up to ``top`` runners-up, closest first, those whose mesh or schedule no earlier pick has first
    (most different), then the rest in the order the model ranks them."""
    ranked = sorted(runners_up, key=lambda r: r.step_time_s)
    seen: set[str] = set()
    distinct, rest = [], []
    for r in ranked:
        shape = json.dumps([r.mesh.to_dict(), r.schedule.value])
        (rest if shape in seen else distinct).append(r)
        seen.add(shape)
    return (distinct + rest)[:top]


def with_pins(user: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The user's pins and a runner-up's, each once (a runner-up already honours the user's)."""
    return list(dict.fromkeys([*user, *extra]))
