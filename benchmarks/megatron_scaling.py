"""The Megatron-LM paper's weak-scaling table beside autopar's predictions.

    python benchmarks/megatron_scaling.py [--rows 1.7B,18B] [--attention materialized|sdpa]

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: ten GPT models, 1.7B to 1T parameters, on 32 to
3,072 A100 80 GB GPUs. Each row is written as ``examples/plain_gpt.py`` (a plain GPT, no config,
built on meta) and planned on the ``a100-80g`` preset twice:

* **pinned** at the published configuration: their tp, pp and dp, their global batch, full
  activation recompute, no ZeRO (schedule and microbatches left to the solver: the table
  does not give them);
* **free**: only the world size and the batch fixed.

The predicted TFLOP/s per GPU is counted as the paper counts it (eq. 3, with recompute):
F = 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs per iteration, over the predicted step and the GPUs.
The table is a held-out check: nothing in the cost model is fitted to it.

The footer gives the median |error|, Spearman's rank correlation between predicted and published
TFLOP/s, how many rows plan at the published configuration, and whether the free plan is ever
slower than the pinned one (it must not be: the pinned plan is in the free plan's search space).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
from fidelity import spearman  # noqa: E402  (Spearman's rank correlation, ties at their mean rank)
from plain_gpt import MEGATRON, SEQ_LEN, VOCAB, MegatronRow, megatron  # noqa: E402

import autopar  # noqa: E402
from autopar.errors import InfeasibleError, PinError  # noqa: E402
from autopar.tools.explain import explain  # noqa: E402

CLUSTER = "a100-80g"


def paper_flops(row: MegatronRow, seq: int = SEQ_LEN, vocab: int = VOCAB) -> float:
    """FLOPs of one iteration as the paper counts them (eq. 3, full activation recompute):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    b, l, h = row.batch, row.layers, row.hidden
    return 96.0 * b * seq * l * h * h * (1 + seq / (6 * h) + vocab / (16 * l * h))


def published_pins(row: MegatronRow) -> list[str]:
    """The paper's configuration as pins: their mesh, full recompute, no ZeRO, the loss over whole logits."""
    return [f"tp={row.tp}", f"pp={row.pp}", f"dp={row.dp}", "recompute=full", "zero=0", "loss=full"]


@dataclass(frozen=True)
class Result:
    """One row: published, predicted at the published configuration, and the free plan."""

    name: str
    row: MegatronRow
    pinned: autopar.Plan | None
    pinned_reason: str  # why there is no pinned plan
    free: autopar.Plan | None
    free_reason: str
    why_not: str  # explain's sentence on the published configuration when free differs
    seconds: float

    def tflops(self, plan: autopar.Plan | None) -> float | None:
        if plan is None:
            return None
        return paper_flops(self.row) / plan.predicted.step_time_s / self.row.gpus / 1e12

    @property
    def error(self) -> float | None:
        predicted = self.tflops(self.pinned)
        return None if predicted is None else predicted / self.row.tflops_per_gpu - 1

    @property
    def free_slower(self) -> bool:
        if self.pinned is None or self.free is None:
            return False
        return self.free.predicted.step_time_s > self.pinned.predicted.step_time_s * (1 + 1e-9)


def _config(plan: autopar.Plan) -> str:
    m = plan.mesh
    text = f"tp{m.tp} pp{m.pp} dp{m.dp} m{plan.microbatches}"
    if m.pp > 1:
        text += f" {plan.schedule.value}" + (f"×{plan.chunks}" if plan.chunks > 1 else "")
    zero = sorted({l.choice.zero for l in plan.layers})
    rec = sorted({l.choice.recompute for l in plan.layers})
    return text + f" z{'/'.join(map(str, zero))} rc={'/'.join(str(r) for r in rec)}"


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def run_row(name: str, *, attention: str = "materialized", time_limit_s: float = 30.0) -> Result:
    """Capture one row's GPT on meta and plan it pinned and free."""
    row, start = MEGATRON[name], time.perf_counter()
    with torch.device("meta"):
        model, inputs = megatron(name, attention=attention)
    graph = autopar.capture(model, inputs)
    common = dict(cluster=CLUSTER, global_batch=row.batch, time_limit_s=time_limit_s)
    pinned = free = None
    pinned_reason = free_reason = why_not = ""
    try:
        pinned = autopar.solve(graph, row.gpus, pins=published_pins(row), runners_up=0, **common)
    except (InfeasibleError, PinError) as exc:
        pinned_reason = _one_line(exc)
    try:
        free = autopar.solve(graph, row.gpus, runners_up=0, **common)
    except InfeasibleError as exc:
        free_reason = _one_line(exc)
    if free is not None and (free.mesh.tp, free.mesh.pp, free.mesh.dp) != (row.tp, row.pp, row.dp):
        e = explain(free, graph, [" ".join(published_pins(row))], time_limit_s=time_limit_s)
        why_not = e.sentences()[0]
    return Result(name, row, pinned, pinned_reason, free, free_reason, why_not, time.perf_counter() - start)


def results(names: Sequence[str], **kwargs) -> Iterator[Result]:
    for name in names:
        yield run_row(name, **kwargs)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def render_row(r: Result) -> str:
    w = r.row
    pub = f"tp{w.tp} pp{w.pp} dp{w.dp}"
    err = r.error
    pinned = _fmt(r.tflops(r.pinned)) if r.pinned else "no plan"
    free = f"{_config(r.free)} | {_fmt(r.tflops(r.free))}" if r.free else "no plan | —"
    return (f"| {r.name} | {pub} | {w.gpus} | {w.batch} | {w.tflops_per_gpu:g} | {pinned} | "
            f"{_fmt(None if err is None else 100 * err, '+.1f')} | {free} |")


def footer(rs: Sequence[Result]) -> list[str]:
    planned = [r for r in rs if r.error is not None]
    lines = [f"rows plannable at the published configuration: {len(planned)} of {len(rs)}"]
    if planned:
        errs = [abs(r.error) for r in planned]
        lines.append(f"median |error|: {100 * statistics.median(errs):.1f}%")
        rho = spearman([r.tflops(r.pinned) for r in planned], [r.row.tflops_per_gpu for r in planned])
        lines.append(f"Spearman rank correlation (predicted vs published TFLOP/s): {rho:+.2f}")
    slower = [r.name for r in rs if r.free_slower]
    lines.append("free plan slower than the published one: " + (", ".join(slower) if slower else "never"))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(MEGATRON), help="comma-separated sizes (default: all ten)")
    ap.add_argument("--attention", choices=("materialized", "sdpa"), default="materialized")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver time limit per solve, seconds")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in MEGATRON]
    if unknown:
        print(f"megatron_scaling: unknown row {', '.join(unknown)}; rows are {', '.join(MEGATRON)}",
              file=sys.stderr)
        return 2
    print(f"Megatron-LM weak scaling (Narayanan et al. SC'21, Table 1) on {CLUSTER}, "
          f"attention={args.attention}; TFLOP/s per GPU counted by the paper's eq. 3\n")
    print("| row | published | GPUs | batch | published TFLOP/s | predicted (pinned) | error % | "
          "free plan | free TFLOP/s |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    rs: list[Result] = []
    for r in results(names, attention=args.attention, time_limit_s=args.time_limit):
        rs.append(r)
        print(render_row(r), flush=True)
    print()
    for r in rs:
        if r.pinned is None:
            print(f"{r.name} pinned: {r.pinned_reason}")
        elif r.row.tp > 1:  # a pinned tp on layers that admit no style runs them whole on every tp rank
            for note in r.pinned.notes:
                if "withdrawn" in note or "admits" in note:
                    print(f"{r.name} pinned: {note}")
        if r.free is None:
            print(f"{r.name} free: {r.free_reason}")
        if r.why_not:
            print(f"{r.name} why not the published one: {r.why_not}")
    print()
    print("\n".join(footer(rs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
