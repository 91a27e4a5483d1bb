"""The benchmark suite in one command: a Markdown report with PNG plots.

    python benchmarks/suite.py [--out DIR] [--quick] [--skip-fidelity] [--fidelity-json FILE]
                               [--only PART ...]

Writes DIR/report.md (default DIR: benchmarks/results) and one PNG per plot
beside it, so the figures the README quotes can be regenerated and looked at
together. The parts (``--only`` runs a subset; each section of the report
names the command that reproduces it):

- ``plan-time``: planning time (capture + solve, in this process) of GPT 125M
  → 1T on 8 → 4,096 A100s, plus the one-off import cost (plan_time.py);
- ``compare``: the chosen plan against every baseline of `autopar compare`
  over the case matrix (compare_matrix.py);
- ``calibration``: predictions against published runs (calibration_set.py);
- ``fidelity``: predicted against measured on this machine (fidelity.py, run
  as a subprocess unless ``--skip-fidelity``; ``--fidelity-json`` reads a
  file it wrote instead, and wins over ``--skip-fidelity``).

``--quick`` takes fewer models, world sizes and cases (a smoke run). Progress
goes to stderr. Exit status: 0 when every part ran, 1 when one raised (its
section of the report says why). matplotlib is needed only here
(``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

START = time.perf_counter()  # before the heavy imports, so the suite's wall time includes them

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # noqa: E402
from matplotlib.transforms import Bbox, blended_transform_factory  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import calibration_set  # noqa: E402
import compare_matrix  # noqa: E402
import plan_time  # noqa: E402
import torch  # noqa: E402

PARTS = ("plan-time", "compare", "calibration", "fidelity")
QUICK_MODELS = ("gpt2_small", "gpt3_13b", "gpt3_175b")
QUICK_WORLDS = (8, 512)
QUICK_CASES = {("gpt2-small", "a100-40g"), ("gpt2-xl", "a100-40g"), ("gpt3-13b", "h100-80g"),
               ("resnet18ish", "a100-40g")}
# fidelity goals: Spearman rank correlation of step times, median |measured/predicted − 1|,
# and how far measured peak memory may exceed the prediction
GOAL_SPEARMAN, GOAL_MEDIAN_ERROR, GOAL_MEMORY_RATIO = 0.8, 0.25, 1.10
MiB, GiB = 2**20, 2**30


def log(part: str, message: str) -> None:
    """One progress line on stderr, stamped with the seconds since the suite started."""
    print(f"[{time.perf_counter() - START:6.1f} s] {part}: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ formatting


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A Markdown table; ``right`` says which columns hold numbers (right-aligned)."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def count_text(n: float) -> str:
    """163M, 1.64B, 1.01T: parameter counts as people say them."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


def code(text: str) -> str:
    return f"`{text}`"


def runs_text(repeat: int) -> str:
    return f"the median of {repeat} runs" if repeat > 1 else "a single run"


# ------------------------------------------------------------------ 1. planning time


@dataclass(frozen=True)
class PlanTimeResult:
    """Everything part 1 measured, for its plot and its section."""

    cases: list[plan_time.InProcessCase]
    repeat: int  # each import, capture and solve time is the median of this many
    import_s: float
    warm_up_s: float
    headline: tuple[float, dict] | None  # whole `autopar plan` process for the README headline


def run_plan_time(quick: bool) -> PlanTimeResult:
    """Time the import once, warm the process up, then capture + solve each model × world size."""
    repeat = 1 if quick else 3
    models, worlds = (QUICK_MODELS, QUICK_WORLDS) if quick else (plan_time.MODELS, plan_time.WORLDS)
    log("plan-time", f"fresh interpreter: {plan_time.IMPORTS} (×{repeat})")
    import_s = plan_time.import_seconds(repeat)
    log("plan-time", f"import {import_s:.2f} s; warming up on gpt_tiny")
    warm_up_s, _ = plan_time.timed(lambda: plan_time.time_in_process("gpt_tiny", (8,)))
    cases = []
    for model in models:
        log("plan-time", f"{model}: capture, then solve for W = {', '.join(map(str, worlds))} (×{repeat})")
        for case in plan_time.time_in_process(model, worlds, repeat=repeat):
            log("plan-time", f"  {model} W={case.world}: capture {case.capture_s:.2f} s + solve "
                             f"{case.solve_s:.2f} s, {case.status}")
            cases.append(case)
    headline = None
    if not quick:
        log("plan-time", "whole `autopar plan` process for the README headline")
        headline = plan_time.run_once(*plan_time.HEADLINE[0])
    return PlanTimeResult(cases, repeat, import_s, warm_up_s, headline)


def plot_plan_time(cases: Sequence[plan_time.InProcessCase], path: Path) -> None:
    """Planning seconds against parameters (a line per world) and against world (a line per model)."""
    worlds = sorted({c.world for c in cases})
    models = sorted({c.model for c in cases}, key=lambda m: next(c.params for c in cases if c.model == m))
    colors = plt.get_cmap("tab10")
    fig, (by_size, by_world) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    _plan_time_panel(by_size, cases, "params", "world", [(w, f"W = {w}", colors(i)) for i, w in enumerate(worlds)])
    by_size.legend(handles=legend_handles(by_size), fontsize=8, loc="upper left")
    _plan_time_panel(by_world, cases, "world", "model", [(m, m, colors(i)) for i, m in enumerate(models)])
    by_world.legend(handles=legend_handles(by_world), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    by_size.set_xscale("log")
    by_size.set_xlabel("parameters")
    by_size.set_ylabel("planning time, capture + solve (s)")
    by_size.set_title("against model size")
    by_world.set_xscale("log", base=2)
    by_world.set_xticks(worlds, [str(w) for w in worlds])
    by_world.xaxis.set_minor_formatter(NullFormatter())
    by_world.set_xlabel("world size (GPUs)")
    by_world.set_title("against world size")
    fig.suptitle("Planning time, GPT on A100 80GB, global batch 2 × world")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _plan_time_panel(ax: plt.Axes, cases: Sequence[plan_time.InProcessCase], x: str, group: str,
                     lines: Sequence[tuple[Any, str, Any]]) -> None:
    """One line per (value of ``group``, label, colour), ``x`` against planning time; × marks no plan."""
    for value, label, color in lines:
        points = sorted((c for c in cases if getattr(c, group) == value), key=lambda c: getattr(c, x))
        ax.plot([getattr(c, x) for c in points], [c.plan_s for c in points], "o-", color=color, label=label)
        infeasible = [c for c in points if c.status == "infeasible"]
        ax.plot([getattr(c, x) for c in infeasible], [c.plan_s for c in infeasible], "x", color="black",
                markersize=10, markeredgewidth=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def legend_handles(ax: plt.Axes) -> list[Any]:
    """The panel's lines and the key to the infeasible marker."""
    return [*ax.get_legend_handles_labels()[0],
            Line2D([], [], marker="x", color="black", linestyle="", markersize=8, markeredgewidth=2,
                   label="infeasible (no plan fits)")]


def report_plan_time(result: PlanTimeResult, quick: bool) -> str:
    cases = result.cases
    fastest = min(cases, key=lambda c: c.plan_s)
    slowest = max(cases, key=lambda c: c.plan_s)
    rows = [[c.model, count_text(c.params), str(c.layers), str(c.world), str(c.batch), f"{c.capture_s:.2f}",
             f"{c.solve_s:.2f}", f"{c.plan_s:.2f}", c.status + (f" ({c.note})" if c.note else ""),
             f"{c.gap:.2%}" if c.gap is not None else "—", plan_time.mesh_text(c.mesh)] for c in cases]
    parts = [
        f"Reproduce: {code('python benchmarks/suite.py --only plan-time' + (' --quick' if quick else ''))}"
        " (the in-process timing is `time_in_process` in `benchmarks/plan_time.py`).",
        "",
        "Each model is built on the meta device and captured once; it is then solved for each world "
        "size on `a100-80g` at global batch 2 × world. A case's planning time is the capture time "
        "plus its solve time, measured in one warm interpreter so that the one-off costs below are "
        "paid once and kept apart. Building the model on the meta device is not counted (at most "
        f"{max(c.build_s for c in cases):.2f} s here). Capture and solve times are each "
        f"{runs_text(result.repeat)} on a machine that may be shared, so expect noise of tens of percent.",
        "",
        f"- One-off import: a fresh {code('python -c ' + shlex.quote(plan_time.IMPORTS))} took "
        f"**{result.import_s:.2f} s** ({runs_text(result.repeat)}, interpreter start-up included).",
        f"- First use in this interpreter (build, capture and solve `gpt_tiny`, which pays lazy imports "
        f"such as torch's meta kernels and the first CP-SAT model): {result.warm_up_s:.2f} s.",
    ]
    if result.headline:
        wall, info = result.headline
        model, world, cluster, batch = plan_time.HEADLINE[0]
        parts.append(f"- Whole process, as the README's headline (`autopar plan examples/gpt.py:{model} "
                     f"--world-size {world} --cluster {cluster} --batch-size {batch}`, one run; "
                     f"`python benchmarks/plan_time.py` repeats it): {wall:.2f} s, {info['status']}.")
    parts += [
        f"- Planning time ranged from **{fastest.plan_s:.2f} s** ({fastest.model}, W = {fastest.world}) "
        f"to **{slowest.plan_s:.2f} s** ({slowest.model}, W = {slowest.world}).",
        "",
        "![Planning time against parameters and world size](plan_time.png)",
        "",
        md_table(["model", "parameters", "layers", "world", "batch", "capture s", "solve s", "planning s",
                  "status", "gap", "mesh pp×dp×tp"], rows,
                 [False, True, True, True, True, True, True, True, False, True, False]),
        "",
        "Parameter counts are the built models' own; the GPT examples do not tie the output layer "
        "to the token embedding, so they count more than the sizes they are named after. Layers are "
        "the captured graph's; capture time follows them more closely than the parameter count.",
    ]
    return "\n".join(parts)


# ------------------------------------------------------------------ 2. baselines


def run_compare(quick: bool) -> list[compare_matrix.CaseRow]:
    cases = [c for c in compare_matrix.CASES if not quick or (c[0], c[2]) in QUICK_CASES]
    rows = []
    for row in compare_matrix.case_rows(cases):
        chosen = f"{row.chosen_s:.4g} s" if row.chosen_s is not None else "none fits"
        best = f"{row.best.name} {row.best.step_s:.4g} s" if row.best else "none fits"
        log("compare", f"{case_text(row)}: chosen {chosen}, best baseline {best}")
        rows.append(row)
    return rows


def baseline_names(rows: Sequence[compare_matrix.CaseRow]) -> list[str]:
    """Every baseline name, in the order `autopar compare` lists them."""
    return list(dict.fromkeys(b.name for row in rows for b in row.baselines))


def ratios(row: compare_matrix.CaseRow) -> dict[str, float | None]:
    """Baseline step time / chosen step time per baseline; None when it (or the chosen plan) has none."""
    return {b.name: b.step_s / row.chosen_s if b.step_s is not None and row.chosen_s else None
            for b in row.baselines}


def too_big(baseline: compare_matrix.BaselineStep) -> bool:
    """No step time because nothing fits in memory (else, when there is none: the strategy does not apply)."""
    return baseline.step_s is None and baseline.min_memory_bytes is not None


def case_text(row: compare_matrix.CaseRow, sep: str = " ") -> str:
    memory = f"{sep}{row.memory_gb:g} GiB" if row.memory_gb else ""
    return f"{row.label}{sep}{row.world} × {row.cluster}{memory}"


def plot_compare(rows: Sequence[compare_matrix.CaseRow], path: Path) -> None:
    """Per case, each baseline's step time over the chosen plan's (log y); those without one on a top row."""
    names = baseline_names(rows)
    markers = "osD^vP*X"
    fig, ax = plt.subplots(figsize=(max(8.0, 1.05 * len(rows) + 2.5), 5.5))
    top = blended_transform_factory(ax.transData, ax.transAxes)
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        color = plt.get_cmap("tab10")(j)
        ratio_points, too_big_x, not_applicable_x = [], [], []
        for i, row in enumerate(rows):
            x = i - 0.4 + width * (j + 0.5)
            baseline = next((b for b in row.baselines if b.name == name), None)
            ratio = ratios(row).get(name)
            if ratio is not None:
                ratio_points.append((x, ratio))
            elif baseline is not None and too_big(baseline):
                too_big_x.append(x)
            elif baseline is not None:
                not_applicable_x.append(x)
        ax.scatter([x for x, _ in ratio_points], [r for _, r in ratio_points], marker=markers[j % len(markers)],
                   color=color, s=36, label=name, zorder=3)
        ax.scatter(too_big_x, [0.95] * len(too_big_x), marker="x", color=color, s=30, transform=top, zorder=3)
        ax.scatter(not_applicable_x, [0.95] * len(not_applicable_x), marker="o", facecolors="none",
                   edgecolors=color, s=24, transform=top, zorder=3)
    ax.axhline(1.0, color="black", linewidth=1)
    for i in range(1, len(rows)):
        ax.axvline(i - 0.5, color="grey", linewidth=0.5, alpha=0.4)
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    low = min(low, 0.95)
    ax.set_ylim(low, low * (high / low) ** (1 / 0.9))  # the top tenth is the row of baselines without a time
    ratio_ticks(ax)
    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_xticks(range(len(rows)), [case_text(r, "\n") for r in rows], fontsize=7)
    ax.set_ylabel("baseline step time / chosen step time")
    ax.grid(True, axis="y", which="major", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="x", color="grey", linestyle="", label="does not fit in memory (top row)"),
                Line2D([], [], marker="o", markerfacecolor="none", color="grey", linestyle="",
                       label="does not apply (top row)"),
                Line2D([], [], color="black", linewidth=1, label="chosen plan (= 1)")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Baselines against the chosen plan, priced by the same cost model\n"
                 "(above 1: the baseline is slower)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def ratio_ticks(ax: plt.Axes) -> None:
    """Label a log ratio axis 1×, 1.2×, 2× … instead of powers of ten."""
    low, high = ax.get_ylim()
    steps = [0.5, 0.8, 0.9, 1, 1.05, 1.1, 1.2, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000]
    ticks = [t for t in steps if low <= t <= high]
    if high / low > 3:  # wide range: drop the fine steps so labels do not collide
        ticks = [t for t in ticks if t in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def report_compare(rows: Sequence[compare_matrix.CaseRow], quick: bool) -> str:
    names = baseline_names(rows)
    reasons: list[str] = []  # why a baseline does not apply, footnoted once each
    table = []
    for row in rows:
        by_name, row_ratios = {b.name: b for b in row.baselines}, ratios(row)
        cells = []
        for name in names:
            baseline, ratio = by_name.get(name), row_ratios.get(name)
            if baseline is None:
                cells.append("—")
            elif baseline.step_s is not None:
                cells.append(f"{baseline.step_s:.4g}" + (f" ({ratio:.3f}×)" if ratio is not None else ""))
            elif too_big(baseline):
                cells.append(f"does not fit (needs {baseline.min_memory_bytes / GiB:.1f} GiB)")
            else:
                if baseline.reason not in reasons:
                    reasons.append(baseline.reason)
                cells.append(f"does not apply [{reasons.index(baseline.reason) + 1}]")
        table.append([row.label, row.cluster, str(row.world), str(row.batch),
                      f"{row.memory_gb:g}" if row.memory_gb else "default",
                      f"{row.chosen_s:.4g}" if row.chosen_s is not None else "none fits", *cells])
    baselines = [b for r in rows for b in r.baselines]
    fitted = [(r, n, x) for r in rows for n, x in ratios(r).items() if x is not None]
    parts = [
        f"Reproduce: {code('python benchmarks/suite.py --only compare' + (' --quick' if quick else ''))}; "
        "`python benchmarks/compare_matrix.py` prints the best baseline of each case from the same "
        "rows and exits 1 if any beats the chosen plan.",
        "",
        "Each baseline is the best of its strategy with and without full recompute, priced by the "
        "same cost model as the chosen plan. Cells give the predicted step time in seconds and, in "
        "brackets, baseline / chosen; a baseline that does not fit gives the least memory per rank it "
        "needs against the case's budget.",
        "",
        "![Baseline step time over chosen step time per case](compare.png)",
        "",
        md_table(["model", "cluster", "world", "batch", "memory GiB", "chosen s", *names], table,
                 [False, False, True, True, True, True, *[True] * len(names)]),
        "",
        *[f"[{i}] {reason}  " for i, reason in enumerate(reasons, 1)],
        "",
        f"**{len(rows)} cases, {sum(r.beaten for r in rows)} where a baseline beat the chosen plan.** "
        f"Of {len(baselines)} baseline runs, {sum(map(too_big, baselines))} do not fit in memory and "
        f"{sum(b.step_s is None and not too_big(b) for b in baselines)} do not apply.",
    ]
    if fitted:
        low, high = min(fitted, key=lambda t: t[2]), max(fitted, key=lambda t: t[2])
        parts.append(f"Among baselines that fit, baseline / chosen ranged from {low[2]:.3f}× "
                     f"({low[1]}, {case_text(low[0])}) to {high[2]:.3f}× ({high[1]}, {case_text(high[0])}).")
        best = [(r, r.best.name, r.best.step_s / r.chosen_s) for r in rows if r.best and r.chosen_s]
        low, high = min(best, key=lambda t: t[2]), max(best, key=lambda t: t[2])
        parts.append(f"The best baseline of each case (the figure `compare_matrix.py` prints) was from "
                     f"{low[2]:.3f}× ({low[1]}, {case_text(low[0])}) to {high[2]:.3f}× ({high[1]}, "
                     f"{case_text(high[0])}) slower than the chosen plan.")
    return "\n".join(parts)


# ------------------------------------------------------------------ 3. calibration


def run_calibration() -> list[calibration_set.CalibrationRow]:
    log("calibration", "capturing the Llama models and pricing the published runs")
    rows = calibration_set.calibration_rows()
    for row in rows:
        log("calibration", f"{row.run.name}: tokens/s/GPU {row.tokens_error:+.1%}")
    return rows


def report_calibration(rows: Sequence[calibration_set.CalibrationRow]) -> str:
    errors = [r.tokens_error for r in rows]
    memory = [r.memory_error for r in rows if r.memory_error is not None]
    summary = f"Tokens/s/GPU error from {min(errors):+.1%} to {max(errors):+.1%}"
    if memory:
        summary += f"; peak-memory error from {min(memory):+.1%} to {max(memory):+.1%} where published"
    return "\n".join([
        "Reproduce: `python benchmarks/calibration_set.py` (`--fit` re-derives the presets' "
        "`matmul_efficiency` from these runs, so the tokens/s errors are in-sample).",
        "",
        "Each published torchtitan Llama 3.1 run is priced as the plan it used (FSDP = ZeRO-3 on "
        "every layer, published local batch). Selective activation checkpointing is priced as no "
        "recompute, so the peak memory of those runs is expected to be over-predicted.",
        "",
        calibration_set.render(list(rows)),
        "",
        summary + ".",
    ])


# ------------------------------------------------------------------ 4. fidelity


def run_fidelity(path: Path) -> None:
    """Run fidelity.py as its own process (it launches workers), its output streamed to our stderr."""
    script = HERE / "fidelity.py"
    if not script.exists():
        raise FileNotFoundError(f"{script} does not exist; pass --skip-fidelity or --fidelity-json FILE")
    cmd = [sys.executable, str(script), "--json", str(path)]
    log("fidelity", " ".join(cmd))
    proc = subprocess.run(cmd, stdout=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}")


def plot_measured(plans: Sequence[dict[str, Any]], predicted: str, measured: str, scale: float,
                  quantity: str, unit: str, path: Path, allowance: float | None = None) -> None:
    """Measured against predicted per plan, coloured by world size, with y = x (and the allowance line)."""
    points = [(p["name"], p["world_size"], p[predicted] * scale, p[measured] * scale) for p in plans
              if p.get(predicted) is not None and p.get(measured) is not None]
    if not points:
        raise ValueError(f"no plan has both {predicted} and {measured}")
    values = [v for _, _, pr, me in points for v in (pr, me)]
    lo, hi = min(values), max(values) * (1 + (allowance or 0))
    logscale = hi / lo > 20
    lo, hi = (lo / 1.5, hi * 1.5) if logscale else (max(0.0, lo - 0.1 * (hi - lo)), hi + 0.1 * (hi - lo))
    fig, ax = plt.subplots(figsize=(6.4, 6.0), dpi=120)
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="measured = predicted")
    if allowance:
        ax.plot([lo, hi], [lo * (1 + allowance), hi * (1 + allowance)], "--", color="crimson", linewidth=1,
                label=f"measured = {1 + allowance:g} × predicted (allowed)")
    worlds = sorted({w for _, w, _, _ in points})
    for i, world in enumerate(worlds):
        mine = [pt for pt in points if pt[1] == world]
        ax.scatter([pt[2] for pt in mine], [pt[3] for pt in mine], color=plt.get_cmap("tab10")(i), s=40,
                   zorder=3, label=f"W = {world}")
    if logscale:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel(f"predicted {quantity} ({unit})")
    ax.set_ylabel(f"measured {quantity} ({unit})")
    ax.set_title(f"{quantity.capitalize()}: measured against predicted, per plan")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), frameon=False,
              ncol=min(3, len(ax.get_legend_handles_labels()[0])))
    label_points(ax, [(name, x, y) for name, _, x, y in points])
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def label_points(ax: plt.Axes, points: Sequence[tuple[str, float, float]]) -> None:
    """Name each point where its label covers the fewest other labels and points, trying places
    nearest first and then farther out with a leader line: plans cluster, and stacked names
    cannot be read."""
    ax.figure.canvas.draw()  # settles the layout (equal aspect, limits) that positions depend on
    renderer = ax.figure.canvas.get_renderer()
    # each marker with a margin, so that no label hugs a point it does not name
    markers = [Bbox.from_bounds(px - 9, py - 9, 18, 18)
               for px, py in (ax.transData.transform((x, y)) for _, x, y in points)]
    labels: list[Bbox] = []
    frame = ax.get_window_extent(renderer)  # labels stay off the tick labels and the legend
    for i, (name, x, y) in enumerate(points):
        obstacles = labels + markers[:i] + markers[i + 1:]
        best: tuple[int, Any, Bbox] | None = None
        for dx, dy, leader in LABEL_OFFSETS:
            text = ax.annotate(name, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8,
                               ha="left" if dx > 0 else "right" if dx < 0 else "center",
                               arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.5} if leader else None)
            text.get_window_extent(renderer)  # places the text (and its leader)
            box = Text.get_window_extent(text, renderer).padded(2)  # the words alone, not the leader
            hits = sum(box.overlaps(other) for other in obstacles) + 2 * (not contains(frame, box))
            if best is None or hits < best[0]:
                if best:
                    best[1].remove()
                best = (hits, text, box)
            else:
                text.remove()
            if hits == 0:
                break
        labels.append(best[2])


def contains(outer: Bbox, inner: Bbox) -> bool:
    return outer.contains(inner.x0, inner.y0) and outer.contains(inner.x1, inner.y1)


# label positions tried around a point, in points: nearest first, then farther out with a leader line
LABEL_OFFSETS = [(dx * r, dy * r, r > 6) for r in (6, 16, 28, 42, 60)
                 for dx, dy in ((1, 0.6), (1, -1.2), (-1, 0.6), (-1, -1.2), (0, 1.2), (0, -2.0))]


def goal_rows(data: dict[str, Any]) -> list[list[str]]:
    """The three fidelity goals with the measured value and pass/fail ("—" when not reported)."""
    goals: list[tuple[str, str, Any, Callable[[float], bool], Callable[[float], str]]] = [
        ("Spearman rank correlation of step times", f"≥ {GOAL_SPEARMAN}", data.get("spearman"),
         lambda v: v >= GOAL_SPEARMAN, lambda v: f"{v:.2f}"),
        ("median absolute step-time error", f"≤ {GOAL_MEDIAN_ERROR:.0%}", data.get("median_abs_step_error"),
         lambda v: v <= GOAL_MEDIAN_ERROR, lambda v: f"{v:.1%}"),
        ("worst measured / predicted peak memory", f"≤ {GOAL_MEMORY_RATIO:.2f}", data.get("max_memory_ratio"),
         lambda v: v <= GOAL_MEMORY_RATIO, lambda v: f"{v:.3f}"),
    ]
    return [[name, target, "—" if value is None else text(value),
             "—" if value is None else ("**pass**" if ok(value) else "**FAIL**")]
            for name, target, value, ok, text in goals]


def report_fidelity(data: dict[str, Any], source: str) -> str:
    def num(value: Any, fmt: str, scale: float = 1.0) -> str:
        return "—" if value is None else format(value * scale, fmt)

    rows = [[p["name"], str(p.get("world_size", "—")), p.get("mesh", "—"), p.get("schedule", "—"),
             str(p.get("microbatches", "—")), num(p.get("predicted_step_s"), ".3f"),
             num(p.get("measured_step_s"), ".3f"), num(p.get("step_error"), "+.1%"),
             num(p.get("predicted_peak_bytes"), ".1f", 1 / MiB), num(p.get("measured_peak_bytes"), ".1f", 1 / MiB),
             num(p.get("memory_ratio"), ".3f")] for p in data["plans"]]
    return "\n".join([
        "Reproduce: `python benchmarks/fidelity.py --json fidelity.json` "
        "(or `python benchmarks/suite.py --only fidelity`).",
        "",
        f"Source: {source}. Model: {data.get('model', '—')}. Machine: {data.get('machine', '—')}. "
        f"Steps timed per plan: {data.get('steps', '—')}. Step error is measured / predicted − 1; memory "
        "ratio is measured / predicted peak. The step times share the machine with anything else "
        "running on it, so treat single-plan errors as noisy.",
        "",
        "![Measured against predicted step time](fidelity_time.png)",
        "![Measured against predicted peak memory](fidelity_memory.png)",
        "",
        md_table(["plan", "world", "mesh", "schedule", "microbatches", "predicted s", "measured s", "error",
                  "predicted peak MiB", "measured peak MiB", "memory ratio"], rows,
                 [False, True, False, False, True, True, True, True, True, True, True]),
        "",
        md_table(["goal", "target", "value", "result"], goal_rows(data), [False, False, True, False]),
    ])


def fidelity_section(args: argparse.Namespace, out: Path) -> str:
    """Run fidelity.py (or read the JSON it wrote), plot it and report it."""
    if args.fidelity_json:  # kept beside the report, so the folder is complete
        path, source = out / "fidelity.json", f"`{args.fidelity_json}` (copied to `fidelity.json`; not re-run)"
        if args.fidelity_json.resolve() != path.resolve():
            shutil.copyfile(args.fidelity_json, path)
    elif args.skip_fidelity:
        log("fidelity", "skipped")
        return "Skipped (`--skip-fidelity`). Run `python benchmarks/fidelity.py --json fidelity.json`."
    else:
        path, source = out / "fidelity.json", "`fidelity.json`, run by this suite"
        run_fidelity(path)
    data = json.loads(path.read_text())
    log("fidelity", f"{len(data['plans'])} plans; plotting")
    plot_measured(data["plans"], "predicted_step_s", "measured_step_s", 1.0, "step time", "s",
                  out / "fidelity_time.png")
    plot_measured(data["plans"], "predicted_peak_bytes", "measured_peak_bytes", 1 / MiB, "peak memory", "MiB",
                  out / "fidelity_memory.png", allowance=GOAL_MEMORY_RATIO - 1)
    return report_fidelity(data, source)


# ------------------------------------------------------------------ the report


def plan_time_section(args: argparse.Namespace, out: Path) -> str:
    result = run_plan_time(args.quick)
    plot_plan_time(result.cases, out / "plan_time.png")
    return report_plan_time(result, args.quick)


def compare_section(args: argparse.Namespace, out: Path) -> str:
    rows = run_compare(args.quick)
    plot_compare(rows, out / "compare.png")
    return report_compare(rows, args.quick)


def calibration_section(args: argparse.Namespace, out: Path) -> str:
    return report_calibration(run_calibration())


SECTIONS: dict[str, tuple[str, Callable[[argparse.Namespace, Path], str]]] = {
    "plan-time": ("1. Planning time against model size and world size", plan_time_section),
    "compare": ("2. Chosen plan against every baseline", compare_section),
    "calibration": ("3. Calibration set: predictions against published runs", calibration_section),
    "fidelity": ("4. Predicted against measured, on this machine", fidelity_section),
}


def machine() -> str:
    """Platform, CPU model and count, Python and torch versions: what the timings depend on."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def revision() -> str:
    """The git commit the code was at, and whether the working tree had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}" + (" with uncommitted changes" if dirty else "")


def header(wall_s: float, load: tuple[float, float]) -> str:
    return "\n".join([
        "# autopar benchmark suite",
        "",
        f"- Date: {datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Machine: {machine()}",
        f"- Load average (1 min) at start and end: {load[0]:.2f}, {load[1]:.2f} — the machine may be "
        "shared, so wall times are noisy",
        f"- Code: {revision()}",
        f"- Command: `python {shlex.join(sys.argv)}` ({wall_s:.0f} s)",
    ])


def run_section(name: str, args: argparse.Namespace, out: Path) -> tuple[str, bool]:
    """One section's Markdown; a part that raises is reported in its section, not fatal to the rest."""
    title, build = SECTIONS[name]
    try:
        body, ok = build(args, out), True
    except Exception as exc:  # noqa: BLE001 - the report says what broke; the other parts still run
        log(name, f"FAILED: {type(exc).__name__}: {exc}")
        tail = "".join(traceback.format_exception(exc)[-6:])
        body, ok = f"**Failed:** `{type(exc).__name__}: {exc}`\n\n```\n{tail}```", False
    return f"## {title}\n\n{body}\n", ok


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", metavar="DIR",
                        help="report folder (default: benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="fewer models, world sizes and cases")
    parser.add_argument("--skip-fidelity", action="store_true", help="do not run benchmarks/fidelity.py")
    parser.add_argument("--fidelity-json", type=Path, metavar="FILE",
                        help="report this fidelity.py --json output instead of running it")
    parser.add_argument("--only", action="append", choices=PARTS, metavar="PART",
                        help=f"run only this part (repeatable): {', '.join(PARTS)}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    sections, failed = [], []
    for name in PARTS:
        if args.only and name not in args.only:
            continue
        log(name, "start")
        text, ok = run_section(name, args, args.out)
        sections.append(text)
        if not ok:
            failed.append(name)
    wall = time.perf_counter() - START
    report = args.out / "report.md"
    report.write_text(header(wall, (load_start, os.getloadavg()[0])) + "\n\n" + "\n".join(sections))
    log("suite", f"wrote {report} in {wall:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
