"""Public planning API: capture → price → solve → Plan, and baselines to compare.

    graph = autopar.capture(model, (idx,))
    plan = autopar.solve(graph, world_size=64, cluster="a100-80g", global_batch=512)
    print(plan.summary())
    plan.save("plan.json")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from autopar import batch_coupling, contract
from autopar.admission import FLOAT8_AXES
from autopar.choice import BatchCoupling, LossKind
from autopar.cost_models.hardware import ClusterSpec
from autopar.cost_models.memory import PRECISIONS
from autopar.cost_models.presets import load_cluster
from autopar.errors import AutoparError, Float8Error, InfeasibleError, PinError
from autopar.float8 import Float8Settings, emulated
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.plan import LayerPlan, Plan, Predicted, RunnerUp, SolverReport, TrainingSettings
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.notes import (
    choice_notes,
    contract_notes,
    float8_notes,
    idle_axis_notes,
    loss_notes,
    search_notes,
)
from autopar.planning.solver import RUNNERS_UP, Candidate, LossRunnerUp, Solution, SolverOptions
from autopar.planning.solver import solve as _solve
from autopar.units import GiB

PinsLike = Pins | Mapping[str, Any] | Iterable[str] | None
DEFAULT_CLUSTER = "a100-80g"


def resolve_cluster(cluster: str | ClusterSpec | None, world_size: int, *,
                    nodes: int | None = None) -> ClusterSpec:
    """The cluster sized for ``world_size`` (a preset name, a file path or a ClusterSpec)."""
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or DEFAULT_CLUSTER)
    return spec.for_world_size(world_size, nodes)


def memory_budget(cluster: ClusterSpec, memory_gb: float | None) -> int:
    """Per-rank budget in bytes: ``memory_gb`` GiB if given, else device memory less the reserve."""
    if memory_gb is None:
        return cluster.memory_budget_bytes
    if not memory_gb > 0:
        raise AutoparError(f"the memory budget must be positive, got {memory_gb} GiB")
    return int(memory_gb * GiB)


def solve(graph: LayerGraph, world_size: int, *, cluster: str | ClusterSpec | None = None,
          nodes: int | None = None, global_batch: int | None = None, dtype: str = "bf16",
          memory_gb: float | None = None, pins: PinsLike = None, time_limit_s: float = 30.0,
          runners_up: int = RUNNERS_UP, compiled: bool = False, float8: Float8Settings | None = None,
          custom_loss: bool = False) -> Plan:
    """The fastest plan for ``graph`` on ``world_size`` devices that fits in memory.

    ``global_batch`` (samples per step) defaults to ``world_size``; ``memory_gb``
    is the per-rank budget in GiB (default: device memory less the cluster's reserve).
    The plan records the best plans of the next ``runners_up`` distinct configurations
    (``Plan.runners_up``; 0 searches least). ``compiled``: each block priced under
    torch.compile, in the plans the compiled runtime runs
    (:func:`autopar.contract_compile.compile_refusal`). ``float8``: the
    linears that run float8 matmuls (:func:`autopar.float8.settings_for` picks them from the model),
    priced at the device's float8 peak plus the casts, in the plans the float8 runtime runs
    (:data:`FLOAT8_PINS`); a device without float8 matmuls raises :class:`Float8Error` (a CPU cluster
    emulates, unsped). The loss is searched chunked (:class:`~autopar.choice.LossKind`) wherever the
    contract offers it, unless pinned ``loss=full`` or ``custom_loss`` (a loss function of the user's: only the
    default cross-entropy runs chunked); unpinned, the plan's choices are then priced with the whole logits too,
    and hold them where they fit and step faster (:func:`whole_logits_if_faster`). Raises
    :class:`InfeasibleError` when nothing fits, :class:`PinError` for bad pins.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise AutoparError(f"world size must be a positive integer, got {world_size!r}")
    if dtype not in PRECISIONS:
        raise AutoparError(f"dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}")
    batch = world_size if global_batch is None else global_batch
    if not isinstance(batch, int) or batch < 1:
        raise AutoparError(f"batch size must be a positive integer, got {batch!r}")
    spec = resolve_cluster(cluster, world_size, nodes=nodes)
    if float8 is not None:
        emulated(spec)  # a device without float8 matmuls: refused here, naming it
    parsed = Pins.from_any(pins)
    training = TrainingSpec(global_batch=batch, dtype=dtype, compiled=compiled, float8=float8,
                            loss=loss_asked(graph, parsed, custom_loss),
                            batch_coupled=parsed.batch_coupled or BatchCoupling.AUTO)
    if float8 is not None:
        parsed = _restricted_pins(parsed, FLOAT8_PINS, Float8Error, "float8 training")
    solution = _solve(graph, world_size, spec, training, pins=parsed,
                      memory_budget_bytes=memory_budget(spec, memory_gb),
                      options=SolverOptions(time_limit_s=time_limit_s), runners_up=runners_up)
    if parsed.loss is None and training.loss is LossKind.CHUNKED:
        solution, training = whole_logits_if_faster(graph, solution, training)
    return build_plan(graph, solution, spec, training, parsed)


def whole_logits_if_faster(graph: LayerGraph, solution: Solution,
                           training: TrainingSpec) -> tuple[Solution, TrainingSpec]:
    """The loss as a priced choice: the plan's own choices priced with the whole logits held
    (:attr:`LossKind.FULL`), kept where they fit the budget and step faster (no chunk's logits recomputed in
    backward, one GEMM instead of many); the chunked (or vocabulary-parallel) loss where only it fits or it
    is no slower. Only the chosen plan is priced both ways: memory the chunked loss freed may have paid for
    fewer recomputes, and then the whole logits do not fit those choices — it stays chunked. The other
    loss's price is the plan's :attr:`Solution.loss_runner_up`."""
    from autopar.planning.evaluate import evaluate
    from autopar.planning.pricing import PriceTable

    full_training = replace(training, loss=LossKind.FULL)
    table = PriceTable(graph, solution.config, solution.table.cluster, full_training)
    full = evaluate(table, solution.stages, solution.choices)
    fits = full.peak_memory_bytes <= solution.memory_budget_bytes
    if fits and full.step_time_s < solution.prediction.step_time_s:
        return (replace(solution, prediction=full, table=table,
                        loss_runner_up=LossRunnerUp(solution.table.loss, solution.prediction.step_time_s, True)),
                full_training)
    return replace(solution, loss_runner_up=LossRunnerUp(LossKind.FULL, full.step_time_s, fits)), training


def coupling_notes(graph: LayerGraph, dp: int, microbatches: int, training: TrainingSpec) -> tuple[str, ...]:
    """The plan's line for its batch-coupled layers (:func:`autopar.batch_coupling.semantics`), if any."""
    line = batch_coupling.semantics(graph, dp, microbatches, training.batch_coupled, training.global_batch)
    return (line,) if line else ()


def loss_asked(graph: LayerGraph, pins: Pins, custom_loss: bool) -> LossKind:
    """The loss the search prices (:attr:`TrainingSpec.loss`): chunked unless pinned off, a loss function
    was given, or the graph has no head it runs on; a ``loss=chunked`` pin there is a PinError."""
    why = ("a loss function was given (only the default cross-entropy runs chunked)" if custom_loss
           else graph.loss_refusal if graph.loss_head is None else "")
    if pins.loss is LossKind.CHUNKED and why:
        raise PinError(f"pin loss=chunked: the chunked loss does not run here: {why}")
    return LossKind.FULL if why or pins.loss is LossKind.FULL else LossKind.CHUNKED


# What the compiled runtime runs (autopar.runtime.compiled) is searched alone: the search skips the meshes
# contract_compile.compile_refusal refuses (ep or cp beside tp, pp or each other, a pipeline whose stages call no
# block) and the selective or alternate-mm recompute of a block compiled around an eager exchange
# (contract_compile.compiled_break; full recompute runs there, its checkpoint eager around the compiled block), so
# nothing it cannot run is offered.

# What the float8 runtime runs (autopar.runtime.float8): torchao's Float8Linear under DDP or FSDP2, also
# beside cp; no tensor parallelism (autopar's sharding runtime, not torchao's float8 styles), pipelines or experts.
FLOAT8_PINS = tuple(f"{axis}=1" for axis in FLOAT8_AXES)  # what float8 training runs (autopar.admission)


def _restricted_pins(pins: Pins, restriction: tuple[str, ...], error: type[AutoparError], what: str) -> Pins:
    pins.check_form()
    try:
        combined = Pins.parse(pins.to_strings() + [p for p in restriction if p not in pins.to_strings()])
        combined.check_form()
        return combined
    except PinError as exc:
        raise error(f"{what} does not run tensor parallelism, pipelines or expert parallelism yet "
                    f"(its plans are solved with {' '.join(restriction)}): {exc}") from None


def reprice(graph: LayerGraph, plan: Plan, cluster: str | ClusterSpec | None = None, *,
            memory_gb: float | None = None) -> Plan:
    """The same plan priced on ``cluster`` (default: the one it was made for): a new Plan whose
    ``predicted`` and ``cluster`` are replaced, every choice kept. Raises PlanError if the plan
    was made for another graph; it is not re-solved, so it may not be the best plan there."""
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.planning.evaluate import evaluate
    from autopar.planning.pricing import PriceTable

    plan.check_fingerprint(graph.fingerprint())
    spec = (plan.cluster if cluster is None
            else resolve_cluster(cluster, plan.world_size))
    if spec.world_size != plan.world_size:
        spec = spec.for_world_size(plan.world_size)
    if plan.training.float8 is not None:
        emulated(spec)
    training = TrainingSpec(global_batch=plan.training.global_batch, dtype=plan.training.dtype,
                            compiled=plan.training.compiled, float8=plan.training.float8, loss=plan.training.loss,
                            batch_coupled=plan.training.batch_coupled)
    stages = tuple(l.stage for l in plan.layers)
    choices = tuple(l.choice for l in plan.layers)
    # the data-parallel mode the plan lowers in; a choice the search space leaves out is priced all the same
    mode = contract.mode_of(graph, contract.data_ranks(plan.mesh), tuple(c.zero for c in choices), plan.mesh.pp)
    config = Configuration(plan.mesh, plan.microbatches, Schedule(ScheduleKind(plan.schedule), plan.chunks), mode,
                           plan.cp_attention)
    table = PriceTable(graph, config, spec, training)
    prediction = evaluate(table, stages, choices)
    solution = Solution(config, stages, choices, prediction, table, plan.solver.status,
                        plan.solver.gap, plan.solver.wall_s, plan.solver.configs_considered,
                        plan.solver.configs_solved, memory_budget(spec, memory_gb))
    return build_plan(graph, solution, spec, training, Pins.parse(plan.pins))


def plan_model(model: Any, example_inputs: Any, world_size: int, **kwargs: Any) -> Plan:
    """Capture ``model`` with ``example_inputs`` and solve (keywords as :func:`solve`)."""
    from autopar.capturing import capture

    return solve(capture(model, example_inputs), world_size, **kwargs)


def build_plan(graph: LayerGraph, solution: Solution, cluster: ClusterSpec,
               training: TrainingSpec, pins: Pins) -> Plan:
    """Turn the solver's answer into the Plan data users read and passes consume."""
    c, p = solution.config, solution.prediction
    flops = 3.0 * graph.total_flops_per_sample * training.global_batch  # fwd + bwd, no recompute
    step = p.step_time_s
    tokens = (training.global_batch * graph.seq_len / step / c.world_size
              if graph.seq_len and step > 0 else None)
    predicted = Predicted(
        step_time_s=step,
        tflops_per_gpu=flops / step / c.world_size / 1e12 if step > 0 else 0.0,
        tokens_per_s_per_gpu=tokens,
        memory_per_rank_bytes=p.memory_per_rank_bytes,
        memory_budget_bytes=solution.memory_budget_bytes,
        breakdown=p.breakdown,
        stages=p.stages,
        ranks=p.ranks,
        pace=p.pace,
    )
    layers = tuple(LayerPlan(l.name, st, choice) for l, st, choice in zip(graph, solution.stages, solution.choices))
    return Plan(
        fingerprint=graph.fingerprint(), model=graph.model_name, world_size=c.world_size,
        mesh=c.mesh, microbatches=c.microbatches,
        microbatch_size=solution.table.microbatch_size, schedule=c.schedule.kind,
        chunks=c.schedule.chunks, layers=layers, predicted=predicted,
        solver=SolverReport(solution.status, round(solution.wall_s, 4), solution.gap,
                            solution.configs_total, solution.configs_solved),
        cluster=cluster,
        training=TrainingSettings(global_batch=training.global_batch, dtype=training.dtype,
                                  seq_len=graph.seq_len, optimizer="adam", compiled=training.compiled,
                                  float8=training.float8, loss=solution.table.loss,
                                  batch_coupled=training.batch_coupled),
        pins=tuple(pins.to_strings()),
        notes=(contract_notes(graph, solution) + choice_notes(graph, solution)
               + search_notes(solution) + idle_axis_notes(graph, solution, pins, training.global_batch)
               + float8_notes(cluster, training, solution) + loss_notes(graph, solution, pins)
               + coupling_notes(graph, c.mesh.dp, c.microbatches, training)),
        runners_up=tuple(runner_up(graph, r) for r in solution.runners_up),
        cp_attention=c.cp_attention,
    )


def runner_up(graph: LayerGraph, candidate: Candidate) -> RunnerUp:
    """A runner-up as the plan records it: its configuration, what its layers do in a few words,
    its prediction, and the pins that fix its configuration."""
    c, p, table = candidate.config, candidate.prediction, candidate.table
    runs = [table.runs_as(i, s) for i, s in enumerate(candidate.choices)]
    zero = sorted({r.zero for l, r in zip(graph, runs) if l.param_count}) if contract.data_ranks(c.mesh) > 1 else []
    pins = [f"{name}={degree}" for name, degree in c.mesh.items()] + [f"microbatches={c.microbatches}"]
    if c.mesh.pp > 1:
        pins.append(f"schedule={c.schedule.kind.value}")
    if c.schedule.chunks > 1:
        pins.append(f"chunks={c.schedule.chunks}")
    if contract.data_ranks(c.mesh) > 1 and not c.data_parallel.sharded:
        pins.append("zero=0")
    if c.mesh.cp > 1:
        pins.append(f"cp_attention={c.cp_attention}")
    return RunnerUp(
        mesh=c.mesh, microbatches=c.microbatches, schedule=c.schedule.kind,
        chunks=c.schedule.chunks,
        data_parallel=str(c.data_parallel) if contract.data_ranks(c.mesh) > 1 else "none (dp=1)",
        zero=tuple(zero), recomputed=sum(bool(r.recompute) for r in runs), step_time_s=p.step_time_s,
        memory_per_rank_bytes=p.memory_per_rank_bytes, breakdown=p.breakdown, optimal=candidate.optimal,
        pins=tuple(pins), cp_attention=c.cp_attention,
    )


# ---------------------------------------------------------------- baselines


@dataclass(frozen=True)
class BaselineResult:
    """One row of ``autopar compare``: a named strategy priced by the same model."""

    name: str
    plan: Plan | None  # None when it does not fit
    min_memory_bytes: int | None = None
    reason: str = ""  # why it does not fit or apply, in full
    same_as: str | None = None  # the first earlier row whose plan this one is
    note: str = ""  # what the row's plan collapsed to: "same plan as DDP", "tp=1: …"

    @property
    def fits(self) -> bool:
        return self.plan is not None


def _uniform(name: str, pins: list[str]) -> list[tuple[str, list[str]]]:
    return [(name, pins + ["recompute=none"]), (name, pins + ["recompute=all"])]


def baseline_pins(graph: LayerGraph) -> list[tuple[str, list[str]]]:
    """The textbook strategies, as pins; each tried without and with full recompute."""
    styled = []
    for layer in graph:
        names = [s.name for s in layer.tp_styles]
        if names:
            styled.append(f"{layer.name}:tp={'megatron' if 'megatron' in names else names[0]}")
    rows = _uniform("DDP", ["pp=1", "cp=1", "tp=1", "zero=0"])  # textbook: the sequence is not split
    for z in (1, 2, 3):
        rows += _uniform(f"ZeRO-{z}", ["pp=1", "cp=1", "tp=1", f"zero={z}"])
    rows += _uniform("Megatron (tp × dp)", ["pp=1", "cp=1", "zero=0"] + styled)
    rows += _uniform("Megatron (tp × pp × dp, 1F1B)", ["schedule=1f1b", "cp=1", "zero=0"] + styled)
    return rows


CHOSEN = "autopar (chosen)"

# The degree each baseline is named after: solved to 1, the baseline has collapsed into something else.
_DEFINING = {"ZeRO-1": ("dp",), "ZeRO-2": ("dp",), "ZeRO-3": ("dp",), "Megatron (tp × dp)": ("tp",),
             "Megatron (tp × pp × dp, 1F1B)": ("tp", "pp")}
_COLLAPSED = {"dp": "dp=1: there is nothing to shard over",
              "tp": "tp=1: every tp > 1 is slower, does not fit or cannot run",
              "pp": "pp=1: every pp > 1 is slower, does not fit or cannot run"}


def compare(graph: LayerGraph, world_size: int, **kwargs: Any) -> tuple[BaselineResult, list[BaselineResult]]:
    """The chosen plan (row named ``CHOSEN``) beside the baselines, all priced by one cost model."""
    user_pins = list(Pins.from_any(kwargs.pop("pins", None)).to_strings())
    try:
        chosen = BaselineResult(CHOSEN, solve(graph, world_size, pins=user_pins, **kwargs))
    except InfeasibleError as exc:
        chosen = BaselineResult(CHOSEN, None, exc.min_memory_bytes, str(exc))
    best: dict[str, BaselineResult] = {}
    for name, pins in baseline_pins(graph):
        own = f"with this baseline's pins ({_pins_summary(pins)}): "  # not the user's: say whose
        try:
            plan = solve(graph, world_size, pins=pins, **{**kwargs, "runners_up": 0})  # a row needs none
            row = BaselineResult(name, plan)
        except InfeasibleError as exc:
            row = BaselineResult(name, None, exc.min_memory_bytes, own + str(exc))
        except AutoparError as exc:  # e.g. no tp degree admits the styles: not applicable
            row = BaselineResult(name, None, None, own + str(exc))
        best[name] = _better(best.get(name), row)
    return chosen, _mark_collapsed(chosen, list(best.values()))


def _pins_summary(pins: list[str]) -> str:
    """A baseline's pins in a few words (its layer styles counted, not listed; recompute left out,
    since each baseline is tried both without and with it)."""
    own = [p for p in pins if ":" not in p and not p.startswith("recompute=")]
    styled = sum(":tp=" in p for p in pins)
    return ", ".join(own + ([f"a tensor-parallel style on {styled} layers"] if styled else []))


def _plan_key(plan: Plan) -> tuple:
    """What makes two plans the same plan; a tensor-parallel style means nothing at tp=1."""
    tp1 = plan.mesh.tp == 1
    return (plan.mesh, plan.microbatches, plan.microbatch_size, plan.schedule, plan.chunks,
            tuple((l.name, l.stage, None if tp1 else l.choice.tp, l.choice.zero, l.choice.recompute)
                  for l in plan.layers))


def _mark_collapsed(chosen: BaselineResult, baselines: list[BaselineResult]) -> list[BaselineResult]:
    """Each baseline with its note: ``same plan as ROW`` when an earlier row (the chosen one
    first) has its plan, and ``tp=1: …`` when it solved to 1 in the degree it is named after."""
    seen: dict[tuple, str] = {} if chosen.plan is None else {_plan_key(chosen.plan): chosen.name}
    out = []
    for row in baselines:
        if row.plan is None:
            out.append(row)
            continue
        key = _plan_key(row.plan)
        same = seen.setdefault(key, row.name)
        same = None if same == row.name else same
        mesh = row.plan.mesh
        collapsed = [_COLLAPSED[k] for k in _DEFINING.get(row.name, ()) if getattr(mesh, k) == 1]
        words = ([f"same plan as {same}"] if same else []) + collapsed
        note = words[0] + (f" ({'; '.join(words[1:])})" if len(words) > 1 else "") if words else ""
        out.append(replace(row, same_as=same, note=note))
    return out


def _better(a: BaselineResult | None, b: BaselineResult) -> BaselineResult:
    if a is None:
        return b
    if a.fits and b.fits:
        return a if a.plan.predicted.step_time_s <= b.plan.predicted.step_time_s else b
    if a.fits or b.fits:
        return a if a.fits else b
    am, bm = a.min_memory_bytes, b.min_memory_bytes
    return a if (bm is None or (am is not None and am <= bm)) else b
