"""Why this plan and not that one: counterfactuals and runners-up beside the chosen plan.

    autopar explain SPEC --world-size 8 --cluster cpu --why-not pp=2 --why-not 'blocks.*:zero=0'
    autopar explain plan.json                       # the solver's runners-up: no new solve
    autopar explain plan.json --model SPEC --why-not tp=2

A *counterfactual* is the chosen plan's own problem (model, world size,
cluster, batch, precision, memory budget and pins) with more pins, solved
again under the same cost model. It is set beside the chosen plan: predicted
step time, the difference split into the six terms of the plan's breakdown
(compute, bubble, tensor-, data- and pipeline-parallel communication,
optimizer step; the terms add up to the step, so their differences add up to
the difference), and memory per rank against the budget. One sentence sums
each up: how much slower and which term causes it, or which constraint it
breaks and by how much. Without counterfactuals the solver's runners-up are
explained — the best plans of the next distinct configurations, which the
plan records (``Plan.runners_up``) — without solving anything.

``--why-not compile=off`` (or ``compile=on``) asks what torch.compile is worth for the plan:
the plan itself — the same mesh, schedule and layer choices, nothing solved again — priced
eager and compiled (:func:`autopar.planning.api.reprice`), its step time and peak memory set
beside the chosen plan's; ``compile=X`` that is what the plan already does says so, and
``compile=on`` for a plan the compiled runtime does not run says why
(:func:`autopar.contract_compile.compile_refusal`). With other pins beside it, ``compile=X`` solves
again with those pins, compiled or eager as asked; any other counterfactual is solved as the
plan was priced (compiled or eager).

A ``--why-not`` pin that contradicts the plan's own pins is bad input
(:class:`~autopar.errors.PinError`); one that leaves nothing that fits or can
run is an answer, and the sentence says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autopar.errors import AutoparError, CompileError, InfeasibleError, PinError
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.plan import BREAKDOWN_TERMS, Breakdown, Plan, RunnerUp, shown_terms
from autopar.tools.diff import same_plan
from autopar.units import GiB, format_bytes

if TYPE_CHECKING:
    from autopar.graph import LayerGraph

TERMS: tuple[tuple[str, str], ...] = tuple((key, words) for key, _, words in BREAKDOWN_TERMS)
SHORT = {key: short for key, short, _ in BREAKDOWN_TERMS}


@dataclass(frozen=True)
class Figures:
    """What explain sets side by side for one plan: its configuration and its predictions."""

    mesh: Mesh
    microbatches: int
    schedule: str
    data_parallel: str
    step_time_s: float
    breakdown: Breakdown
    memory_per_rank_bytes: tuple[int, ...]
    optimal: bool = True  # False: a runner-up's short solve ran out of time first
    cp_attention: str = "-"  # under cp: allgather, ulysses or ring ("-" at cp = 1, where it is moot)

    @classmethod
    def of_plan(cls, plan: Plan) -> Figures:
        return cls(plan.mesh, plan.microbatches, _schedule_text(plan.schedule.value, plan.chunks),
                   data_parallel_of(plan), plan.predicted.step_time_s, plan.predicted.breakdown,
                   plan.predicted.memory_per_rank_bytes, cp_attention=_cp_text(plan.mesh, plan.cp_attention))

    @classmethod
    def of_runner_up(cls, r: RunnerUp) -> Figures:
        return cls(r.mesh, r.microbatches, _schedule_text(r.schedule.value, r.chunks), r.data_parallel,
                   r.step_time_s, r.breakdown, r.memory_per_rank_bytes, r.optimal, _cp_text(r.mesh, r.cp_attention))

    def term(self, key: str) -> float:
        return getattr(self.breakdown, key)

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": self.mesh.to_dict(), "cp_attention": self.cp_attention, "microbatches": self.microbatches,
                "schedule": self.schedule, "data_parallel": self.data_parallel, "step_time_s": self.step_time_s,
                "breakdown": {k: self.term(k) for k, _ in TERMS},
                "memory_per_rank_bytes": list(self.memory_per_rank_bytes), "optimal": self.optimal}


def data_parallel_of(plan: Plan) -> str:
    """How a plan's data parallelism runs, in the words runners-up use."""
    if plan.mesh.dp * plan.mesh.cp <= 1:
        return "none (dp=1)"
    if all(l.choice.zero == 0 for l in plan.layers):
        return "replicated"
    r = plan.mesh.dp_replicate  # hybrid sharding (autopar.contract_hsdp): ZeRO within a replica
    return f"sharded (HSDP: {plan.mesh.dp // r} dp ranks a replica × {r} replicas)" if r > 1 else "sharded"


def _cp_text(mesh: Mesh, method: Any) -> str:
    return str(method) if mesh.cp > 1 else "-"


def _schedule_text(kind: str, chunks: int) -> str:
    return kind + (f" × {chunks} chunks" if chunks > 1 else "")


@dataclass(frozen=True)
class Counterfactual:
    """One alternative beside the chosen plan: its figures, or why it has none."""

    label: str  # "pp=1", "runner-up 1"
    pins: tuple[str, ...]  # the pins it adds (a runner-up: those that fix its configuration)
    figures: Figures | None  # None: nothing with these pins fits, or it cannot run
    reason: str = ""  # the solver's reason when there are no figures
    binding: str = ""  # "memory", "pins", "time" (the solver's binding constraint) or "cannot run"
    min_memory_bytes: int | None = None  # the least memory per rank any plan with these pins needs
    same_plan: bool = False  # solved with these pins, the solver returns the chosen plan itself
    compiled: bool | None = None  # a compile=on/off counterfactual: the plan priced compiled (True) or eager

    def deltas(self, chosen: Figures) -> dict[str, float]:
        """Each breakdown term, this plan's less the chosen one's: they add up to the step's difference."""
        if self.figures is None:
            return {}
        return {key: self.figures.term(key) - chosen.term(key) for key, _ in TERMS}


@dataclass(frozen=True)
class Explanation:
    """The chosen plan and its alternatives, with one closing sentence each."""

    plan: Plan
    chosen: Figures
    counterfactuals: tuple[Counterfactual, ...]
    runners_up: bool  # True: the alternatives are the plan's runners-up (no solve was made)

    @property
    def budget_bytes(self) -> int:
        return self.plan.predicted.memory_budget_bytes

    def sentence(self, cf: Counterfactual) -> str:
        """How much slower and which term causes it, or which constraint it breaks and by how much."""
        if self.runners_up and cf.figures is not None:  # a runner-up's label says nothing of what it is
            f = cf.figures
            words = [f.mesh.describe(), f.data_parallel] + ([f.schedule] if f.mesh.pp > 1 else [])
            words += [f"cp attention {f.cp_attention}"] if f.mesh.cp > 1 else []
            words += [f"{f.microbatches} microbatches"] if f.microbatches > 1 else []
            cf = replace(cf, label=f"{cf.label} ({', '.join(words)})")
        if cf.figures is None:
            return _why_no_figures(cf, self.budget_bytes)
        alone = cf.compiled is not None and not cf.pins[1:]  # compile=on|off: the plan itself, priced so
        if cf.same_plan and alone:
            return (f"{cf.label}: the chosen plan is already priced {'compiled' if cf.compiled else 'eager'}; ask "
                    f"--why-not compile={'off' if cf.compiled else 'on'} for what torch.compile is worth to it.")
        if cf.same_plan:
            return f"{cf.label}: the chosen plan already does this (solved with it, the solver returns the same plan)."
        if alone:
            return _compile_worth(cf, self.chosen, self.plan)
        return _contrast(cf, self.chosen, self.plan) + _memory_clause(cf.figures, self.budget_bytes) + (
            "" if cf.figures.optimal else " (the best a short solve found: that configuration may do better)") + "."

    def sentences(self) -> list[str]:
        return [self.sentence(cf) for cf in self.counterfactuals]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.plan.model, "fingerprint": self.plan.fingerprint, "runners_up": self.runners_up,
                "memory_budget_bytes": self.budget_bytes, "chosen": self.chosen.to_dict(),
                "counterfactuals": [self._cf_dict(cf) for cf in self.counterfactuals]}

    def _cf_dict(self, cf: Counterfactual) -> dict[str, Any]:
        d: dict[str, Any] = {"label": cf.label, "pins": list(cf.pins), "fits": cf.figures is not None,
                             "compiled": cf.compiled}
        if cf.figures is not None:
            d.update(cf.figures.to_dict(), delta_step_time_s=cf.figures.step_time_s - self.chosen.step_time_s,
                     deltas=cf.deltas(self.chosen), same_plan=cf.same_plan)
        else:
            d.update(reason=cf.reason, binding=cf.binding, min_memory_bytes=cf.min_memory_bytes)
        return {**d, "sentence": self.sentence(cf)}

    def render(self) -> str:
        """The chosen plan and each alternative in columns, then one sentence each."""
        p = self.plan
        what = ("the solver's runners-up, as the plan records them (no new solve)" if self.runners_up
                else "counterfactuals, each solved again with its pins added to the plan's")
        head = [f"autopar explain — {p.model} on {p.world_size} × {p.cluster.device.name} ({p.cluster.name}, "
                f"{p.training.dtype}): {what}"]
        if p.pins:
            head.append(f"the plan's pins: {' '.join(p.pins)}")
        if not self.counterfactuals:
            return "\n".join(head + ["", "the plan records no runners-up: no other configuration fits, or the "
                                         "plan was written before they were kept; ask with --why-not PIN"])
        return "\n".join(head + ["", _table(self), ""] + self.sentences())


def _why_no_figures(cf: Counterfactual, budget: int) -> str:
    if cf.binding == "memory" and cf.min_memory_bytes is not None:
        need = cf.min_memory_bytes
        return (f"{cf.label}: needs {format_bytes(need)} per rank at best > budget {format_bytes(budget)} "
                f"({format_bytes(need - budget)} over), so no plan with it fits.")
    if cf.binding == "cannot run":
        return f"{cf.label}: cannot run: {cf.reason.rstrip('.')}."
    return f"{cf.label}: {cf.reason.rstrip('.')}."


def _contrast(cf: Counterfactual, chosen: Figures, plan: Plan) -> str:
    f, deltas = cf.figures, cf.deltas(chosen)
    diff = f.step_time_s - chosen.step_time_s
    grew = max(deltas, key=lambda k: deltas[k])
    fell = min(deltas, key=lambda k: deltas[k])
    words = dict(TERMS)
    if diff > 0:
        rel = diff / chosen.step_time_s
        slower = f"{_percent(rel)} slower" if rel < 1 else f"{1 + rel:.3g}× as slow"
        text = (f"{cf.label}: {slower} ({_s(f.step_time_s)} a step against "
                f"{_s(chosen.step_time_s)}, {_signed(diff)}), mostly {words[grew]} ({_signed(deltas[grew])})")
        if deltas[fell] < 0:
            text += f", though it saves {_s(-deltas[fell])} of {words[fell]}"
        return text
    if diff == 0:
        return f"{cf.label}: as fast as the chosen plan; the solver kept the plan it found first"
    status = f"solver {plan.solver.status}" + (f", gap {plan.solver.gap:.2%}" if plan.solver.gap else "")
    return (f"{cf.label}: {_percent(-diff / chosen.step_time_s)} faster ({_signed(diff)}), mostly less "
            f"{words[fell]} ({_signed(deltas[fell])}): the chosen plan is not the fastest under these "
            f"options ({status}; a plan file may have been made with other ones)")


def _compile_worth(cf: Counterfactual, chosen: Figures, plan: Plan) -> str:
    """What torch.compile is worth for this plan: the plan priced both ways, step time and peak memory."""
    f = cf.figures
    eager, compiled = (chosen, f) if cf.compiled else (f, chosen)
    saved = eager.step_time_s - compiled.step_time_s
    memory = max(compiled.memory_per_rank_bytes) - max(eager.memory_per_rank_bytes)
    mem = ("the same peak memory per rank" if memory == 0 else
           f"peak memory per rank {'+' if memory > 0 else '−'}{format_bytes(abs(memory))} compiled")
    how = "priced compiled" if cf.compiled else "priced eager"
    head = (f"{cf.label}: this plan {how}: {_s(f.step_time_s)} a step against {_s(chosen.step_time_s)} "
            f"{'eager' if cf.compiled else 'compiled'}")
    if saved == 0:
        return (f"{head}; torch.compile is worth nothing here under this cost model (nothing this plan compiles "
                f"is priced cheaper: a device without an op model, as {plan.cluster.device.name}, prices layers by "
                f"FLOPs alone), {mem}.")
    deltas = {key: eager.term(key) - compiled.term(key) for key, _ in TERMS}
    most = max(deltas, key=lambda k: abs(deltas[k]))
    worth = (f"torch.compile {'saves' if saved > 0 else 'costs'} {_s(abs(saved))} a step "
             f"({_percent(abs(saved) / eager.step_time_s)} of eager), mostly {dict(TERMS)[most]} "
             f"({_signed(-deltas[most])} compiled)")
    tail = "" if plan.training.compiled or not cf.compiled else "; re-plan with --compile to run it"
    return f"{head}: {worth}; {mem}{tail}."


def _memory_clause(f: Figures, budget: int) -> str:
    peak = max(f.memory_per_rank_bytes)
    return f"; peak memory {format_bytes(peak)} per rank of the {format_bytes(budget)} budget"


def _percent(x: float) -> str:
    return f"{x:.1%}" if abs(x) >= 0.001 else f"{x:.3%}"


def _s(seconds: float) -> str:
    """Seconds in the unit that reads best: 0, 12.3 µs, 4.56 ms, 7.89 s."""
    a = abs(seconds)
    if a == 0:
        return "0 s"
    if a < 1e-3:
        return f"{seconds * 1e6:.4g} µs"
    return f"{seconds * 1e3:.4g} ms" if a < 1 else f"{seconds:.4g} s"


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "−") + _s(abs(seconds))


def _with_delta(value: float, chosen: float, cf: Counterfactual | None) -> str:
    """A figure, and beside it how far from the chosen plan's it is (where it is)."""
    return _s(value) + ("" if cf is None or value == chosen else f" ({_signed(value - chosen)})")


def _fits(f: Figures | None, cf: Counterfactual | None) -> str:
    if f is not None:
        return "yes"
    if cf.binding == "memory" and cf.min_memory_bytes is not None:
        return f"no (needs {format_bytes(cf.min_memory_bytes)})"
    if cf.binding == "time":
        return "no plan found in the time limit"
    return "cannot run" if cf.binding == "cannot run" else "no (pins conflict)"


def _table(e: Explanation) -> str:
    """Columns: the chosen plan, then each alternative, every figure with its difference."""
    c = e.chosen
    columns = [("chosen", c, None)] + [(cf.label, cf.figures, cf) for cf in e.counterfactuals]
    rows: list[list[str]] = [[""] + [name for name, _, _ in columns]]

    def row(label: str, cell: Any) -> None:
        rows.append([label] + [cell(f, cf) if f is not None else "-" for _, f, cf in columns])

    row("mesh", lambda f, cf: f.mesh.describe())
    if any(f is not None and f.mesh.cp > 1 for _, f, _ in columns):
        row("cp attention", lambda f, cf: f.cp_attention)
    row("data parallel", lambda f, cf: f.data_parallel)
    row("schedule", lambda f, cf: f.schedule)
    row("microbatches", lambda f, cf: str(f.microbatches))
    row("step time", lambda f, cf: _with_delta(f.step_time_s, c.step_time_s, cf))
    for key, _, _ in shown_terms(*(f.breakdown for _, f, _ in columns if f is not None)):
        row(f"  {SHORT[key]}", lambda f, cf, key=key: _with_delta(f.term(key), c.term(key), cf))
    row("peak memory/rank", lambda f, cf: format_bytes(max(f.memory_per_rank_bytes)))
    if any(f is not None and len(f.memory_per_rank_bytes) > 1 for _, f, _ in columns):
        row("  by pipeline rank", lambda f, cf: " / ".join(format_bytes(x) for x in f.memory_per_rank_bytes))
    rows.append(["fits in " + format_bytes(e.budget_bytes)] + [_fits(f, cf) for _, f, cf in columns])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- building an explanation


def explain(plan: Plan, graph: LayerGraph | None = None, why_not: Sequence[str] = (), *,
            time_limit_s: float = 30.0) -> Explanation:
    """Explain ``plan``: beside each ``why_not`` counterfactual (one or more pins, space-separated,
    added to the plan's own), solved again for ``graph``; without any, beside its runners-up.

    Raises :class:`PinError` when a counterfactual's pins contradict the plan's or name no layer,
    and :class:`PlanError` when ``graph`` is not the model the plan was made for.
    """
    chosen = Figures.of_plan(plan)
    if not why_not:
        return Explanation(plan, chosen, tuple(
            Counterfactual(f"runner-up {n}", r.pins, Figures.of_runner_up(r)) for n, r in enumerate(plan.runners_up, 1)
        ), runners_up=True)
    if graph is None:
        raise AutoparError("a --why-not counterfactual is solved again, which needs the model: give its SPEC")
    plan.check_fingerprint(graph.fingerprint())
    counterfactuals = tuple(counterfactual(plan, graph, why, time_limit_s=time_limit_s) for why in why_not)
    return Explanation(plan, chosen, counterfactuals, runners_up=False)


def explain_model(graph: LayerGraph, world_size: int, why_not: Sequence[str] = (), **solve_kwargs: Any) -> Explanation:
    """Solve ``graph`` (keywords as :func:`autopar.solve`) and explain the plan it gives."""
    from autopar.planning.api import solve

    plan = solve(graph, world_size, **solve_kwargs)
    return explain(plan, graph, why_not, time_limit_s=solve_kwargs.get("time_limit_s", 30.0))


def with_pins(plan: Plan, graph: LayerGraph, extra: Sequence[str]) -> Pins:
    """The plan's pins and ``extra`` together, checked against each other and the model's layers."""
    if not extra:
        raise PinError("--why-not needs a pin, e.g. --why-not tp=8 or --why-not 'blocks.*:zero=0'")
    try:
        pins = Pins.parse([*plan.pins, *extra])
        pins.check_form()
        pins.resolve_layers([layer.name for layer in graph])
    except PinError as exc:
        theirs = ", ".join(plan.pins) if plan.pins else "none"
        raise PinError(f"--why-not {' '.join(extra)} with the plan's pins ({theirs}): {exc}") from None
    return pins


COMPILE_KEY = "compile"  # --why-not compile=on|off: the plan priced compiled or eager, not a pin
_ON_OFF = {"on": True, "true": True, "off": False, "false": False}


def _compile_asked(extra: tuple[str, ...]) -> tuple[bool | None, tuple[str, ...]]:
    """``compile=on|off`` among ``extra`` (None where absent), and the pins beside it."""
    asked = [t for t in extra if t.split("=", 1)[0] == COMPILE_KEY]
    if not asked:
        return None, extra
    values = {t.split("=", 1)[1].lower() if "=" in t else "" for t in asked}
    if len(values) > 1 or not values <= set(_ON_OFF):
        raise PinError(f"--why-not {' '.join(asked)}: compile takes on or off, once (compile=off, compile=on)")
    return _ON_OFF[values.pop()], tuple(t for t in extra if t not in asked)


def counterfactual(plan: Plan, graph: LayerGraph, why: str, *, time_limit_s: float = 30.0) -> Counterfactual:
    """The plan's problem solved again with ``why``'s pins added (see :func:`explain`); ``compile=on|off``
    alone prices the plan itself compiled or eager (:func:`compile_counterfactual`)."""
    from autopar.planning.api import solve

    extra = tuple(why.split())
    compiled, rest = _compile_asked(extra)
    label = " ".join(extra)
    if compiled is not None and not rest:
        return compile_counterfactual(plan, graph, compiled)
    pins = with_pins(plan, graph, rest)
    asked = plan.training.compiled if compiled is None else compiled
    try:
        other = solve(graph, plan.world_size, cluster=plan.cluster, global_batch=plan.training.global_batch,
                      dtype=plan.training.dtype, memory_gb=plan.predicted.memory_budget_bytes / GiB, pins=pins,
                      time_limit_s=time_limit_s, runners_up=0, compiled=asked)
    except InfeasibleError as exc:
        return Counterfactual(label, extra, None, str(exc), exc.binding, exc.min_memory_bytes, compiled=compiled)
    except PinError as exc:  # consistent pins that no configuration can run (a degree, a style)
        return Counterfactual(label, extra, None, str(exc), "cannot run", compiled=compiled)
    except CompileError as exc:  # what compile does not run, pinned or left by the pins
        return Counterfactual(label, extra, None, str(exc), "cannot run", compiled=compiled)
    return Counterfactual(label, extra, Figures.of_plan(other), same_plan=same_plan(other, plan), compiled=compiled)


def compile_counterfactual(plan: Plan, graph: LayerGraph, compiled: bool) -> Counterfactual:
    """``plan`` itself — every choice kept — priced compiled or eager: what torch.compile is worth for it."""
    from autopar.admission import compiled_refusals
    from autopar.planning.api import reprice

    label = f"{COMPILE_KEY}={'on' if compiled else 'off'}"
    if compiled == plan.training.compiled:
        return Counterfactual(label, (label,), Figures.of_plan(plan), same_plan=True, compiled=compiled)
    if compiled and (why := compiled_refusals(plan, graph)):
        return Counterfactual(label, (label,), None, f"torch.compile does not run {' and '.join(why)}",
                              "cannot run", compiled=compiled)
    flipped = replace(plan, training=replace(plan.training, compiled=compiled))
    other = reprice(graph, flipped, memory_gb=plan.predicted.memory_budget_bytes / GiB)
    return Counterfactual(label, (label,), Figures.of_plan(other), compiled=compiled)
