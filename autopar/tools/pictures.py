"""Pictures of a plan: its pipeline timeline, its memory per rank, and a strip of its layers.

Every number drawn is one the plan recorded at solve time from pricing's own
evaluation — ``Plan.predicted.stages`` (each virtual stage's forward, backward,
tensor-parallel and send time per microbatch), ``.ranks`` (each pipeline rank's
memory by kind and its tail), ``.pace`` and each layer's choices — so nothing
is priced a second time, and a plan file draws the same pictures anywhere.

The timeline runs each pipeline rank's actions in the order
``torch.distributed.pipelining`` runs them (GPipe: every forward, then every
backward; 1F1B: ``pp − rank`` warm-up forwards, then one backward and one
forward in turn; interleaved 1F1B: torch's rank order, ``(v − 1)·m/rounds +
2(pp − 1 − rank)`` warm-up forwards over the rank's chunks), each as soon as
its inputs have arrived, for the stage times the plan records; then every
rank's exposed data-parallel traffic and optimizer step after the pipeline
drains, as pricing adds them. Pricing prices the pipeline as
m·T + w·(S − T) (:mod:`autopar.planning.pricing`): the schedule so run takes
exactly that when the stages are equal, and can end a little earlier (1F1B
with unequal stages) or later (interleaved with unequal chunks); the figure
then marks the priced step as well and says by how much they differ.

matplotlib (Agg backend) is imported only to draw, so ``autopar show`` stays
quick and torch-free. Figures become one self-contained HTML page (PNG as
base64, no script, nothing fetched) or PNG files.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.cost_models.pipeline import ScheduleKind
from autopar.errors import AutoparError, PlanError
from autopar.plan import Plan, shown_terms
from autopar.units import GiB, MiB, format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MEMORY_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer state"),
                ("activations_bytes", "activations"), ("buffers_bytes", "buffers"), ("workspace_bytes", "workspace"))
COLOURS = {"forward": "#4c78a8", "backward": "#f58518", "tp": "#b279a2", "send": "#54a24b", "dp": "#e45756",
           "optimizer": "#72b7b2", "idle": "#e8e8e8"}
MEMORY_COLOURS = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#b279a2", "#bab0ac")
LABELS = {"forward": "forward", "backward": "backward (+ recompute)", "tp": "tensor-parallel collectives",
          "send": "pipeline send", "dp": "data-parallel traffic (exposed)", "optimizer": "optimizer step",
          "idle": "idle (bubble)"}


# ---------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Action:
    """One forward (``F``) or backward (``B``) of one microbatch through one virtual stage."""

    stage: int
    kind: str
    microbatch: int


def schedule_order(schedule: ScheduleKind, pp: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Each pipeline rank's actions in the order torch.distributed.pipelining's schedule runs them."""
    m = microbatches
    if schedule is ScheduleKind.NONE or pp == 1:  # gradient accumulation: one microbatch at a time
        return [[Action(0, k, i) for i in range(m) for k in "FB"]]
    if schedule is ScheduleKind.GPIPE:
        return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)]
    if schedule is ScheduleKind.ONE_F_ONE_B:
        return [_one_f_one_b(r, pp, m) for r in range(pp)]
    return [_interleaved(r, pp, m, chunks) for r in range(pp)]


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    """torch's Schedule1F1B: ``pp − rank`` warm-up forwards, then a backward and a forward in turn."""
    warmup = min(m, pp - rank)
    order = [Action(rank, "F", i) for i in range(warmup)]
    for b in range(m):
        order.append(Action(rank, "B", b))
        if warmup + b < m:
            order.append(Action(rank, "F", warmup + b))
    return order


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """torch's ScheduleInterleaved1F1B (``_get_1f1b_rank_ops``): warm-up forwards over the chunks, a
    forward and a backward in turn, then the cool-down backwards, chunks taken ``m/rounds`` at a time."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    done = {"F": [0] * (pp * v), "B": [0] * (pp * v)}

    def take(kind: str, step: int) -> Action:
        if kind == "F":
            local = (step // per_round) % v
        else:
            local = v - 1 - ((step - warmup) // per_round) % v
        stage = local * pp + rank
        done[kind][stage] += 1
        return Action(stage, kind, done[kind][stage] - 1)

    order = [take("F", k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [take("F", k), take("B", k)]
    order += [take("B", k) for k in range(total, total + warmup)]
    return order


# ---------------------------------------------------------------- the timeline


@dataclass(frozen=True)
class Segment:
    """A stretch of one pipeline rank's step: ``kind`` is a key of :data:`COLOURS`."""

    rank: int
    kind: str
    start_s: float
    end_s: float
    stage: int | None = None
    microbatch: int | None = None

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """A plan's step, rank by rank. ``pipeline_s``: when the last backward ends; ``length_s``: with
    the tail; ``priced_s``: the plan's predicted step time."""

    ranks: int
    segments: tuple[Segment, ...]
    pipeline_s: float
    length_s: float
    priced_s: float

    def busy_s(self, rank: int, kinds: tuple[str, ...] = ("forward", "backward")) -> float:
        return sum(s.length_s for s in self.segments if s.rank == rank and s.kind in kinds)

    @property
    def matches_priced(self) -> bool:
        return abs(self.length_s - self.priced_s) <= 1e-9 * max(self.priced_s, 1e-30)


def require_details(plan: Plan) -> None:
    """The pictures need what plans record since they were added; older files lack it."""
    p = plan.predicted
    if not p.stages or not p.ranks:
        raise PlanError(f"the plan for {plan.model} records no per-stage times or per-rank memory (it was "
                        "written before autopar kept them): re-plan it with `autopar plan` to draw it")


def timeline(plan: Plan) -> Timeline:
    """The plan's step as its schedule runs it, every action as soon as its inputs are there, then
    each rank's tail (exposed data-parallel traffic, optimizer step) after the pipeline drains."""
    require_details(plan)
    segments = _pipeline(plan)
    pipeline = max((s.end_s for s in segments), default=0.0)
    segments += _idle(segments, plan.mesh.pp, pipeline)
    for r, cost in enumerate(plan.predicted.ranks):
        dp_end = pipeline + cost.dp_comm_s
        segments += [Segment(r, "dp", pipeline, dp_end), Segment(r, "optimizer", dp_end, dp_end + cost.optimizer_s)]
    tail = max(cost.dp_comm_s + cost.optimizer_s for cost in plan.predicted.ranks)
    return Timeline(plan.mesh.pp, tuple(s for s in segments if s.length_s > 0), pipeline, pipeline + tail,
                    plan.predicted.step_time_s)


def _inputs(a: Action, last_stage: int) -> list[tuple[int, str, int]]:
    """What an action waits for: a forward for the previous stage's forward; a backward for its own
    forward and the next stage's backward."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    return [(a.stage, "F", a.microbatch)] + ([(a.stage + 1, "B", a.microbatch)] if a.stage < last_stage else [])


def _pipeline(plan: Plan) -> list[Segment]:
    """Run every rank's actions in order, each when its inputs have arrived; an action is its
    compute, then its tensor-parallel collectives, then its send, at the plan's pace."""
    pace, stages, pp = plan.predicted.pace, plan.predicted.stages, plan.mesh.pp
    orders = schedule_order(plan.schedule, pp, plan.microbatches, plan.chunks)
    ends: dict[tuple[int, str, int], float] = {}
    clock, nxt, segments = [0.0] * pp, [0] * pp, []
    progressed = True
    while progressed:  # sweep the ranks until none can go on
        progressed = False
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                a = orders[r][nxt[r]]
                inputs = _inputs(a, plan.stages - 1)
                if any(d not in ends for d in inputs):
                    break
                at = max([clock[r]] + [ends[d] for d in inputs])
                st = stages[a.stage]
                parts = ((("forward", st.forward_s), ("tp", st.forward_tp_s), ("send", st.send_forward_s))
                         if a.kind == "F" else
                         (("backward", st.backward_s), ("tp", st.backward_tp_s), ("send", st.send_backward_s)))
                for kind, seconds in parts:
                    segments.append(Segment(r, kind, at, at + seconds * pace, a.stage, a.microbatch))
                    at += seconds * pace
                ends[(a.stage, a.kind, a.microbatch)] = clock[r] = at
                nxt[r] += 1
                progressed = True
    if any(nxt[r] < len(orders[r]) for r in range(pp)):  # the orders come from this module: a bug if so
        raise RuntimeError(f"the {plan.schedule.value} order deadlocks at pp={pp}, m={plan.microbatches}")
    return segments


def _idle(segments: list[Segment], ranks: int, until_s: float) -> list[Segment]:
    """Where each rank waits within the pipeline: the bubble, drawn."""
    idle = []
    for r in range(ranks):
        at = 0.0
        for s in sorted((s for s in segments if s.rank == r), key=lambda s: s.start_s):
            if s.start_s > at:
                idle.append(Segment(r, "idle", at, s.start_s))
            at = max(at, s.end_s)
        if until_s > at:
            idle.append(Segment(r, "idle", at, until_s))
    return idle


def memory_bars(plan: Plan) -> list[dict[str, int]]:
    """Per pipeline rank, the bytes each part of its memory stacks (keys of :data:`MEMORY_PARTS`)."""
    require_details(plan)
    return [{key: getattr(cost, key) for key, _ in MEMORY_PARTS} for cost in plan.predicted.ranks]


# ---------------------------------------------------------------- drawing


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise AutoparError("drawing a plan needs matplotlib: pip install matplotlib "
                           "(or pip install -e '.[test]')") from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _seconds(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s < 1 else f"{s:.4g} s"


def _title(plan: Plan) -> str:
    m = plan.mesh
    sched = plan.schedule.value + (f" × {plan.chunks} chunks" if plan.chunks > 1 else "") if m.pp > 1 else "no pipeline"
    count = f"{plan.microbatches} microbatch{'es' if plan.microbatches > 1 else ''}"
    return f"{plan.model}: {m.describe()}, {sched}, {count}"


def _memory_scale(peak: int, budget: int) -> tuple[float, str, bool]:
    """Unit, its name, and whether the budget line fits on the scale: a budget far above every bar
    would flatten them, so it is then written, not drawn."""
    drawn = budget <= 4 * peak
    top = max(peak, budget) if drawn else peak
    return (GiB, "GiB", drawn) if top >= GiB else (MiB, "MiB", drawn)


def _budget(ax: Any, peak: int, budget: int, unit: float, drawn: bool, *, horizontal: bool = True) -> None:
    label = f"budget {format_bytes(budget)}"
    if drawn:
        (ax.axhline if horizontal else ax.axvline)(budget / unit, color="black", linestyle="--", linewidth=1,
                                                    label=label)
        return
    ax.text(0.98, 0.97, f"{label} ({budget / peak:,.0f}× the peak): above this scale", transform=ax.transAxes,
            ha="right", va="top", fontsize=7)


def draw_timeline(plan: Plan, *, xmax_s: float | None = None) -> Figure:
    """Per pipeline rank, each microbatch's forward and backward in schedule order, the collectives
    and sends inside them, the idle bubble, and the tail after the pipeline drains."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    line = timeline(plan)
    fig, ax = plt.subplots(figsize=(11, 1.9 + 0.45 * line.ranks), layout="constrained")
    actions = sum(1 for s in line.segments if s.kind in ("forward", "backward"))
    groups: dict[tuple[int, str, float], list[tuple[float, float]]] = {}
    for s in line.segments:
        y = line.ranks - 1 - s.rank
        chunk = 0 if s.stage is None else s.stage // plan.mesh.pp  # later chunks of a rank drawn paler
        groups.setdefault((y, s.kind, 1.0 - 0.45 * chunk / plan.chunks), []).append((s.start_s, s.length_s))
        if s.kind in ("forward", "backward") and actions <= 160 and s.length_s > 0.012 * line.length_s:
            ax.text(s.start_s + s.length_s / 2, y, str(s.microbatch), ha="center", va="center", fontsize=7,
                    color="white")
    for (y, kind, shade), spans in groups.items():
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLOURS[kind], alpha=shade, edgecolor="white",
                       linewidth=0.3, hatch="//" if kind in ("send", "idle") else None)
    if not line.matches_priced:
        ax.axvline(line.priced_s, color="black", linestyle="--", linewidth=1)
        ax.text(line.priced_s, line.ranks - 0.45, f" priced step {_seconds(line.priced_s)}", fontsize=8)
    names = ["all ranks"] if line.ranks == 1 else [f"pipeline rank {r}" for r in range(line.ranks)]
    ax.set_yticks(range(line.ranks), names[::-1])
    ax.set_xlim(0, max(xmax_s or 0.0, line.length_s, line.priced_s) * 1.01)
    ax.set_xlabel("seconds into the step")
    gap = line.length_s - line.priced_s
    note = "" if line.matches_priced else (f"; the schedule run with these stage times takes "
                                           f"{_seconds(line.length_s)}, {abs(gap) / line.priced_s:.1%} "
                                           f"{'more' if gap > 0 else 'less'}")
    ax.set_title(f"{_title(plan)}\nstep {_seconds(line.priced_s)} as priced{note}", fontsize=9)
    kinds = [k for k in COLOURS if any(s.kind == k for s in line.segments)]
    fig.legend(handles=[Patch(facecolor=COLOURS[k], hatch="//" if k in ("send", "idle") else None, label=LABELS[k])
                        for k in kinds], loc="outside lower center", ncol=min(4, len(kinds)), fontsize=8, frameon=False)
    return fig


def draw_memory(plan: Plan) -> Figure:
    """Per pipeline rank, parameters, gradients, optimizer state, activations, buffers and workspace
    stacked, against the budget line."""
    plt = _pyplot()
    bars = memory_bars(plan)
    budget, peak = plan.predicted.memory_budget_bytes, max(plan.predicted.memory_per_rank_bytes)
    unit, name, drawn = _memory_scale(peak, budget)
    fig, ax = plt.subplots(figsize=(max(5.5, 2.2 + 0.7 * len(bars)), 4), layout="constrained")
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for (key, label), colour in zip(MEMORY_PARTS, MEMORY_COLOURS):
        heights = [b[key] / unit for b in bars]
        ax.bar(xs, heights, bottom=bottom, color=colour, label=label, width=0.6)
        bottom = [a + h for a, h in zip(bottom, heights)]
    _budget(ax, peak, budget, unit, drawn)
    for x, total in zip(xs, plan.predicted.memory_per_rank_bytes):
        ax.text(x, total / unit, format_bytes(total), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), ["all ranks"] if len(bars) == 1 else [f"rank {j}" for j in xs])
    ax.set_ylabel(f"peak memory per rank ({name})")
    ax.set_ylim(0, (max(budget, peak) if drawn else peak) / unit * 1.15)
    ax.set_title(f"memory per pipeline rank: {plan.model}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


_FIXED = {"ZeRO": {"0": "#c6dbef", "1": "#6baed6", "2": "#2171b5", "3": "#08306b", "- (dp=1)": "#dddddd"},
          "recompute": {"none": "#dddddd", "selective": "#fdd0a2", "alternate_mm": "#fd8d3c", "full": "#d94801"}}


def draw_layers(plan: Plan) -> Figure:
    """A strip of the layers, one row each for stage, tensor-parallel style, ZeRO stage and recompute."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    rows = (("stage", [str(l.stage) for l in plan.layers]),
            ("tp style", [(l.choice.tp or "none") + ("+sp" if l.choice.sp and l.choice.tp else "")
                          if plan.mesh.tp > 1 else "none"
                          for l in plan.layers]),
            ("ZeRO", [str(l.choice.zero) if plan.mesh.dp * plan.mesh.cp > 1 else "- (dp=1)" for l in plan.layers]),
            ("recompute", [str(l.choice.recompute) for l in plan.layers]))
    n = len(plan.layers)
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 0.6 * len(rows) + 1.1), layout="constrained", sharex=True)
    palette = plt.get_cmap("tab20").colors
    for ax, (label, values) in zip(axes, rows):
        kinds = sorted(set(values), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        colour = _FIXED.get(label) or {k: "#dddddd" if k == "none" else palette[i % len(palette)]
                                       for i, k in enumerate(kinds)}
        for k in kinds:
            ax.broken_barh([(i, 1) for i, v in enumerate(values) if v == k], (-0.5, 1), facecolors=colour[k],
                           edgecolor="white", linewidth=0.5)
        if n <= 40:  # room to write each layer's value in its cell
            for i, v in enumerate(values):
                ax.text(i + 0.5, 0, v if len(v) <= 4 else v[:3] + "…", ha="center", va="center", fontsize=6,
                        color="white" if _dark(colour[v]) else "black")
        ax.set_yticks([0], [label])
        ax.set_ylim(-0.5, 0.5)
        ax.set_xlim(0, n)
        shown = kinds[:12]
        ax.legend(handles=[Patch(facecolor=colour[k], label=k) for k in shown], fontsize=7, frameon=False,
                  loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 + (len(shown) - 1) // 3)
    step = max(1, n // 16)
    axes[-1].set_xticks([i + 0.5 for i in range(0, n, step)], [plan.layers[i].name for i in range(0, n, step)],
                        rotation=60, ha="right", fontsize=7)
    axes[0].set_title(f"layers of {plan.model} ({n}): what each one does", fontsize=9)
    return fig


def _dark(colour: Any) -> bool:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return 0.299 * r + 0.587 * g + 0.114 * b < 0.5


def draw_comparison(plans: list[tuple[str, Plan]]) -> Figure:
    """Step time split into the plan breakdown's terms, and peak memory against the budget, per row."""
    plt = _pyplot()
    terms = [(key, label.removesuffix(" comm"))
             for key, label, _ in shown_terms(*(p.predicted.breakdown for _, p in plans))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.6 + 0.45 * len(plans)), layout="constrained",
                                      sharey=True)
    ys = list(range(len(plans)))[::-1]
    at = [0.0] * len(plans)
    for (key, label), colour in zip(terms, (*MEMORY_COLOURS, "#54a24b")):
        widths = [getattr(p.predicted.breakdown, key) for _, p in plans]
        left.barh(ys, widths, left=at, color=colour, label=label)
        at = [a + w for a, w in zip(at, widths)]
    left.set_yticks(ys, [name for name, _ in plans])
    left.set_xlabel("predicted step time (s)")
    fig.legend(fontsize=7, ncol=6, frameon=False, loc="outside lower left")
    budget = plans[0][1].predicted.memory_budget_bytes
    peak = max(max(p.predicted.memory_per_rank_bytes) for _, p in plans)
    unit, name, drawn = _memory_scale(peak, budget)
    right.barh(ys, [max(p.predicted.memory_per_rank_bytes) / unit for _, p in plans], color="#9d755d")
    _budget(right, peak, budget, unit, drawn, horizontal=False)
    right.set_xlim(0, (max(budget, peak) if drawn else peak) / unit * 1.15)
    right.set_xlabel(f"peak memory per rank ({name})")
    if drawn:
        right.legend(fontsize=7, frameon=False, loc="lower right")
    return fig


def figures(plan: Plan, *, xmax_s: float | None = None) -> dict[str, Figure]:
    """The three pictures of a plan, by file stem."""
    return {"timeline": draw_timeline(plan, xmax_s=xmax_s), "memory": draw_memory(plan), "layers": draw_layers(plan)}


# ---------------------------------------------------------------- files


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    _pyplot().close(fig)
    return buffer.getvalue()


def write_pngs(plan: Plan, directory: str | Path) -> list[Path]:
    """timeline.png, memory.png and layers.png of the plan, in ``directory`` (made if missing)."""
    require_details(plan)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, fig in figures(plan).items():
        path = out / f"{stem}.png"
        path.write_bytes(_png(fig))
        paths.append(path)
    return paths


_STYLE = ("body{font-family:sans-serif;margin:24px;color:#222}pre{background:#f6f6f6;padding:12px;"
          "overflow-x:auto;font-size:12px}img{max-width:100%;display:block;margin:8px 0 20px}"
          "section{border-top:1px solid #ccc;padding-top:8px;min-width:0}"
          ".plans{display:grid;grid-template-columns:repeat(auto-fit,minmax(720px,1fr));gap:24px}")


def _img(fig: Figure, alt: str) -> str:
    data = base64.b64encode(_png(fig)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _plan_section(name: str, plan: Plan, *, xmax_s: float | None = None) -> str:
    parts = [f"<section><h2>{html.escape(name)}</h2>", f"<pre>{html.escape(plan.summary())}</pre>"]
    for stem, fig in figures(plan, xmax_s=xmax_s).items():
        parts.append(f"<h3>{stem}</h3>" + _img(fig, f"{stem} of {name}"))
    return "\n".join(parts + ["</section>"])


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n")


def plan_html(plan: Plan) -> str:
    """One self-contained page: the plan's summary, timeline, memory and layer strip."""
    require_details(plan)
    return _page(f"autopar plan — {plan.model} on {plan.world_size} × {plan.cluster.device.name}",
                 [_plan_section("chosen plan", plan)])


def compare_html(table: str, plans: list[tuple[str, Plan]]) -> str:
    """The compare table, step time and memory of every row that fits side by side, then each plan's
    pictures on one time scale (a row that collapsed into an earlier one is not drawn twice)."""
    for _, plan in plans:
        require_details(plan)
    body = [f"<pre>{html.escape(table)}</pre>"]
    if not plans:
        return _page("autopar compare — no strategy fits", body)
    body.append(_img(draw_comparison(plans), "step time and peak memory per strategy"))
    xmax = max(p.predicted.step_time_s for _, p in plans)
    body += ['<div class="plans">'] + [_plan_section(name, plan, xmax_s=xmax) for name, plan in plans] + ["</div>"]
    first = plans[0][1]
    return _page(f"autopar compare — {first.model} on {first.world_size} × {first.cluster.device.name}", body)


def write_html(path: str | Path, page: str) -> Path:
    out = Path(path)
    out.write_text(page, encoding="utf-8")
    return out
