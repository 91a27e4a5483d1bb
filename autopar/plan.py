"""The Plan: what was chosen, why, and what it is predicted to cost.

Plain frozen dataclasses with JSON I/O (schema ``autopar.plan/1``), bound to
the captured graph by its fingerprint. Loading never unpickles: a plan file is
JSON text, checked field by field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import PlanError

SCHEMA = "autopar.plan/1"
GiB = 2**30


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


@dataclass(frozen=True)
class LayerPlan:
    """One layer's choices. ``stage`` is the virtual stage (rank = stage mod pp)."""

    name: str
    stage: int
    tp: str | None
    zero: int
    recompute: bool


@dataclass(frozen=True)
class Breakdown:
    """Step time on the critical rank, split by cause; the parts add up to the step."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    optimizer_s: float


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    tflops_per_gpu: float
    tokens_per_s_per_gpu: float | None
    memory_per_rank_bytes: tuple[int, ...]
    memory_budget_bytes: int
    breakdown: Breakdown


@dataclass(frozen=True)
class SolverReport:
    status: str  # OPTIMAL or FEASIBLE (then gap > 0) or PINNED
    wall_s: float
    gap: float
    configs_considered: int = 0
    configs_solved: int = 0


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one model on one cluster."""

    fingerprint: str
    model: str
    world_size: int
    mesh: Mesh
    microbatches: int
    microbatch_size: int
    schedule: str
    chunks: int
    layers: tuple[LayerPlan, ...]
    predicted: Predicted
    solver: SolverReport
    cluster: dict[str, Any]
    training: dict[str, Any]
    pins: tuple[str, ...] = ()
    schema: str = SCHEMA
    notes: tuple[str, ...] = field(default_factory=tuple)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(l) for l in self.layers]
        d["predicted"]["memory_per_rank_bytes"] = list(self.predicted.memory_per_rank_bytes)
        d["pins"], d["notes"] = list(self.pins), list(self.notes)
        schema = d.pop("schema")
        return {"schema": schema, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> "Plan":
        return _plan_from_dict(d, source)

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan") -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                            "a plan is the JSON that `autopar plan -o` writes") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path, *, fingerprint: str | None = None) -> "Plan":
        """Read a plan file; with ``fingerprint``, check it was made for that graph."""
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file {str(path)!r} does not exist")
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            raise PlanError(f"plan file {str(path)!r} is not text; a plan is JSON") from None
        plan = cls.from_json(text, source=f"plan file {str(path)!r}")
        if fingerprint is not None:
            plan.check_fingerprint(fingerprint)
        return plan

    def check_fingerprint(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            raise PlanError(
                f"this plan was made for another model ({self.model}, graph {self.fingerprint}); "
                f"the model given captures to graph {fingerprint}: re-plan it with `autopar plan`"
            )

    # ------------------------------------------------------------ display

    @property
    def stages(self) -> int:
        return self.mesh.pp * self.chunks

    def summary(self) -> str:
        """A readable table: mesh, predictions, memory per stage, one row per run of layers."""
        from autopar.summary import render_summary

        return render_summary(self)


def _require(d: dict, key: str, kind: type | tuple, source: str) -> Any:
    if key not in d:
        raise PlanError(f"{source} is missing field {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PlanError(f"{source}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _plan_from_dict(d: Any, source: str) -> Plan:
    if not isinstance(d, dict):
        raise PlanError(f"{source} is not a JSON object")
    schema = d.get("schema")
    if schema != SCHEMA:
        raise PlanError(f"{source} has schema {schema!r}; this autopar reads {SCHEMA!r}")
    try:
        mesh = Mesh(**{k: _require(_require(d, "mesh", dict, source), k, int, source)
                       for k in ("pp", "dp", "tp")})
        layers = tuple(
            LayerPlan(
                name=_require(l, "name", str, source), stage=_require(l, "stage", int, source),
                tp=l.get("tp"), zero=_require(l, "zero", int, source),
                recompute=_require(l, "recompute", bool, source),
            )
            for l in _require(d, "layers", list, source)
        )
        p = _require(d, "predicted", dict, source)
        predicted = Predicted(
            step_time_s=float(_require(p, "step_time_s", (int, float), source)),
            tflops_per_gpu=float(_require(p, "tflops_per_gpu", (int, float), source)),
            tokens_per_s_per_gpu=p.get("tokens_per_s_per_gpu"),
            memory_per_rank_bytes=tuple(_require(p, "memory_per_rank_bytes", list, source)),
            memory_budget_bytes=int(_require(p, "memory_budget_bytes", int, source)),
            breakdown=Breakdown(**_require(p, "breakdown", dict, source)),
        )
        plan = Plan(
            fingerprint=_require(d, "fingerprint", str, source),
            model=_require(d, "model", str, source),
            world_size=_require(d, "world_size", int, source),
            mesh=mesh,
            microbatches=_require(d, "microbatches", int, source),
            microbatch_size=_require(d, "microbatch_size", int, source),
            schedule=_require(d, "schedule", str, source),
            chunks=_require(d, "chunks", int, source),
            layers=layers,
            predicted=predicted,
            solver=SolverReport(**_require(d, "solver", dict, source)),
            cluster=_require(d, "cluster", dict, source),
            training=_require(d, "training", dict, source),
            pins=tuple(d.get("pins", ())),
            notes=tuple(d.get("notes", ())),
        )
    except TypeError as exc:  # unexpected or missing keys in a nested section
        raise PlanError(f"{source} has a malformed section: {exc}") from None
    _check_consistent(plan, source)
    return plan


def _check_consistent(plan: Plan, source: str) -> None:
    if plan.mesh.world_size != plan.world_size:
        raise PlanError(f"{source}: mesh {plan.mesh.pp}×{plan.mesh.dp}×{plan.mesh.tp} does not "
                        f"multiply to world size {plan.world_size}")
    stages = [l.stage for l in plan.layers]
    if any(b < a for a, b in zip(stages, stages[1:])) or (stages and max(stages) >= plan.stages):
        raise PlanError(f"{source}: layer stages must be non-decreasing and below {plan.stages}")
    if any(l.zero not in (0, 1, 2, 3) for l in plan.layers):
        raise PlanError(f"{source}: a layer's zero stage is not 0–3")
