"""``autopar tune --html``: predicted against measured, before and after the refit, beside the plan kept."""

from __future__ import annotations

import html
from typing import Any

from autopar.tools import pictures
from autopar.tools.tune.search import TuneResult


def draw_fidelity(result: TuneResult) -> Any:
    """Each candidate that ran: its predicted step time before (hollow) and after (filled) the refit
    against its measured one, on log axes, with the line where they are equal and ±15 % around it."""
    plt = pictures._pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    ran = [(i, c) for i, c in enumerate(result.candidates) if c.status == "ok"]
    xs = [c.measured_s * 1e3 for _, c in ran]
    ys = [y * 1e3 for _, c in ran for y in (c.predicted_before_s, c.predicted_after_s) if y]
    lo, hi = min(xs + ys) / 1.3, max(xs + ys) * 1.3
    ax.plot([lo, hi], [lo, hi], color="#888", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="#ddd", alpha=0.6,
                    label="±15 %")
    for i, c in ran:
        m = c.measured_s * 1e3
        ax.scatter([m], [c.predicted_before_s * 1e3], facecolors="none", edgecolors="C3", s=60,
                   label="before the refit" if i == ran[0][0] else None)
        ax.scatter([m], [c.predicted_after_s * 1e3], color="C0", s=60, label="after" if i == ran[0][0] else None)
        ax.annotate(f"{i + 1}{' (kept)' if i == result.chosen else ''}", (m, c.predicted_after_s * 1e3),
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


def tune_html(result: TuneResult, table: str) -> str:
    """One self-contained page: tune's table, the picture above, and the plan kept (as ``show --html``)."""
    body = [f"<pre>{html.escape(table)}</pre>", pictures._img(draw_fidelity(result), "predicted against measured")]
    plan = result.plan
    if plan.predicted.stages:
        body.append(pictures._plan_section("the plan kept", plan))
    return pictures._page(f"autopar tune — {plan.model} on {plan.world_size} × {plan.cluster.device.name}", body)
