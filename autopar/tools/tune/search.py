"""The search ``autopar tune`` runs: measure the best candidates, refit the prices, keep the plan that ran fastest.

    autopar tune examples/gpt.py:gpt_tiny --nproc 2 --cluster cluster.json -o plan.json \\
        --report tune.json --cluster-out tuned.json
    autopar plan examples/gpt.py:gpt_tiny --world-size 2 --cluster tuned.json    # the tuned plan again

The steps, in order:

1. solve: the plan the given cluster prices fastest, with its runners-up;
2. candidates: that plan and the ``top`` most different runners-up the model ranks close
   (:func:`.candidates.pick`), each solved under its pins;
3. measure: each candidate trained for ``warmup`` + ``steps`` steps on the real ranks with the real
   runtime (:mod:`.ranks`; ``nproc`` spawned processes, or the ranks of an outside ``torchrun``),
   after ``autopar calibrate --quick``'s probes (``probe``) in the same ranks;
4. refit: the cluster's compute, communication, overlap and host figures moved so that the
   candidates' predictions meet their measured step times (:mod:`.refit`), within the ranges the
   probes allow; the allocator's reserve from measured memory where a GPU has one;
5. solve again under the refit cluster; a plan not yet measured is measured and the refit redone
   with it; the refit cluster's own choice (``resolved``) is recorded;
6. keep the candidate that measured fastest. The first plan was measured too, so the plan kept
   never measured slower than it; a candidate that ran out of memory or failed is recorded as such.

``budget_s`` bounds the whole tune: a candidate is started only while the slowest so far would
still end within it, and a candidate under way past it (and a grace) is stopped. Under an outside
``torchrun`` every rank runs ``autopar tune``; rank 0 plans and decides and the others follow its
broadcasts (:mod:`.group`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.cost_models.hardware import ClusterSpec
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.tools.tune.candidates import Candidate, key, pick, plan_pins, with_pins
from autopar.tools.tune.ranks import OK, Measured
from autopar.tools.tune.refit import RefitResult, allocator_overhead, refit

__all__ = ["Candidate", "Problem", "TuneResult", "tune"]

# (index, plan JSON) pairs to run, whether to probe first, every candidate (for the progress lines)
Measure = Callable[[list[tuple[int, str]], bool, list["Candidate"]], tuple[list[Measured], dict[str, Any] | None]]


@dataclass(frozen=True)
class Problem:
    """What is tuned: the model, the ranks, the given cluster and the training step."""

    spec: str
    nproc: int
    cluster: ClusterSpec
    graph: Any  # LayerGraph
    global_batch: int
    dtype: str = "fp32"
    seq_len: int | None = None
    pins: tuple[str, ...] = ()
    time_limit_s: float = 30.0
    memory_gb: float | None = None

    def solve(self, cluster: ClusterSpec, pins: Sequence[str] = (), runners_up: int | None = None) -> Plan:
        from autopar.planning.api import solve

        extra = {} if runners_up is None else {"runners_up": runners_up}
        return solve(self.graph, self.nproc, cluster=cluster, global_batch=self.global_batch, dtype=self.dtype,
                     memory_gb=self.memory_gb, pins=with_pins(self.pins, pins), time_limit_s=self.time_limit_s,
                     **extra)


@dataclass
class TuneResult:
    """Every candidate, the one kept, the refit, and the refit cluster's own choice."""

    candidates: list[Candidate]
    chosen: int
    refit: RefitResult
    given: ClusterSpec
    resolved: Plan  # the plan the refit cluster solves to
    probed: ClusterSpec | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    not_run: list[list[str]] = field(default_factory=list)  # pins of the candidates the budget left out

    @property
    def plan(self) -> Plan:
        """The plan kept, priced on the refit cluster."""
        return self.candidates[self.chosen].plan

    @property
    def resolved_index(self) -> int | None:
        k = key(self.resolved)
        return next((i for i, c in enumerate(self.candidates) if key(c.plan) == k), None)


def fit_together(cands: list[Candidate], todo: list[tuple[int, str]]) -> bool:
    """Whether the candidates to run fit in a rank's memory all at once, as predicted (then their timed
    steps take turns: :func:`.ranks.run_candidates`)."""
    need = sum(cands[i].predicted_bytes for i, _ in todo)
    return need <= min(cands[i].plan.predicted.memory_budget_bytes for i, _ in todo)


def _errors(cands: list[Candidate], attr: str) -> list[float]:
    return [abs(getattr(c, attr) / c.measured_s - 1.0) for c in cands
            if c.status == OK and getattr(c, attr) is not None and c.measured_s]


def prediction_error(result: TuneResult, after: bool) -> float | None:
    """The largest |predicted / measured − 1| over the candidates that ran, before or after the refit."""
    errs = _errors(result.candidates, "predicted_after_s" if after else "predicted_before_s")
    return max(errs) if errs else None


def _record(c: Candidate, m: Measured) -> None:
    c.status, c.measured_s, c.peak_bytes, c.reserved_bytes, c.error = (m.status, m.measured_s, m.peak_bytes,
                                                                       m.reserved_bytes, m.error)


def _refit(problem: Problem, cands: list[Candidate], probed: ClusterSpec | None) -> RefitResult:
    """Refit on the candidates that ran; every candidate's prediction after it (:mod:`.refit`)."""
    from autopar.planning.api import reprice

    ran = [c for c in cands if c.status == OK]
    if not ran:
        raise AutoparError("no candidate ran: each ran out of memory, failed or found the budget spent, so there is "
                           "nothing to refit from; check the model with `autopar verify`")
    result = refit(lambda cl: [reprice(problem.graph, c.plan, cl).predicted.step_time_s for c in ran],
                   problem.cluster, [c.measured_s for c in ran], probed=probed)
    reserve = allocator_overhead([(c.reserved_bytes, c.peak_bytes) for c in ran if c.reserved_bytes])
    if reserve is not None:
        result = replace(result, cluster=replace(result.cluster, allocator_overhead_fraction=reserve),
                         allocator_overhead=reserve)
    else:
        result.undetermined["allocator reserve"] = ("no caching allocator to measure: CPU tensors report no "
                                                    "reserved bytes")
    for c in cands:
        c.predicted_after_s = reprice(problem.graph, c.plan, result.cluster).predicted.step_time_s
    return result


def tune(problem: Problem, measure: Measure, *, top: int = 4, budget_s: float | None = None, probe: bool = True,
         say: Callable[[str], None] = lambda line: None) -> TuneResult:
    """Steps 1–6 of the module docstring; ``measure(plans, probe, candidates)`` runs (index, plan JSON) pairs
    on the ranks (:data:`Measure`)."""
    started = time.time()
    first = problem.solve(problem.cluster, runners_up=max(top, 3))
    cands = [Candidate(tuple(with_pins(problem.pins, plan_pins(first))), first, "solved",
                       first.predicted.step_time_s)]
    for r in pick(first.runners_up, top):
        try:
            plan = problem.solve(problem.cluster, r.pins, runners_up=0)
        except AutoparError as exc:  # pinned alone it may not fit as the runner-up's search found it
            say(f"runner-up {' '.join(r.pins)} not solved alone: {exc}")
            continue
        if all(key(plan) != key(c.plan) for c in cands):
            cands.append(Candidate(tuple(with_pins(problem.pins, r.pins)), plan, "runner-up",
                                   plan.predicted.step_time_s))
    probed = _run(problem, cands, measure, probe, say)
    result = _refit(problem, cands, probed)
    resolved = problem.solve(result.cluster)
    if all(key(resolved) != key(c.plan) for c in cands) and (budget_s is None or time.time() < started + budget_s):
        cands.append(Candidate(tuple(with_pins(problem.pins, plan_pins(resolved))), resolved, "refit",
                               _reprice_s(problem, resolved, problem.cluster)))
        _run(problem, cands, measure, False, say)
        result = _refit(problem, cands, probed)
        resolved = problem.solve(result.cluster)
    not_run = [c for c in cands if c.status is None]  # the budget ran out first: listed apart
    cands = [c for c in cands if c.status is not None]
    ran = [i for i, c in enumerate(cands) if c.status == OK]
    chosen = min(ran, key=lambda i: cands[i].measured_s)
    from autopar.planning.api import reprice

    for c in cands:  # every plan priced on the refit cluster, as written
        c.plan = reprice(problem.graph, c.plan, result.cluster)
    out = TuneResult(cands, chosen, result, problem.cluster, resolved, probed, time.time() - started,
                     not_run=[list(c.pins) for c in not_run])
    if out.resolved_index != chosen:
        out.notes.append(_disagreement(out))
    return out


def _reprice_s(problem: Problem, plan: Plan, cluster: ClusterSpec) -> float:
    from autopar.planning.api import reprice

    return reprice(problem.graph, plan, cluster).predicted.step_time_s


def _run(problem: Problem, cands: list[Candidate], measure: Measure, probe: bool,
         say: Callable[[str], None]) -> ClusterSpec | None:
    """Measure the candidates not yet run; the probes' cluster when they ran."""
    todo = [(i, c.plan.to_json()) for i, c in enumerate(cands) if c.status is None]
    results, probes = measure(todo, probe, cands)
    for m in results:
        _record(cands[m.index], m)
    if probes is None:
        if probe:
            say("the probes did not finish (a rank failed in them); refitting without their ranges")
        return None
    from autopar.tools.calibrate import build_cluster, measurements_from_dict

    try:
        return build_cluster(measurements_from_dict(probes), name="probes")
    except AutoparError as exc:  # a machine too busy to fit: the refit goes on without the probes' ranges
        say(f"the probes did not fit ({exc}); refitting without their ranges")
        return None


def _disagreement(out: TuneResult) -> str:
    c = out.candidates[out.chosen]
    i = out.resolved_index
    where = f"candidate {i + 1}" if i is not None else "a plan not measured (the budget ran out)"
    return (f"the refit cluster solves to {where}, not to the candidate that measured fastest ({out.chosen + 1}): "
            f"their predictions are within the fit's error; `autopar plan --cluster` with the refit file and "
            f"--pin {' --pin '.join(c.pins)} solves the kept plan's configuration")


def describe_progress(cands: list[Candidate], total: Callable[[], int]) -> tuple[Callable[[int], None],
                                                                                  Callable[[Measured], None]]:
    """The progress lines (stderr) as each candidate starts and lands: which, of how many, predicted, measured."""
    import sys

    def write(line: str) -> None:
        sys.stderr.write(f"autopar tune: {line}\n")
        sys.stderr.flush()

    def start(i: int) -> None:
        c = cands[i]
        write(f"[{i + 1}/{total()}] running {' '.join(_short(c.pins))} (predicted {_ms(c.predicted_before_s)})")

    def done(m: Measured) -> None:
        what = f"measured {_ms(m.measured_s)}" if m.status == OK else f"{m.status}: {m.error}"
        write(f"[{m.index + 1}/{total()}] {what} in {m.wall_s:.0f} s")

    return start, done


def _short(pins: Sequence[str]) -> list[str]:
    """Pins without the degree-1 axes that say nothing."""
    return [p for p in pins if not (p.split("=")[0] in ("pp", "dp", "tp", "cp", "ep") and p.endswith("=1"))]


def _ms(s: float | None) -> str:
    return "-" if s is None or not math.isfinite(s) else f"{s * 1e3:.2f} ms"


def report_json(result: TuneResult) -> dict[str, Any]:
    """The report's JSON: every candidate, the index of the plan written, the refit and the errors."""
    return {"candidates": [c.to_dict() for c in result.candidates], "chosen": result.chosen,
            "resolved": result.resolved_index, "refit": result.refit.to_dict(),
            "prediction_error": {"before": prediction_error(result, after=False),
                                 "after": prediction_error(result, after=True)},
            "wall_s": round(result.wall_s, 2), "probed": result.probed is not None, "notes": result.notes,
            "not_run": result.not_run}


def dumps(result: TuneResult) -> str:
    return json.dumps(report_json(result), indent=2)


def refit_one(graph: Any, plan: Plan, cluster: ClusterSpec, measured_s: float) -> RefitResult:
    """The refit from one plan's measured step time (``calibrate --from-metrics``, and tune's own of one plan)."""
    from autopar.planning.api import reprice

    return refit(lambda cl: [reprice(graph, plan, cl).predicted.step_time_s], cluster, [measured_s])
