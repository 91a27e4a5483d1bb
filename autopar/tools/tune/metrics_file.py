"""``autopar calibrate --from-metrics``: the refit ``autopar tune`` makes, from a training run's metrics file.

A run's metrics file (:mod:`autopar.runtime.metrics`: one JSON object a report, each with the mean
``step_time_s`` of the steps since the report before, and the plan's own prediction beside it) is
one plan measured for many steps: the same evidence as one tune candidate, for longer. Its reports
after the first ``skip`` steps (warm-up: the first step builds the optimizer state, and DDP rebuilds
its buckets in the second) give the measured step time, their median weighted by the steps each
covers; the plan that wrote the file is repriced under the moved figures (:mod:`.refit`). A file
written by another plan (its predictions differ from this plan's on its own cluster, or its world
size does) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.plan import Plan

SKIP_STEPS = 2  # warm-up steps left out (module docstring)
SAME_PLAN = 1e-3  # relative difference of the file's predicted step time from the plan's: another plan beyond it


def read_reports(path: str | Path) -> list[dict[str, Any]]:
    """The file's reports, in order; a line that is not a JSON object is bad input, named by its number."""
    reports = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AutoparError(f"{path}:{n}: not a metrics report ({exc.msg}); give the --metrics-file a "
                               "training run wrote") from None
        if not isinstance(r, dict) or "step" not in r or "step_time_s" not in r:
            raise AutoparError(f"{path}:{n}: a metrics report needs 'step' and 'step_time_s'")
        reports.append(r)
    if not reports:
        raise AutoparError(f"{path} holds no metrics reports")
    return reports


def measured_step_s(reports: list[dict[str, Any]], skip: int = SKIP_STEPS) -> float:
    """The median step time over the steps after ``skip``, each report counted for the steps it covers."""
    weighted = []
    gaps = [b["step"] - a["step"] for a, b in zip(reports, reports[1:])]
    # the first report covers the steps since the one before it; where the file starts later than step 0
    # (a file cut to a window) that is the gap the next report has
    previous = reports[0]["step"] - min(reports[0]["step"] + 1, gaps[0] if gaps and gaps[0] > 0 else 1)
    for r in reports:
        steps = r["step"] - previous
        previous = r["step"]
        if r["step"] >= skip and r["step_time_s"] and steps > 0:
            weighted.append((float(r["step_time_s"]), steps))
    if not weighted:
        raise AutoparError(f"the metrics file reports no step after the first {skip} (warm-up): train longer")
    weighted.sort()
    half, seen = sum(w for _, w in weighted) / 2.0, 0
    for value, w in weighted:
        seen += w
        if seen >= half:
            return value
    return weighted[-1][0]


def check_same_plan(reports: list[dict[str, Any]], plan: Plan, path: str | Path) -> None:
    """Refuse a file another plan wrote: its world size, or its predicted step time, differs."""
    r = reports[-1]
    if r.get("world_size") not in (None, plan.world_size):
        raise AutoparError(f"{path} was written by a run on {r['world_size']} ranks, the plan is for "
                           f"{plan.world_size}: give the plan that run trained with")
    predicted = (r.get("plan") or {}).get("step_time_s")
    if predicted and abs(predicted / plan.predicted.step_time_s - 1.0) > SAME_PLAN:
        raise AutoparError(f"{path} was written by another plan (it predicted {predicted:.4g} s a step, this plan "
                           f"{plan.predicted.step_time_s:.4g} s): give the plan that run trained with")
