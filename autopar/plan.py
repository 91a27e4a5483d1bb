"""The Plan: what was chosen, why, and what it is predicted to cost.

Plain frozen dataclasses with JSON I/O (schema ``autopar.plan/1``), bound to
the captured graph by its fingerprint. Loading never unpickles: a plan file is
JSON text, checked field by field. Inside the program the settings travel as
types (a :class:`ClusterSpec`, a :class:`ScheduleKind`, :class:`TrainingSettings`);
in the file they are the plain JSON they always were.

Besides the totals, a plan records where they come from, as pricing priced
them at solve time: each virtual stage's work per microbatch
(:class:`StageTime`), each pipeline rank's memory by kind and its tail
(:class:`RankCost`), and the solver's runners-up (:class:`RunnerUp`). The
pictures and ``autopar explain`` read these and compute nothing again. They
were added within schema 1: a file without them loads, with them empty.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autopar.choice import BatchCoupling, CpAttention, LayerChoice, LossKind
from autopar.cost_models.hardware import ClusterSpec, CostModelError
from autopar.cost_models.pipeline import V_SHAPED, Schedule, ScheduleKind, rank_stages
from autopar.errors import MeshError, PlanError
from autopar.float8 import Float8Settings
from autopar.mesh import Mesh
from autopar.plan_table import render_summary

SCHEMA = "autopar.plan/1"


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a plan: its name, its virtual stage (pipeline rank = stage mod pp) and what it
    runs as (:class:`~autopar.choice.LayerChoice`)."""

    name: str
    stage: int
    choice: LayerChoice = LayerChoice()

    def to_dict(self) -> dict[str, Any]:
        """The layer's entry in a plan file: name, stage and the choice's fields, flat."""
        return {"name": self.name, "stage": self.stage, **self.choice.to_dict()}


@dataclass(frozen=True)
class Breakdown:
    """Step time on the critical rank, split by cause; the parts add up to the step."""

    compute_s: float
    bubble_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    optimizer_s: float
    ep_comm_s: float = 0.0  # the experts' dispatch and combine all-to-alls (0 in plans written before ep)
    cp_comm_s: float = 0.0  # cp's K/V all-gathers and reduce-scatters, or Ulysses' all-to-alls (0 before cp's line)


# The breakdown's terms in the order every table and picture shows them: (field, short label, long label).
BREAKDOWN_TERMS: tuple[tuple[str, str, str], ...] = (
    ("compute_s", "compute", "compute"), ("bubble_s", "bubble", "pipeline bubble"),
    ("tp_comm_s", "tp comm", "tensor-parallel communication"),
    ("ep_comm_s", "ep comm", "expert-parallel all-to-all"),
    ("cp_comm_s", "cp comm", "context-parallel K/V all-gather or head all-to-all"),
    ("dp_comm_s", "dp comm", "data-parallel communication"), ("pp_comm_s", "pp comm", "pipeline communication"),
    ("optimizer_s", "optimizer", "optimizer step"))


def shown_terms(*breakdowns: Breakdown) -> tuple[tuple[str, str, str], ...]:
    """:data:`BREAKDOWN_TERMS` as a table of these breakdowns shows them: the ep and cp lines only where
    one of them runs experts over ep, or splits the sequence over cp."""
    return tuple(t for t in BREAKDOWN_TERMS
                 if t[0] not in _AXIS_TERMS or any(getattr(b, t[0]) for b in breakdowns))


_AXIS_TERMS = ("ep_comm_s", "cp_comm_s")  # shown only where some plan has them


@dataclass(frozen=True)
class StageTime:
    """One virtual stage's work per microbatch on its pipeline rank, in seconds, as priced.

    ``backward_s`` includes a recomputed forward (and ``backward_tp_s`` its collectives);
    ``send_forward_s`` sends activations to the next stage, ``send_backward_s`` gradients to
    the previous one. A rank's stages add up to its per-microbatch time T_j.
    """

    stage: int
    forward_s: float
    backward_s: float
    forward_tp_s: float
    backward_tp_s: float
    send_forward_s: float
    send_backward_s: float

    @property
    def per_microbatch_s(self) -> float:
        return (self.forward_s + self.backward_s + self.forward_tp_s + self.backward_tp_s
                + self.send_forward_s + self.send_backward_s)


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank (all its dp × tp ranks alike): peak memory by kind, and the tail it adds
    after the pipeline drains. The memory parts add up to its ``memory_per_rank_bytes``."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved activations of the microbatches in flight at the peak
    buffers_bytes: int  # FSDP2's unsharded-gradient and prefetch buffers, DDP's gradient buckets
    workspace_bytes: int  # transient: the largest unit gathered, one layer's activations, the loss
    dp_comm_s: float  # data-parallel traffic not hidden under compute
    optimizer_s: float

    @property
    def memory_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buffers_bytes + self.workspace_bytes)


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    tflops_per_gpu: float
    tokens_per_s_per_gpu: float | None
    memory_per_rank_bytes: tuple[int, ...]
    memory_budget_bytes: int
    breakdown: Breakdown
    stages: tuple[StageTime, ...] = ()  # per virtual stage; empty in plans written before they were kept
    ranks: tuple[RankCost, ...] = ()  # per pipeline rank; likewise
    pace: float = 1.0  # the priced pipeline over m·T + w·(S − T): below 1 where waiting ranks lend cores


@dataclass(frozen=True)
class RunnerUp:
    """The best plan the solver found in another distinct configuration (mesh, or replicated
    against sharded data parallelism), priced like the chosen one: what came next, and why not."""

    mesh: Mesh
    microbatches: int
    schedule: ScheduleKind
    chunks: int
    data_parallel: str  # "replicated", "sharded", "sharded, root ZeRO-2"
    zero: tuple[int, ...]  # the ZeRO stages its layers take
    recomputed: int  # how many layers recompute
    step_time_s: float
    memory_per_rank_bytes: tuple[int, ...]
    breakdown: Breakdown
    optimal: bool  # False: the best CP-SAT found in a runner-up's short solve
    pins: tuple[str, ...]  # pins that fix its configuration (for `autopar plan --pin`)
    cp_attention: CpAttention = CpAttention.ALL_GATHER  # under cp (files written before it: all-gather)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mesh"] = self.mesh.to_dict()
        d["schedule"] = self.schedule.value
        d["cp_attention"] = self.cp_attention.value
        for key in ("zero", "memory_per_rank_bytes", "pins"):
            d[key] = list(d[key])
        return d


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
    ``optimizer`` is the optimizer the memory model priced (``adam``);
    ``compiled``: priced with each block under ``torch.compile`` (fused
    memory-bound ops, :mod:`autopar.cost_models.compute`), and lowered so by
    ``compile`` (plans written before the field load as eager). ``float8``:
    the linears that run float8 matmuls and their scaling recipe
    (:mod:`autopar.float8`), None for none (plans written before the field).
    ``loss``: how the loss runs (:class:`~autopar.choice.LossKind`): ``chunked`` runs the head and
    the cross-entropy a chunk of tokens at a time (:mod:`autopar.runtime.chunked_loss`),
    ``vocab_parallel`` does so on the head's vocabulary shard over tp (:mod:`autopar.runtime.vocab_loss`),
    ``full`` as the model is written (plans written before the field).
    ``batch_coupled``: how layers whose output depends on the batch they see run
    (:class:`~autopar.choice.BatchCoupling`; plans written before the field: auto).
    """

    global_batch: int
    dtype: str
    seq_len: int | None
    optimizer: str
    compiled: bool = False
    float8: Float8Settings | None = None
    loss: LossKind = LossKind.FULL
    batch_coupled: BatchCoupling = BatchCoupling.AUTO

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["float8"] = self.float8.to_dict() if self.float8 is not None else None
        d["loss"] = self.loss.value
        d["batch_coupled"] = self.batch_coupled.value
        return d

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
    schedule: ScheduleKind  # "none", "gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"
    chunks: int
    layers: tuple[LayerPlan, ...]
    predicted: Predicted
    solver: SolverReport
    cluster: ClusterSpec  # ClusterSpec.to_dict() in the file
    training: TrainingSettings
    pins: tuple[str, ...] = ()
    schema: str = SCHEMA
    notes: tuple[str, ...] = field(default_factory=tuple)
    runners_up: tuple[RunnerUp, ...] = ()  # the solver's next distinct configurations, fastest first
    # under cp, how attention sees the whole sequence (K/V all-gather or Ulysses' head all-to-all);
    # a file written before it was a choice loads as all-gather, the one method there was
    cp_attention: CpAttention = CpAttention.ALL_GATHER

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)  # key order is the field order; the typed settings become their JSON
        d["schedule"] = self.schedule.value
        d["cluster"] = self.cluster.to_dict()
        d["training"] = self.training.to_dict()
        d["mesh"] = self.mesh.to_dict()
        d["layers"] = [l.to_dict() for l in self.layers]
        d["predicted"]["memory_per_rank_bytes"] = list(self.predicted.memory_per_rank_bytes)
        d["predicted"]["stages"] = [asdict(x) for x in self.predicted.stages]
        d["predicted"]["ranks"] = [asdict(x) for x in self.predicted.ranks]
        d["pins"], d["notes"] = list(self.pins), list(self.notes)
        d["runners_up"] = [r.to_dict() for r in self.runners_up]
        d["cp_attention"] = self.cp_attention.value
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

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages pipeline rank ``rank`` runs, in order (looped, or in a V for zbv and dualpipev)."""
        return rank_stages(rank, self.mesh.pp, self.stages, self.schedule in V_SHAPED)

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


_TRAINING_FIELDS = ("global_batch", "dtype", "seq_len", "optimizer", "compiled", "float8", "loss", "batch_coupled")


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
        compiled=_require(t, "compiled", bool, source) if "compiled" in t else False,
        float8=(Float8Settings.from_dict(t["float8"], f"{source}.float8")
                if t.get("float8") is not None else None),
        loss=_loss_kind(t, source),
        batch_coupled=_batch_coupled(t, source),
    )


def _batch_coupled(t: dict, source: str) -> BatchCoupling:
    """The ``batch_coupled`` field: auto, exact or split; absent (an older plan) auto."""
    value = t.get("batch_coupled", BatchCoupling.AUTO.value)
    if not isinstance(value, str) or value not in {k.value for k in BatchCoupling}:
        raise PlanError(f"{source}: field 'batch_coupled' is {value!r}; use auto, exact or split")
    return BatchCoupling(value)


def _loss_kind(t: dict, source: str) -> LossKind:
    """The ``loss`` field: ``full``, ``chunked`` or ``vocab_parallel``; absent (an older plan) full."""
    value = t.get("loss", LossKind.FULL.value)
    if not isinstance(value, str) or value not in {k.value for k in LossKind}:
        raise PlanError(f"{source}: field 'loss' is {value!r}; use full, chunked or vocab_parallel")
    return LossKind(value)


def _plan_from_dict(d: Any, source: str) -> Plan:
    if not isinstance(d, dict):
        raise PlanError(f"{source} is not a JSON object")
    schema = d.get("schema")
    if schema != SCHEMA:
        raise PlanError(f"{source} has schema {schema!r}; this autopar reads {SCHEMA!r}")
    try:
        mesh = _mesh_from(_require(d, "mesh", dict, source), source)
        layers = tuple(_layer_from(l, source) for l in _require(d, "layers", list, source))
        p = _require(d, "predicted", dict, source)
        predicted = Predicted(
            step_time_s=float(_require(p, "step_time_s", (int, float), source)),
            tflops_per_gpu=float(_require(p, "tflops_per_gpu", (int, float), source)),
            tokens_per_s_per_gpu=p.get("tokens_per_s_per_gpu"),
            memory_per_rank_bytes=tuple(_require(p, "memory_per_rank_bytes", list, source)),
            memory_budget_bytes=int(_require(p, "memory_budget_bytes", int, source)),
            breakdown=Breakdown(**_require(p, "breakdown", dict, source)),
            stages=tuple(_record(StageTime, x, f"{source}: predicted.stages") for x in p.get("stages", ())),
            ranks=tuple(_record(RankCost, x, f"{source}: predicted.ranks") for x in p.get("ranks", ())),
            pace=float(_require(p, "pace", (int, float), source)) if "pace" in p else 1.0,
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
            runners_up=tuple(_runner_up(r, f"{source}: runners_up") for r in d.get("runners_up", ())),
            cp_attention=_cp_attention(d, source),
        )
    except TypeError as exc:  # unexpected or missing keys in a nested section
        raise PlanError(f"{source} has a malformed section: {exc}") from None
    _check_consistent(plan, source)
    return plan


def _mesh_from(raw: dict, source: str) -> Mesh:
    """The ``mesh`` object: every axis a positive integer; an axis the file leaves out is 1 (a plan
    written before the axis was declared)."""
    try:
        return Mesh.from_dict(raw, source)
    except MeshError as exc:
        raise PlanError(str(exc)) from None


def _layer_from(raw: Any, source: str) -> LayerPlan:
    """One layer entry: name, stage, and its choice (:meth:`LayerChoice.from_dict`: recompute as a
    kind's name or, in plans written before selective recompute, a bool meaning full)."""
    if not isinstance(raw, dict):
        raise PlanError(f"{source}: a layer is not a JSON object")
    try:
        choice = LayerChoice.from_dict(raw, source)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    return LayerPlan(_require(raw, "name", str, source), _require(raw, "stage", int, source), choice)


_INT_FIELDS = {"stage", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
               "workspace_bytes"}


def _record(cls: type, raw: Any, source: str) -> Any:
    """A dataclass of numbers (:class:`StageTime`, :class:`RankCost`) from its JSON object, each field
    checked: integers where the field counts bytes or stages, any number elsewhere."""
    if not isinstance(raw, dict):
        raise PlanError(f"{source}: an entry is not a JSON object")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise PlanError(f"{source}: unknown fields {', '.join(map(repr, unknown))}")
    values = {n: _require(raw, n, int if n in _INT_FIELDS else (int, float), source) for n in names}
    return cls(**{n: v if n in _INT_FIELDS else float(v) for n, v in values.items()})


def _cp_attention(d: dict, source: str) -> CpAttention:
    """The ``cp_attention`` field: ``allgather``, ``ulysses`` or ``ring``; absent (an older plan) all-gather."""
    value = d.get("cp_attention", CpAttention.ALL_GATHER.value)
    if not isinstance(value, str):
        raise PlanError(f"{source}: field 'cp_attention' has the wrong type ({type(value).__name__})")
    try:
        return CpAttention(value)
    except ValueError:
        raise PlanError(f"{source}: field 'cp_attention' is {value!r}; use allgather, ulysses or ring") from None


def _runner_up(r: Any, source: str) -> RunnerUp:
    if not isinstance(r, dict):
        raise PlanError(f"{source}: an entry is not a JSON object")
    return RunnerUp(
        mesh=_mesh_from(_require(r, "mesh", dict, source), source),
        microbatches=_require(r, "microbatches", int, source),
        schedule=_schedule_from_dict(r, source),
        chunks=_require(r, "chunks", int, source),
        data_parallel=_require(r, "data_parallel", str, source),
        zero=tuple(_require(r, "zero", list, source)),
        recomputed=_require(r, "recomputed", int, source),
        step_time_s=float(_require(r, "step_time_s", (int, float), source)),
        memory_per_rank_bytes=tuple(_require(r, "memory_per_rank_bytes", list, source)),
        breakdown=Breakdown(**_require(r, "breakdown", dict, source)),
        optimal=_require(r, "optimal", bool, source),
        pins=tuple(_require(r, "pins", list, source)),
        cp_attention=_cp_attention(r, source),
    )


def _check_consistent(plan: Plan, source: str) -> None:
    if plan.mesh.world_size != plan.world_size:
        raise PlanError(f"{source}: mesh {plan.mesh.describe(all_axes=True)} does not multiply to world size "
                        f"{plan.world_size}")
    try:
        Schedule(plan.schedule, plan.chunks)
    except ValueError as exc:
        raise PlanError(f"{source}: {exc}") from None
    stages = [l.stage for l in plan.layers]
    if any(b < a for a, b in zip(stages, stages[1:])) or (stages and max(stages) >= plan.stages):
        raise PlanError(f"{source}: layer stages must be non-decreasing and below {plan.stages}")
    if plan.cp_attention is not CpAttention.ALL_GATHER and plan.mesh.cp <= 1:
        raise PlanError(f"{source}: cp_attention '{plan.cp_attention}' splits attention over cp ranks, but the mesh "
                        "has cp=1")
    if any(l.choice.zero not in (0, 1, 2, 3) for l in plan.layers):
        raise PlanError(f"{source}: a layer's zero stage is not 0–3")
    p = plan.predicted
    if p.stages and [s.stage for s in p.stages] != list(range(plan.stages)):
        raise PlanError(f"{source}: predicted.stages must list stages 0–{plan.stages - 1} in order")
    if p.ranks and len(p.ranks) != plan.mesh.pp:
        raise PlanError(f"{source}: predicted.ranks has {len(p.ranks)} entries for pp={plan.mesh.pp}")
    if p.ranks and tuple(r.memory_bytes for r in p.ranks) != p.memory_per_rank_bytes:
        raise PlanError(f"{source}: predicted.ranks' memory does not add up to memory_per_rank_bytes")
    if any(r.mesh.world_size != plan.world_size for r in plan.runners_up):
        raise PlanError(f"{source}: a runner-up's mesh does not multiply to world size {plan.world_size}")
