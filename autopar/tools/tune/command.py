"""The ``autopar tune`` command: the problem from the CLI's options, the ranks to measure on, the outputs.

The CLI (:mod:`autopar.tools.cli`) only wires the arguments; this module builds the
:class:`~autopar.tools.tune.Problem`, picks the ranks (``nproc`` spawned processes, or the ranks of
an outside ``torchrun`` when its environment is set), runs :func:`~autopar.tools.tune.tune`, and
writes the plan, the refit cluster file and the report, each only after every measurement ended.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from autopar.errors import AutoparError

if TYPE_CHECKING:  # the search imports numpy and the planner: only once the command runs
    from autopar.tools.tune.candidates import Candidate
    from autopar.tools.tune.search import Problem, TuneResult


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``autopar tune``'s own options (the CLI adds SPEC, --cluster, --pin … as for ``plan``)."""
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="processes (ranks) to measure on (default: an outside torchrun's world size)")
    p.add_argument("--top", type=int, default=4, metavar="K", help="runners-up to measure beside the plan")
    p.add_argument("--steps", type=int, default=20, metavar="S",
                   help="timed steps per candidate (after warm-up; their median is its step time)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="warm-up steps per candidate")
    p.add_argument("--budget-s", type=float, default=None, metavar="T", help="bound on the whole tune, seconds")
    p.add_argument("--no-probe", action="store_true",
                   help="skip calibrate's quick probes (then the refit's ranges are the wide defaults)")
    for action in p._actions:  # tune counts its ranks with --nproc; the precision defaults to the machine's
        if action.dest == "world_size":
            action.required, action.default, action.help = False, None, argparse.SUPPRESS
        if action.dest == "dtype":
            action.default, action.help = None, "training precision (default: bf16 on a GPU, fp32 on a CPU)"
        if action.dest == "batch_size":
            action.help = "global batch in samples per step (default: the example inputs' batch)"
        if action.dest == "cluster":
            action.help = "the cluster to start from: preset or file (default: this machine's preset)"
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="write the plan kept")
    p.add_argument("--report", default=None, metavar="TUNE.json", help="write the report as JSON")
    p.add_argument("--cluster-out", default=None, metavar="TUNED.json", help="write the refit cluster file")
    p.add_argument("--html", default=None, metavar="TUNE.html",
                   help="draw predicted against measured, and the plan kept, in one HTML file")


def add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    """``autopar calibrate --from-metrics``: the refit from a training run's metrics file instead of probes."""
    for action in p._actions:  # the probes' --nproc: not needed when the figures come from a run
        if action.dest == "nproc":
            action.required, action.default = False, None
            action.help += " (required unless --from-metrics)"
    p.add_argument("--from-metrics", default=None, metavar="RUN.jsonl",
                   help="refit a cluster from a training run's metrics file (with --plan and --model)")
    p.add_argument("--plan", default=None, metavar="PLAN.json", help="the plan that run trained with")
    p.add_argument("--model", default=None, metavar="SPEC", help="that plan's model (to price it again)")
    p.add_argument("--seq-len", type=int, default=None, metavar="S", help="passed to the model's spec function")
    p.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help="the cluster to refit (default: the plan's own)")


def from_metrics(args: argparse.Namespace) -> int:
    """``autopar calibrate --from-metrics RUN.jsonl --plan PLAN.json --model SPEC [-o FILE]``."""
    if args.from_metrics is None:
        raise AutoparError("calibrate needs --nproc N (to probe this machine) or --from-metrics RUN.jsonl")
    if args.plan is None or args.model is None:
        raise AutoparError("--from-metrics needs --plan PLAN.json (the plan the run trained with) and --model SPEC")
    from autopar.capturing import capture
    from autopar.plan import Plan
    from autopar.planning.api import resolve_cluster
    from autopar.tools.calibrate import check_output_path, write_atomically
    from autopar.tools.spec import load_spec
    from autopar.tools.tune import metrics_file
    from autopar.tools.tune.search import refit_one

    if args.output:
        check_output_path(args.output)
    reports = metrics_file.read_reports(args.from_metrics)
    plan = Plan.load(args.plan)
    metrics_file.check_same_plan(reports, plan, args.from_metrics)
    cluster = plan.cluster if args.cluster is None else resolve_cluster(args.cluster, plan.world_size)
    graph = capture(*load_spec(args.model, seq_len=args.seq_len, device="meta"))
    measured = metrics_file.measured_step_s(reports)
    result = refit_one(graph, plan, cluster, measured)
    doc = result.cluster.to_dict()
    doc["calibration"] = {"command": "autopar calibrate --from-metrics", "from": cluster.name,
                          "metrics": str(args.from_metrics), "measured_step_s": measured, "refit": result.to_dict()}
    text = json.dumps(doc, indent=2) + "\n"
    sys.stderr.write(f"measured {measured * 1e3:.2f} ms a step; factors " + ", ".join(
        f"{k} {v:.3g}" for k, v in result.factors.items()) + "\n")
    for k, why in result.undetermined.items():
        sys.stderr.write(f"  not determined: {k} ({why})\n")
    if args.output:
        write_atomically(args.output, text)
        sys.stderr.write(f"cluster written to {args.output}; plan with --cluster {args.output}\n")
    else:
        sys.stdout.write(text)
    return 0


def show(args: argparse.Namespace) -> int:
    """``autopar show tune.json [--html FILE]``: a saved tune report's candidates, and the picture of
    predicted against measured (no plan is in a report: the plan kept is ``tune -o``'s file)."""
    from autopar.tools.pictures import write_html
    from autopar.tools.tune.picture import tune_html

    if args.png:
        raise AutoparError(f"{args.plan} is a tune report: draw it with --html (--png draws plans)")
    report = json.loads(open(args.plan).read())
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2f}"

    rows = [("#", "status", "before ms", "after ms", "measured ms", "pins")]
    rows += [(f"{i + 1}{'*' if i == report['chosen'] else ''}", c["status"], ms(c["predicted_before_s"]),
              ms(c["predicted_after_s"]), ms(c["measured_s"]), " ".join(c["pins"]))
             for i, c in enumerate(report["candidates"])]
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) if k in (1, 5) else v.rjust(w) for k, (v, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    table = "\n".join(lines)
    sys.stdout.write((json.dumps(report, indent=2) if args.json else table) + "\n")
    if args.html:
        write_html(args.html, tune_html(report, table))
        (sys.stderr if args.json else sys.stdout).write(f"report written to {args.html}\n")
    return 0


def _torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def check(args: argparse.Namespace) -> int:
    """The cheap refusals, before anything is built; the number of ranks."""
    from autopar.tools.calibrate import check_output_path

    nproc = int(os.environ["WORLD_SIZE"]) if _torchrun() and args.nproc is None else args.nproc
    if nproc is None:
        raise AutoparError("tune needs --nproc N (or run it under torchrun)")
    if _torchrun() and nproc != int(os.environ["WORLD_SIZE"]):
        raise AutoparError(f"--nproc {nproc} under torchrun's WORLD_SIZE {os.environ['WORLD_SIZE']}: leave it out")
    for flag, value, least in (("--nproc", nproc, 1), ("--top", args.top, 0), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 1)):
        if value < least:
            raise AutoparError(f"{flag} must be at least {least}, got {value}")
    if args.budget_s is not None and not args.budget_s > 0:
        raise AutoparError(f"--budget-s must be positive, got {args.budget_s}")
    for path in (args.output, args.report, args.cluster_out, args.html):
        if path is not None:
            check_output_path(path)
    return nproc


def problem(args: argparse.Namespace, nproc: int) -> Problem:
    """The model captured, the cluster resolved for ``nproc`` ranks (default: this machine's), the batch."""
    import torch

    from autopar.capturing import capture
    from autopar.pins import Pins
    from autopar.planning.api import resolve_cluster
    from autopar.runtime.launch import local_cluster
    from autopar.tools.spec import load_spec
    from autopar.tools.tune.search import Problem
    from autopar.tools.verify import example_batch

    cluster = resolve_cluster(args.cluster or local_cluster(), nproc, nodes=args.nodes)
    Pins.parse(args.pin).check_form()
    model, inputs = load_spec(args.spec, seq_len=args.seq_len, device="meta")
    graph = capture(model, inputs)
    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    return Problem(args.spec, nproc, cluster, graph, args.batch_size or example_batch(inputs), dtype,
                   args.seq_len, tuple(args.pin), args.time_limit, args.memory_gb)


def run(args: argparse.Namespace) -> int:
    """``autopar tune``: measure, refit, write; the table on stdout (JSON with ``--json``)."""
    nproc = check(args)
    if _torchrun():
        from autopar.tools.tune.group import run_under_torchrun

        return run_under_torchrun(args, nproc, problem, _tune, _write)
    prob = problem(args, nproc)
    result = _tune(args, prob, _spawned(prob, args))
    return _write(args, result)


def _tune(args: argparse.Namespace, prob: Problem, measure: Any) -> TuneResult:
    from autopar.tools.tune.search import tune

    deadline = None if args.budget_s is None else time.time() + args.budget_s
    measure.deadline = deadline
    return tune(prob, measure, top=args.top, budget_s=args.budget_s, probe=not args.no_probe, say=_say)


def _say(line: str) -> None:
    sys.stderr.write(f"autopar tune: {line}\n")


class _spawned:
    """Measure on ``nproc`` spawned local ranks (:func:`.launch.measure_spawned`), with progress lines."""

    def __init__(self, prob: Problem, args: argparse.Namespace) -> None:
        self.prob, self.args, self.deadline = prob, args, None

    def __call__(self, plans: list[tuple[int, str]], probe: bool,
                 cands: list[Candidate]) -> tuple[list[Any], dict[str, Any] | None]:
        from autopar.tools.host import check_local_processes
        from autopar.tools.tune.launch import measure_spawned
        from autopar.tools.tune.search import describe_progress, fit_together

        check_local_processes(self.prob.nproc, backend="gloo")
        start, done = describe_progress(cands, lambda: len(cands))
        if probe:
            _say("probing the machine (autopar calibrate --quick)")
        return measure_spawned(self.prob.nproc, self.prob.spec, self.prob.seq_len, plans,
                               self.prob.graph.to_dict(), steps=self.args.steps, warmup=self.args.warmup,
                               deadline=self.deadline, probe=probe, together=fit_together(cands, plans),
                               on_start=start, on_done=done)


def _write(args: argparse.Namespace, result: TuneResult) -> int:
    """The outputs, each written whole; the table (or the JSON) on stdout."""
    from autopar.tools.calibrate import write_atomically
    from autopar.tools.tune.search import report_json

    if args.output:
        result.plan.save(args.output)
    if args.cluster_out:
        doc = result.refit.cluster.to_dict()
        doc["calibration"] = {"command": "autopar tune", "from": result.given.name,  # the planner ignores it
                              "refit": result.refit.to_dict()}
        write_atomically(args.cluster_out, json.dumps(doc, indent=2) + "\n")
    if args.report:
        write_atomically(args.report, json.dumps(report_json(result), indent=2) + "\n")
    table = render(result)
    if args.html:
        from autopar.tools.pictures import write_html
        from autopar.tools.tune.picture import tune_html

        write_html(args.html, tune_html(report_json(result), table, result.plan))
    sys.stdout.write((json.dumps(report_json(result), indent=2) if args.json else table) + "\n")
    return 0


def render(result: TuneResult) -> str:
    """The table: each candidate's pins, status, predicted before and after the refit, measured, memory."""
    from autopar.tools.tune.refit import ABSOLUTE
    from autopar.tools.tune.search import prediction_error
    from autopar.units import MiB

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2f}"

    rows = [("", "#", "plan", "status", "before ms", "after ms", "measured ms", "peak MiB", "plan MiB")]
    for i, c in enumerate(result.candidates):
        mark = "*" if i == result.chosen else ""
        rows.append((mark, str(i + 1), " ".join(_config(c)), c.status or "not run", ms(c.predicted_before_s),
                     ms(c.predicted_after_s), ms(c.measured_s),
                     "-" if c.peak_bytes is None else f"{c.peak_bytes / MiB:.1f}", f"{c.predicted_bytes / MiB:.1f}"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) if k in (0, 2, 3) else v.rjust(w) for k, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    before, after = prediction_error(result, False), prediction_error(result, True)
    r = result.refit
    factors = ", ".join(f"{k} {'' if k in ABSOLUTE else '× '}{v:.3g}" for k, v in r.factors.items()
                        if k in r.determined)
    out = [f"autopar tune — {result.plan.model} on {result.plan.world_size} × {result.given.device.name} "
           f"({result.wall_s:.0f} s)", "", *lines, "",
           f"kept: candidate {result.chosen + 1} (*), the fastest measured",
           f"prediction error (worst |predicted/measured − 1|): {_pct(before)} before the refit, "
           f"{_pct(after)} after",
           f"refit: {factors or 'nothing determined'}"]
    out += [f"  not determined: {k} ({why})" for k, why in r.undetermined.items()]
    out += [f"  at the end of its range: {k}" for k in r.at_bound]
    out += [f"note: {n}" for n in (*r.notes, *result.notes)]
    out += [f"not run (--budget-s): {' '.join(p)}" for p in result.not_run]
    return "\n".join(out)


def _config(c: Candidate) -> list[str]:
    mesh = [f"{k}={v}" for k, v in c.plan.mesh.to_dict().items() if v > 1] or ["dp=1"]
    extra = [f"m={c.plan.microbatches}"] + ([c.plan.schedule.value] if c.plan.mesh.pp > 1 else [])
    zeros = sorted({l.choice.zero for l in c.plan.layers})
    if c.plan.mesh.dp > 1:
        extra.append("zero=" + "/".join(str(z) for z in zeros))
    return mesh + extra


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
