"""``autopar compare``'s table: the chosen plan beside the baselines, each with its step time, how much slower
than the chosen one it is, and its memory, or why it has no plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autopar.mesh import Mesh
from autopar.units import format_bytes, format_flop_rate

if TYPE_CHECKING:
    from autopar.planning.api import BaselineResult

def _row(result: BaselineResult, chosen_s: float | None) -> dict[str, Any]:
    plan = result.plan
    if plan is None:
        return {"name": result.name, "fits": False, "min_memory_bytes": result.min_memory_bytes,
                "reason": result.reason}
    step = plan.predicted.step_time_s
    return {
        "name": result.name, "fits": True,
        "mesh": plan.mesh.to_dict(),
        "microbatches": plan.microbatches, "step_time_s": step,
        "tflops_per_gpu": plan.predicted.tflops_per_gpu,
        "peak_memory_bytes": max(plan.predicted.memory_per_rank_bytes, default=0),
        "vs_chosen": step / chosen_s if chosen_s else None,
        "same_as": result.same_as, "note": result.note,
    }


def compare_rows(chosen: BaselineResult, baselines: Sequence[BaselineResult]) -> list[dict[str, Any]]:
    """Rows of ``autopar compare``: the chosen plan first, then each baseline (JSON-ready)."""
    chosen_s = chosen.plan.predicted.step_time_s if chosen.plan is not None else None
    return [_row(b, chosen_s) for b in (chosen, *baselines)]


def _cells(row: dict[str, Any], footnote: int | None) -> list[str]:
    if not row["fits"]:
        need = row.get("min_memory_bytes")
        mark = f" [{footnote}]" if footnote else ""
        fits = f"no (needs {format_bytes(need)}){mark}" if need else f"no{mark}"
        return [row["name"], "-", "-", "-", "-", "-", fits, "-", ""]
    m, ratio = row["mesh"], row["vs_chosen"]
    return [row["name"], Mesh.of(m).describe(" "), str(row["microbatches"]),
            f"{row['step_time_s']:.4g}", format_flop_rate(row["tflops_per_gpu"] * 1e12),
            format_bytes(row["peak_memory_bytes"]), "yes", f"{ratio:.2f}×" if ratio else "-",
            row.get("note", "")]


def render_compare(rows: list[dict[str, Any]], *, device: str = "GPU") -> str:
    """The compare rows as an aligned text table; why each row that does not fit fails, in full,
    as numbered notes below it. ``device`` names what the per-device column counts ("GPU", "rank")."""
    header = ["strategy", "mesh", "microbatches", "step (s)", f"FLOP/s per {device}",
              "peak memory/rank", "fits", "vs chosen", "note"]
    notes: list[str] = []
    table = [header]
    for row in rows:
        reason = " ".join(str(row.get("reason") or "").split()) if not row["fits"] else ""
        if reason:
            notes.append(f"[{len(notes) + 1}] {row['name']}: {reason}")
        table.append(_cells(row, len(notes) if reason else None))
    if not any(r[-1] for r in table[1:]):  # no row has a note: no empty column
        table = [r[:-1] for r in table]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + ([""] + notes if notes else []))


# ------------------------------------------------------------------ entry point
