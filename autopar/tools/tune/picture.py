"""Predicted against measured, before and after tune's refit: in ``autopar tune --html`` beside the plan
kept, and in ``autopar show tune.json --html`` from a saved report."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.tools import pictures


def is_report(path: str) -> bool:
    """Whether ``path`` holds a tune report (its JSON has ``candidates`` and ``chosen``), not a plan."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "candidates" in data and "chosen" in data and "layers" not in data


def draw_fidelity(report: dict[str, Any]) -> Any:
    """Each candidate of the report that ran: its predicted step time before (hollow) and after (filled)
    the refit against its measured one, on log axes, with the line where they are equal and ±15 % around it."""
    plt = pictures._pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    ran = [(i, c) for i, c in enumerate(report["candidates"]) if c["status"] == "ok"]
    if not ran:
        raise AutoparError("no candidate of this tune report ran: nothing to draw")
    xs = [c["measured_s"] * 1e3 for _, c in ran]
    ys = [c[k] * 1e3 for _, c in ran for k in ("predicted_before_s", "predicted_after_s") if c[k]]
    lo, hi = min(xs + ys) / 1.3, max(xs + ys) * 1.3
    ax.plot([lo, hi], [lo, hi], color="#888", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="#ddd", alpha=0.6,
                    label="±15 %")
    for n, (i, c) in enumerate(ran):
        m, after = c["measured_s"] * 1e3, c["predicted_after_s"] * 1e3
        ax.scatter([m], [c["predicted_before_s"] * 1e3], facecolors="none", edgecolors="C3", s=60,
                   label="before the refit" if n == 0 else None)
        ax.scatter([m], [after], color="C0", s=60, label="after" if n == 0 else None)
        ax.annotate(f"{i + 1}{' (kept)' if i == report['chosen'] else ''}", (m, after),
                    textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("autopar tune: predicted against measured")
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    return fig


def tune_html(report: dict[str, Any], table: str, plan: Any = None) -> str:
    """One self-contained page: tune's table, the picture above, and the plan kept when at hand
    (drawn as ``show --html`` draws a plan)."""
    body = [f"<pre>{html.escape(table)}</pre>", pictures._img(draw_fidelity(report), "predicted against measured")]
    if plan is not None and plan.predicted.stages:
        body.append(pictures._plan_section("the plan kept", plan))
    return pictures._page("autopar tune — predicted against measured", body)
