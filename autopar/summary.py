"""Render a Plan as a readable table (``plan.summary()`` and ``autopar show``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.plan import LayerPlan, Plan

from autopar.units import format_bytes


def _fold(layers: tuple["LayerPlan", ...]) -> list[tuple[str, "LayerPlan", int]]:
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


def _choices(layer: "LayerPlan") -> tuple:
    return (layer.stage, layer.tp, layer.zero, layer.recompute)


def render_summary(plan: "Plan") -> str:
    p, m = plan.predicted, plan.mesh
    sched = plan.schedule + (f" × {plan.chunks} chunks" if plan.chunks > 1 else "")
    gap = f", gap {plan.solver.gap:.2%}" if plan.solver.gap > 0 else ""
    tokens = f"  ({p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)" if p.tokens_per_s_per_gpu else ""
    b = p.breakdown
    lines = [
        f"autopar plan — {plan.model} on {plan.world_size} × {plan.cluster.get('device', {}).get('name', '?')}"
        f" ({plan.cluster.get('name', '?')}, {plan.training.get('dtype')})",
        f"mesh          pp={m.pp} × dp={m.dp} × tp={m.tp}",
        f"batch         {plan.training.get('global_batch')} = dp {m.dp} × {plan.microbatches} microbatches"
        f" × {plan.microbatch_size}   schedule {sched}",
        f"step time     {p.step_time_s:.4g} s   {p.tflops_per_gpu:.1f} TFLOP/s per GPU{tokens}",
        f"  breakdown   compute {b.compute_s:.4g} s · bubble {b.bubble_s:.4g} s · tp {b.tp_comm_s:.4g} s"
        f" · dp {b.dp_comm_s:.4g} s · pp {b.pp_comm_s:.4g} s · optimizer {b.optimizer_s:.4g} s",
        "memory/rank   " + "  ".join(f"s{j}: {format_bytes(x)}" for j, x in enumerate(p.memory_per_rank_bytes))
        + f"  (budget {format_bytes(p.memory_budget_bytes)})",
        f"solver        {plan.solver.status}{gap} in {plan.solver.wall_s:.2f} s"
        f" ({plan.solver.configs_solved} of {plan.solver.configs_considered} configurations solved)",
    ]
    if plan.pins:
        lines.append("pins          " + " ".join(plan.pins))
    rows = [(label, str(l.stage), l.tp or "-", str(l.zero), "on" if l.recompute else "off")
            for label, l, _ in _fold(plan.layers)]
    header = ("layer", "stage", "tp", "zero", "recompute")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += ["", fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
