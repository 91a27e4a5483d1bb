"""Two plans of one model side by side: what differs, by how much, and on which layers.

    autopar diff a.json b.json

Rows for the problem (world size, cluster, precision, batch, budget), the
configuration (mesh, schedule, microbatches, data parallelism), the
predictions (step time and each term of its breakdown, FLOP/s, tokens/s,
memory per pipeline rank) and the solver's report, each marked where the two
differ; then the layers whose strategy differs, runs of consecutive layers
that change alike folded into one line ("blocks.0–23"). A tensor-parallel
style counts as none at tp = 1, as ``autopar compare`` counts it. Plans of
two different models (their graph fingerprints differ) are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from autopar.choice import Recompute
from autopar.errors import PlanError
from autopar.plan import LayerPlan, Plan, shown_terms
from autopar.plan_table import memory_range, wrap_line
from autopar.units import format_bytes, format_flop_rate


def layer_choice(plan: Plan, layer: LayerPlan) -> tuple[int, str | None, int, Recompute]:
    """A layer's strategy as it matters: a style (and its sequence parallelism) means nothing at tp = 1."""
    c = layer.choice
    tp = None if plan.mesh.tp == 1 or c.tp is None else c.tp + ("+sp" if c.sp else "")
    return layer.stage, tp, c.zero, c.recompute


def plan_key(plan: Plan) -> tuple:
    """What makes two plans the same plan (the figures aside)."""
    return (plan.mesh, plan.microbatches, plan.microbatch_size, plan.schedule, plan.chunks, cp_method(plan),
            plan.training.loss, tuple((l.name, *layer_choice(plan, l)) for l in plan.layers))


def cp_method(plan: Plan) -> str:
    """How attention spans a cp plan's sequence (allgather, ulysses or ring); "-" without cp, where it is moot."""
    return str(plan.cp_attention) if plan.mesh.cp > 1 else "-"


def same_plan(a: Plan, b: Plan) -> bool:
    return plan_key(a) == plan_key(b)


@dataclass(frozen=True)
class Row:
    """One figure of both plans: its text in each, whether the values differ, and by how much."""

    label: str
    a: str
    b: str
    differs: bool
    change: str = ""  # "+3.2%" for numbers that differ, "*" for anything else that does


@dataclass(frozen=True)
class LayerChange:
    """A run of consecutive layers whose strategy changes alike from plan a to plan b."""

    layers: str  # "blocks.0–23", "embed", "lm_head … norm (2)"
    count: int
    a: str
    b: str


@dataclass(frozen=True)
class PlanDiff:
    a_name: str
    b_name: str
    model: str
    rows: tuple[Row, ...]
    layers: tuple[LayerChange, ...]

    @property
    def same(self) -> bool:
        """No figure and no layer differs."""
        return not self.layers and not any(r.differs for r in self.rows)

    @property
    def differences(self) -> list[str]:
        """Every difference in a few words: the labels of the rows that differ, then the layer runs."""
        return [r.label.strip() for r in self.rows if r.differs] + [c.layers for c in self.layers]

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a_name, "b": self.b_name, "model": self.model, "same": self.same,
                "rows": [r.__dict__ for r in self.rows], "layers": [c.__dict__ for c in self.layers]}

    def render(self) -> str:
        head = f"autopar diff — {self.a_name} against {self.b_name} ({self.model})"
        if self.same:
            return head + "\nno difference: the same plan with the same figures"
        table = [["", self.a_name, self.b_name, "change"]] + [[r.label, r.a, r.b, r.change] for r in self.rows]
        widths = [max(len(t[i]) for t in table) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        out = [head, "", *lines, ""]
        if not self.layers:
            return "\n".join(out + ["every layer has the same strategy in both plans"])
        count = sum(c.count for c in self.layers)
        out.append(f"layers whose strategy differs ({count} of them, in {len(self.layers)} "
                   f"run{'s' if len(self.layers) > 1 else ''}):")
        width = max(len(c.layers) for c in self.layers)
        out += [line for c in self.layers
                for line in wrap_line(f"  {c.layers.ljust(width)}  {change_text(c.a, c.b)}", width + 4)]
        return "\n".join(out)


def change_text(a: str, b: str) -> str:
    """What changes of a layer's strategy, each field "zero 1 → 2", what stays in parentheses after:
    "zero 1 → 2, recompute selective → none  (stage 1, tp megatron+sp)"."""
    changed, kept = [], []
    for fa, fb in zip(a.split(", "), b.split(", ")):
        key, _, va = fa.partition(" ")
        (kept.append(fa) if fa == fb else changed.append(f"{key} {va} → {fb.partition(' ')[2]}"))
    return ", ".join(changed) + (f"  ({', '.join(kept)})" if kept else "")


def diff_plans(a: Plan, b: Plan, a_name: str = "a", b_name: str = "b") -> PlanDiff:
    """Compare two plans of one model; :class:`PlanError` if they were made for different models."""
    if a.fingerprint != b.fingerprint:
        raise PlanError(f"{a_name} and {b_name} are plans of different models ({a.model}, graph {a.fingerprint}; "
                        f"{b.model}, graph {b.fingerprint}): diff compares two plans of one model")
    return PlanDiff(a_name, b_name, a.model, tuple(_rows(a, b)), tuple(layer_changes(a, b)))


def _recomputed(plan: Plan) -> int:
    """How many layers recompute, whatever the kind."""
    return sum(bool(l.choice.recompute) for l in plan.layers)


def _text_row(label: str, a: Any, b: Any) -> Row:
    return Row(label, str(a), str(b), a != b, "*" if a != b else "")


def _number_row(label: str, a: float | None, b: float | None, show: Any) -> Row:
    text_a, text_b = ("-" if a is None else show(a)), ("-" if b is None else show(b))
    if a == b:
        return Row(label, text_a, text_b, False)
    change = f"{(b - a) / a:+.1%}" if a and b is not None else "*"
    return Row(label, text_a, text_b, True, change)


def _seconds(s: float) -> str:
    return "0 s" if s == 0 else f"{s * 1e3:.4g} ms" if abs(s) < 1 else f"{s:.4g} s"


def _rows(a: Plan, b: Plan) -> list[Row]:
    pa, pb = a.predicted, b.predicted


    def sched(p: Plan) -> str:
        return p.schedule.value + (f" × {p.chunks} chunks" if p.chunks > 1 else "")

    def zeros(p: Plan) -> str:
        data_ranks = p.mesh.dp * p.mesh.cp
        return ",".join(map(str, sorted({l.choice.zero for l in p.layers}))) if data_ranks > 1 else "- (dp=1)"

    def per_rank(p: Plan) -> tuple[int, ...]:
        return p.predicted.memory_per_rank_bytes

    def cluster(p: Plan) -> str:
        return f"{p.cluster.name} ({p.cluster.device.name})"

    def float8(p: Plan) -> str:
        f8 = p.training.float8
        return "-" if f8 is None else f"{f8.recipe.value}, {len(f8.linears)} linears"

    rows = [
        _text_row("world size", a.world_size, b.world_size),
        _text_row("cluster", cluster(a), cluster(b)),
        _text_row("dtype", a.training.dtype, b.training.dtype),
        _text_row("float8", float8(a), float8(b)),
        _text_row("loss", a.training.loss.value, b.training.loss.value),
        _text_row("global batch", a.training.global_batch, b.training.global_batch),
        _number_row("memory budget", pa.memory_budget_bytes, pb.memory_budget_bytes, format_bytes),
        _text_row("mesh", a.mesh.describe(), b.mesh.describe()),
        *([_text_row("cp attention", cp_method(a), cp_method(b))] if a.mesh.cp > 1 or b.mesh.cp > 1 else []),
        _text_row("schedule", sched(a), sched(b)),
        _text_row("microbatches", f"{a.microbatches} × {a.microbatch_size}", f"{b.microbatches} × {b.microbatch_size}"),
        _text_row("zero stages", zeros(a), zeros(b)),
        _text_row("layers recomputed", _recomputed(a), _recomputed(b)),
        _number_row("step time", pa.step_time_s, pb.step_time_s, _seconds),
    ]
    rows += [_number_row(f"  {label}", getattr(pa.breakdown, key), getattr(pb.breakdown, key), _seconds)
             for key, label, _ in shown_terms(pa.breakdown, pb.breakdown)]
    rows += [
        _number_row("FLOP/s per device", pa.tflops_per_gpu, pb.tflops_per_gpu, lambda x: format_flop_rate(x * 1e12)),
        _number_row("tokens/s per device", pa.tokens_per_s_per_gpu, pb.tokens_per_s_per_gpu, lambda x: f"{x:,.0f}"),
        _number_row("peak memory/rank", max(per_rank(a)), max(per_rank(b)), format_bytes),
    ]
    if len(per_rank(a)) > 1 or len(per_rank(b)) > 1:
        rows.append(_text_row("  by pipeline rank", by_rank(per_rank(a)), by_rank(per_rank(b))))
    rows += [
        _text_row("pins", " ".join(a.pins) or "none", " ".join(b.pins) or "none"),
        _text_row("solver", a.solver.status, b.solver.status),
    ]
    return rows


RANKS_WIDTH = 45  # a column's per-rank list: 4 ranks' figures; more are summarised, so a table fits WIDTH


def by_rank(memory: tuple[int, ...]) -> str:
    """Each pipeline rank's peak memory, "a / b / c" where that stays narrow, else their range and the rank
    holding the most: 16 ranks listed made a 300-column table."""
    listed = " / ".join(map(format_bytes, memory))
    if len(listed) <= RANKS_WIDTH:
        return listed
    spread, most = memory_range(memory)
    return f"{spread}, most on rank {most} of {len(memory)}"


def _choice_text(choice: tuple[int, str | None, int, Recompute]) -> str:
    stage, tp, zero, recompute = choice
    return f"stage {stage}, tp {tp or 'none'}, zero {zero}, recompute {Recompute.of(recompute)}"


def layer_changes(a: Plan, b: Plan) -> list[LayerChange]:
    """The layers whose strategy differs, consecutive ones that change alike folded together."""
    runs: list[tuple[list[str], str, str]] = []
    previous = -2
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        ca, cb = _choice_text(layer_choice(a, la)), _choice_text(layer_choice(b, lb))
        if ca == cb:
            continue
        if runs and previous == i - 1 and runs[-1][1:] == (ca, cb):
            runs[-1][0].append(la.name)
        else:
            runs.append(([la.name], ca, cb))
        previous = i
    return [LayerChange(fold_label(names), len(names), ca, cb) for names, ca, cb in runs]


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def fold_label(names: list[str]) -> str:
    """``blocks.0–23`` for consecutively numbered names of one prefix, else ``first … last (n)``."""
    if len(names) == 1:
        return names[0]
    parts = [_NUMBERED.match(n) for n in names]
    if all(parts) and len({p.group(1) for p in parts}) == 1:
        numbers = [int(p.group(2)) for p in parts]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{parts[0].group(1)}{numbers[0]}–{numbers[-1]}"
    return f"{names[0]} … {names[-1]} ({len(names)})"
