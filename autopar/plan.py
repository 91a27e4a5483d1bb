"""The Plan: what was chosen, why, and what it is predicted to cost.

Plain frozen dataclasses with JSON I/O (schema ``autopar.plan/1``), bound to
the captured graph by its fingerprint. Loading never unpickles: a plan file is
JSON text, checked field by field. Inside the program the settings travel as
types (a :class:`ClusterSpec`, a :class:`ScheduleKind`, :class:`TrainingSettings`);
in the file they are the plain JSON they always were.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.cost_models.hardware import ClusterSpec, CostModelError
from autopar.cost_models.pipeline import ScheduleKind
from autopar.errors import PlanError
from autopar.units import device_noun, format_bytes, format_flop_rate

SCHEMA = "autopar.plan/1"


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
class TrainingSettings:
    """The training step a plan was made for (the file's ``training`` section).

    ``global_batch`` samples per step in ``dtype`` (``bf16`` or ``fp32``);
    ``seq_len`` is the captured sequence length (None for models without one);
    ``optimizer`` is the optimizer the memory model priced (``adam``).
    """

    global_batch: int
    dtype: str
    seq_len: int | None
    optimizer: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "training") -> TrainingSettings:
        return _training_from_dict(d, source)


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one model on one cluster."""

    fingerprint: str
    model: str
    world_size: int
    mesh: Mesh
    microbatches: int
    microbatch_size: int
    schedule: ScheduleKind  # "none", "gpipe", "1f1b" or "interleaved_1f1b" in the file
    chunks: int
    layers: tuple[LayerPlan, ...]
    predicted: Predicted
    solver: SolverReport
    cluster: ClusterSpec  # ClusterSpec.to_dict() in the file
    training: TrainingSettings
    pins: tuple[str, ...] = ()
    schema: str = SCHEMA
    notes: tuple[str, ...] = field(default_factory=tuple)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)  # key order is the field order; the typed settings become their JSON
        d["schedule"] = self.schedule.value
        d["cluster"] = self.cluster.to_dict()
        d["training"] = self.training.to_dict()
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
    def from_dict(cls, d: Any, *, source: str = "plan") -> Plan:
        return _plan_from_dict(d, source)

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                            "a plan is the JSON that `autopar plan -o` writes") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path, *, fingerprint: str | None = None) -> Plan:
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
        """A readable table: mesh, predictions, memory per pipeline rank, one row per run of layers, notes."""
        return render_summary(self)


def _require(d: dict, key: str, kind: type | tuple, source: str) -> Any:
    if key not in d:
        raise PlanError(f"{source} is missing field {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PlanError(f"{source}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _schedule_from_dict(d: dict, source: str) -> ScheduleKind:
    value = _require(d, "schedule", str, source)
    try:
        return ScheduleKind(value)
    except ValueError:
        raise PlanError(f"{source}: field 'schedule' is {value!r}; use one of "
                        f"{', '.join(k.value for k in ScheduleKind)}") from None


def _cluster_from_dict(d: dict, source: str) -> ClusterSpec:
    raw = _require(d, "cluster", dict, source)
    try:
        return ClusterSpec.from_dict(raw, source="cluster")
    except CostModelError as exc:
        raise PlanError(f"{source}: {exc}") from None


_TRAINING_FIELDS = ("global_batch", "dtype", "seq_len", "optimizer")


def _training_from_dict(t: Any, source: str) -> TrainingSettings:
    if not isinstance(t, dict):
        raise PlanError(f"{source} is not a JSON object")
    unknown = sorted(set(t) - set(_TRAINING_FIELDS))
    if unknown:
        raise PlanError(f"{source} has unknown fields {', '.join(map(repr, unknown))}")
    seq_len = _require(t, "seq_len", (int, type(None)), source)
    if isinstance(seq_len, bool):
        raise PlanError(f"{source}: field 'seq_len' has the wrong type (bool)")
    return TrainingSettings(
        global_batch=_require(t, "global_batch", int, source),
        dtype=_require(t, "dtype", str, source),
        seq_len=seq_len,
        optimizer=_require(t, "optimizer", str, source),
    )


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
            schedule=_schedule_from_dict(d, source),
            chunks=_require(d, "chunks", int, source),
            layers=layers,
            predicted=predicted,
            solver=SolverReport(**_require(d, "solver", dict, source)),
            cluster=_cluster_from_dict(d, source),
            training=_training_from_dict(_require(d, "training", dict, source), f"{source}: training"),
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


# ---------------------------------------------------------------- the readable table


def _fold(layers: tuple[LayerPlan, ...]) -> list[tuple[str, LayerPlan, int]]:
    """Runs of consecutive layers with identical choices: (label, first, count)."""
    rows: list[tuple[str, LayerPlan, int]] = []
    start = 0
    for i in range(1, len(layers) + 1):
        if i < len(layers) and _choices(layers[i]) == _choices(layers[start]):
            continue
        first, count = layers[start], i - start
        label = first.name if count == 1 else f"{first.name} … {layers[i - 1].name} ({count})"
        rows.append((label, first, count))
        start = i
    return rows


def _choices(layer: LayerPlan) -> tuple:
    return (layer.stage, layer.tp, layer.zero, layer.recompute)


def _layer_rows(plan: Plan) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """The layer table's rows and header. Interleaved plans (chunks > 1) also show each row's
    pipeline rank (stage mod pp) and its chunk on that rank (stage div pp)."""
    interleaved, pp = plan.chunks > 1, plan.mesh.pp
    rows = []
    for label, l, _ in _fold(plan.layers):
        where = (str(l.stage), str(l.stage % pp), str(l.stage // pp)) if interleaved else (str(l.stage),)
        rows.append((label, *where, l.tp or "-", str(l.zero), "on" if l.recompute else "off"))
    header = ("layer", "stage", *(("rank", "chunk") if interleaved else ()), "tp", "zero", "recompute")
    return rows, header


def _memory_line(plan: Plan) -> str:
    """Peak memory of each pipeline rank (all the ranks of one pipeline rank hold alike)."""
    p = plan.predicted
    budget = format_bytes(p.memory_budget_bytes)
    if len(p.memory_per_rank_bytes) == 1:
        return f"{format_bytes(p.memory_per_rank_bytes[0])}  (budget {budget})"
    return ("  ".join(f"rank {j}: {format_bytes(x)}" for j, x in enumerate(p.memory_per_rank_bytes))
            + f"  (per pipeline rank; budget {budget})")


def render_summary(plan: Plan) -> str:
    p, m = plan.predicted, plan.mesh
    sched = plan.schedule.value + (f" × {plan.chunks} chunks" if plan.chunks > 1 else "")
    gap = f", gap {plan.solver.gap:.2%}" if plan.solver.gap > 0 else ""
    noun = device_noun(plan.cluster)
    tokens = f"  ({p.tokens_per_s_per_gpu:,.0f} tokens/s per {noun})" if p.tokens_per_s_per_gpu else ""
    b = p.breakdown
    lines = [
        f"autopar plan — {plan.model} on {plan.world_size} × {plan.cluster.device.name}"
        f" ({plan.cluster.name}, {plan.training.dtype})",
        f"mesh          pp={m.pp} × dp={m.dp} × tp={m.tp}",
        f"batch         {plan.training.global_batch} = dp {m.dp} × {plan.microbatches} microbatches"
        f" × {plan.microbatch_size}   schedule {sched}",
        f"step time     {p.step_time_s:.4g} s   {format_flop_rate(p.tflops_per_gpu * 1e12)} per {noun}{tokens}",
        f"  breakdown   compute {b.compute_s:.4g} s · bubble {b.bubble_s:.4g} s · tp {b.tp_comm_s:.4g} s"
        f" · dp {b.dp_comm_s:.4g} s · pp {b.pp_comm_s:.4g} s · optimizer {b.optimizer_s:.4g} s",
        "memory/rank   " + _memory_line(plan),
        f"solver        {plan.solver.status}{gap} in {plan.solver.wall_s:.2f} s"
        f" ({plan.solver.configs_solved} of {plan.solver.configs_considered} configurations solved)",
    ]
    if plan.pins:
        lines.append("pins          " + " ".join(plan.pins))
    rows, header = _layer_rows(plan)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += ["", fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    if plan.notes:
        lines += [""] + [f"note: {note}" for note in plan.notes]
    return "\n".join(line.rstrip() for line in lines)
