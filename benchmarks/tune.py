"""``autopar tune`` on this machine: its wall time, and how far the predictions were from the measured
step times before and after its refit, given a cluster file told wrong on purpose.

    python benchmarks/tune.py [--json FILE] [--worlds 2 4] [--steps 20] [--metrics [--rounds R] [--sequential]]
    python benchmarks/tune.py --refit-from FILE      # a saved run's measurements refit again

For each world size W and each wrong cluster — calibrate's fit of this machine
(``benchmarks/results/cluster-wW.json``, the CPU fidelity reference's) with its compute
4× too fast and its communication 4× too slow, or the reverse — ``autopar tune`` runs the tiny
GPT (``examples/gpt.py:gpt_tiny``, global batch 16, fp32, ``--pin cp=1``: the CPU fidelity
benchmark has no context-parallel case to say what the model prices right there) on W gloo
processes, with calibrate's quick probes. Printed per case: tune's wall time, the candidates and
whether the one kept measured fastest and no slower than the first plan, and the prediction error
|predicted / measured − 1| over the candidates that ran, worst and median, before and after.

``--metrics``: also train the tiny GPT for 40 steps with ``examples/train_gpt.py`` (``autopar run``,
W = 2, ``--metrics-file``), refit from that file (``autopar calibrate --from-metrics``), measure
the same plan as tune does, refit from that one measurement, and print how far the two refits
are apart (the compute rate, the link bandwidth, and the plan's predicted step under each).

The host is shared (other work runs on its two cores), so every figure is noisy: the step
times are medians of ``--steps`` steps taken in turns across the candidates (a slow spell falls on
all alike), and the runs are not repeated here; run it again for a second sample.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "gpt.py") + ":gpt_tiny"
MEASURED_STEPS = 100  # --metrics: tune's timed steps of the trained plan, beside the training run
SEQUENTIAL_STEPS = 105  # --metrics --sequential: the training run's steps, the first SEQUENTIAL_WARMUP left out
SEQUENTIAL_WARMUP = 5
WRONG = {"compute 4× fast, comm 4× slow": (4.0, 0.25), "compute 4× slow, comm 4× fast": (0.25, 4.0)}


def wrong_cluster(world: int, compute: float, comm: float, path: Path) -> None:
    from autopar.cost_models.presets import load_cluster
    from autopar.tools.tune.refit import apply

    truth = load_cluster(str(ROOT / "benchmarks" / "results" / f"cluster-w{world}.json"))
    wrong = apply(truth, {"compute": math.log(compute), "communication": math.log(comm), "host": 0.0,
                          "overlap": truth.comm_overlap})
    path.write_text(json.dumps(replace(wrong, name=path.stem).to_dict()))


def errors(cands: list[dict], key: str) -> list[float]:
    return [abs(c[key] / c["measured_s"] - 1) for c in cands if c["status"] == "ok"]


def one(world: int, label: str, compute: float, comm: float, steps: int, tmp: Path) -> dict:
    from autopar.tools.cli import main

    cluster = tmp / f"wrong-w{world}-{compute:g}.json"
    wrong_cluster(world, compute, comm, cluster)
    report = tmp / f"tune-w{world}-{compute:g}.json"
    started = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["tune", TINY, "--nproc", str(world), "--cluster", str(cluster), "--pin", "cp=1",
                     "--batch-size", "16", "--steps", str(steps), "--report", str(report)])
    wall = time.perf_counter() - started
    if code != 0:
        return {"world": world, "wrong": label, "error": f"exit {code}"}
    print(out.getvalue())
    r = json.loads(report.read_text())
    c = r["candidates"]
    ran = [x for x in c if x["status"] == "ok"]
    before, after = errors(c, "predicted_before_s"), errors(c, "predicted_after_s")
    return {"world": world, "wrong": label, "wall_s": round(wall, 1), "candidates": len(c), "ran": len(ran),
            "kept_fastest": c[r["chosen"]]["measured_s"] == min(x["measured_s"] for x in ran),
            "not_slower_than_first": c[0]["status"] != "ok" or c[r["chosen"]]["measured_s"] <= c[0]["measured_s"],
            "kept_is_first": r["chosen"] == 0, "resolved_is_kept": r["resolved"] == r["chosen"],
            "before_worst": max(before), "before_median": statistics.median(before),
            "after_worst": max(after), "after_median": statistics.median(after),
            "determined": r["refit"]["determined"], "factors": r["refit"]["factors"], "notes": r["refit"]["notes"],
            "each": [{"pins": [p for p in x["pins"] if not p.endswith("=1") or p.startswith("microbatches=")],
                      "status": x["status"],
                      "before_s": x["predicted_before_s"], "after_s": x["predicted_after_s"],
                      "measured_s": x["measured_s"]} for x in c]}


def _train(metrics: Path, plan_path: Path, steps: int, log: Path, *extra: str) -> subprocess.Popen:
    """``autopar run examples/train_gpt.py`` on 2 processes, in the background: its own process group (to
    stop it), in this session (Linux shares a busy host's cores between sessions: another would give it
    another share than tune's ranks get)."""
    cmd = [sys.executable, "-c", "import sys; from autopar.tools.cli import main; sys.exit(main(sys.argv[1:]))",
           "run", str(ROOT / "examples" / "train_gpt.py"), "--nproc", "2", "--", "--steps", str(steps),
           "--batch-size", "16", "--metrics-file", str(metrics), "--save-plan", str(plan_path), "--log-every", "1",
           *extra]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, process_group=0)


def _reports(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def from_metrics(tmp: Path, rounds: int = 3, sequential: bool = False) -> dict:
    """The refit from train_gpt.py's metrics file against the refit from tune's own measurement of that plan.

    The host's load moves a plan's step time by far more than the 5 % compared here within seconds (the
    same plan measured 18 ms and 97 ms a minute apart), so one measured after the other compares two loads,
    not two measurements. Each round therefore runs them at once: the training run in the background and,
    once it reports steps, tune's measurement of the plan it trains (:data:`MEASURED_STEPS`) beside it,
    both under the same load (each other's included, in the same session); the training run is then
    stopped, its file cut to the reports written while tune's steps ran (each report's ``time``), and
    refit from (``autopar calibrate --from-metrics``).

    ``sequential`` (``--sequential``, for an idle host): the training run goes to its end
    (:data:`SEQUENTIAL_STEPS`), then tune measures its plan alone; the file's reports after the first
    :data:`SEQUENTIAL_WARMUP` are refit from, the run unclipped as tune's candidates are (clipping's ops are
    not priced). Two jobs at once on two cores each get about half, which is the same load for both but not
    the load either job runs under alone."""
    from autopar.capturing import capture
    from autopar.cost_models.presets import load_cluster
    from autopar.plan import Plan
    from autopar.planning.api import reprice
    from autopar.tools.cli import main
    from autopar.tools.spec import load_spec
    from autopar.tools.tune.launch import measure_spawned
    from autopar.tools.tune.search import refit_one

    def rate(c) -> float:
        return c.device.peak_flops_fp32 * c.device.matmul_efficiency

    graph = capture(*load_spec(TINY, device="meta"))
    out = []
    for r in range(rounds):
        whole, metrics, refit_path = tmp / f"run-{r}.jsonl", tmp / f"cut-{r}.jsonl", tmp / f"from-metrics-{r}.json"
        plan_path = tmp / f"plan-{r}.json"
        n = MEASURED_STEPS
        if sequential:  # the training run to its end, then tune's measurement of its plan: one job at a time
            # tune measures its candidates unclipped (the default AdamW, no scheduler): the run alike
            training = _train(whole, plan_path, SEQUENTIAL_STEPS, tmp / f"run-{r}.log", "--max-grad-norm", "0")
            if training.wait() != 0:
                raise RuntimeError(f"train_gpt.py failed: see {tmp / f'run-{r}.log'}")
            plan = Plan.load(plan_path)
            results, _ = measure_spawned(2, TINY, None, [(0, plan.to_json())], graph.to_dict(), steps=n,
                                         warmup=2, deadline=None)
            lines = [json.dumps(x) for x in _reports(whole)[SEQUENTIAL_WARMUP:]]
        else:
            training = _train(whole, plan_path, 10**6, tmp / f"run-{r}.log")
            try:
                while len(_reports(whole)) < 5:  # the training run is past its warm-up: measure beside it
                    if training.poll() is not None:
                        raise RuntimeError(f"train_gpt.py failed: see {tmp / f'run-{r}.log'}")
                    time.sleep(0.5)
                plan = Plan.load(plan_path)  # the plan train_gpt.py trains
                results, _ = measure_spawned(2, TINY, None, [(0, plan.to_json())], graph.to_dict(), steps=n,
                                             warmup=2, deadline=None)
                ended = time.time()
            finally:
                os.killpg(training.pid, signal.SIGTERM)
                training.wait()
            # tune's timed steps: about its n steps at its median before it ended
            began = ended - n * results[0].measured_s
            lines = [json.dumps(x) for x in _reports(whole) if began <= x["time"] <= ended]
        metrics.write_text("\n".join(lines) + "\n")
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["calibrate", "--from-metrics", str(metrics), "--plan", str(plan_path), "--model", TINY,
                         "-o", str(refit_path)]) == 0
        own = refit_one(graph, plan, plan.cluster, results[0].measured_s).cluster
        file = load_cluster(str(refit_path))
        doc = json.loads(refit_path.read_text())["calibration"]
        out.append({"metrics_step_s": doc["measured_step_s"], "reports": len(lines),
                    "tune_step_s": results[0].measured_s, "compute_rate_ratio": rate(file) / rate(own),
                    "bandwidth_ratio": file.intra_node.bandwidth_bytes_s / own.intra_node.bandwidth_bytes_s,
                    "predicted_ratio": (reprice(graph, plan, file).predicted.step_time_s
                                        / reprice(graph, plan, own).predicted.step_time_s)})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return {"rounds": out, "predicted_ratio_median": statistics.median(x["predicted_ratio"] for x in out),
            "compute_rate_ratio_median": statistics.median(x["compute_rate_ratio"] for x in out)}


def _ran_pins(pins: list[str]) -> list[str]:
    """A saved candidate's pins as it ran: files before the fifth run left out every ``=1`` pin, so a
    candidate of one microbatch is pinned to it again (else the solver may pick more on the wrong cluster)."""
    return pins if any(p.startswith("microbatches=") for p in pins) else [*pins, "microbatches=1"]


def refit_again(path: Path) -> list[dict]:
    """The refit of a saved run's measurements made again by this checkout (``--refit-from FILE``): each
    row's candidates solved again from their pins (mesh, schedule, microbatches) on the wrong cluster
    and refit from the step times it measured. On a shared host no two runs measure alike, so a change
    to the refit or the model is compared on the same measurements (a layer's choice the pins leave
    free may come out otherwise under another model than the one the run planned with)."""
    from autopar.capturing import capture
    from autopar.cost_models.presets import load_cluster
    from autopar.planning.api import reprice, solve
    from autopar.tools.spec import load_spec
    from autopar.tools.tune.candidates import plan_pins, with_pins
    from autopar.tools.tune.refit import refit

    graph = capture(*load_spec(TINY, device="meta"))
    doc = json.loads(path.read_text())
    # the last run that measured candidates (a --metrics run with no --worlds has none)
    rows = next((run["rows"] for run in reversed(doc["runs"]) if run["rows"]), []) if "runs" in doc else doc["rows"]
    out = []
    with tempfile.TemporaryDirectory(prefix="autopar-tune-refit-") as d:
        for r in rows:
            compute, comm = WRONG[r["wrong"]]
            file = Path(d) / f"wrong-w{r['world']}-{compute:g}.json"
            wrong_cluster(r["world"], compute, comm, file)
            wrong = load_cluster(str(file))
            ran = [c for c in r["each"] if c["status"] == "ok"]
            plans = [solve(graph, r["world"], cluster=wrong, global_batch=16, dtype="fp32",
                           pins=with_pins(["cp=1"], _ran_pins(c["pins"])), runners_up=0) for c in ran]
            measured = [c["measured_s"] for c in ran]

            def predict(cl, plans=plans) -> list[float]:
                return [reprice(graph, p, cl).predicted.step_time_s for p in plans]

            result = refit(predict, wrong, measured)
            after = [abs(a / m - 1) for a, m in zip(predict(result.cluster), measured)]
            again = solve(graph, r["world"], cluster=result.cluster, global_batch=16, dtype="fp32", pins=["cp=1"],
                          runners_up=0)
            kept = plans[min(range(len(ran)), key=lambda i: measured[i])]
            out.append({"world": r["world"], "wrong": r["wrong"], "after_worst": max(after),
                        "after_median": statistics.median(after), "factors": result.factors,
                        "after_s": predict(result.cluster), "measured_s": measured,
                        "plans_the_fastest_again": plan_pins(again) == plan_pins(kept),
                        "plans": [p for p in plan_pins(again) if not p.endswith("=1")],
                        "planned_s": again.predicted.step_time_s})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4], help="none: only --metrics")
    parser.add_argument("--steps", type=int, default=20, help="tune's --steps")
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="--metrics: training runs, each beside tune's own")
    parser.add_argument("--sequential", action="store_true",
                        help="--metrics: the training run first, then tune's measurement alone (an idle host)")
    parser.add_argument("--refit-from", default=None, metavar="FILE",
                        help="refit a saved run's measurements again (its --json file) and print the errors")
    args = parser.parse_args()
    if args.refit_from:
        for r in refit_again(Path(args.refit_from)):
            print(f"| {r['world']} | {r['wrong']} | after (worst / median) {r['after_worst']:.0%} / "
                  f"{r['after_median']:.0%} | the refit plans the fastest measured again: "
                  f"{'yes' if r['plans_the_fastest_again'] else 'NO'} |")
        return 0
    rows, extra = [], {}
    with tempfile.TemporaryDirectory(prefix="autopar-tune-bench-") as d:
        for world in args.worlds:
            for label, (compute, comm) in WRONG.items():
                rows.append(one(world, label, compute, comm, args.steps, Path(d)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.metrics:
            extra = from_metrics(Path(d), args.rounds, args.sequential)
    print("| W | wrong cluster | wall s | ran | kept fastest | ≤ first | error before (worst / median) "
          "| after (worst / median) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['world']} | {r['wrong']} | {r['error']} | | | | | |")
            continue
        print(f"| {r['world']} | {r['wrong']} | {r['wall_s']:.0f} | {r['ran']}/{r['candidates']} | "
              f"{'yes' if r['kept_fastest'] else 'NO'} | {'yes' if r['not_slower_than_first'] else 'NO'} | "
              f"{r['before_worst']:.0%} / {r['before_median']:.0%} | "
              f"{r['after_worst']:.0%} / {r['after_median']:.0%} |")
    if extra:
        print("\nfrom-metrics against tune's own measurement of that plan: " + json.dumps(extra))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "from_metrics": extra}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
