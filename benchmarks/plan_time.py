"""Planning time as a whole process, tracing included: the `autopar plan` command, timed.

    python benchmarks/plan_time.py              # GPT-3 175B on 1024 × A100 80GB (the README figure)
    python benchmarks/plan_time.py --sweep      # GPT sizes × world sizes

Each figure is the median wall time of ``--repeat`` runs of the console script
in a fresh interpreter (imports, model construction on the meta device,
capture, solve), with the solver's status and gap as it reported them.

``benchmarks/suite.py`` also times planning inside one interpreter
(:func:`time_in_process`), so that capture and solve are seen apart from the
one-off import cost (:func:`import_seconds`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = [("gpt3_175b", 1024, "a100-80g", 1536)]
SWEEP = [(m, w, "a100-80g", 2 * w) for m in ("gpt2_small", "gpt3_6_7b", "gpt3_175b", "gpt_1t")
         for w in (8, 64, 512, 4096)]
# GPT 125M → 1T (spec functions in examples/gpt.py) and world sizes, for the in-process sweep
MODELS = ("gpt2_small", "gpt2_xl", "gpt3_6_7b", "gpt3_13b", "gpt3_175b", "gpt_1t")
WORLDS = (8, 64, 512, 4096)
# What a fresh planning process imports before it can capture and solve (OR-Tools via the API).
IMPORTS = "import autopar, torch; from autopar import capturing; from autopar.planning import api"


# The console script installed beside this interpreter (not a version manager's shim,
# which adds its own start-up to every run).
AUTOPAR = str(Path(sys.executable).with_name("autopar")) if Path(sys.executable).with_name(
    "autopar").exists() else "autopar"


def spec_of(model: str) -> str:
    """The SPEC string of a GPT example, as `autopar plan` takes it."""
    return f"{ROOT}/examples/gpt.py:{model}"


def mesh_text(mesh: Mapping[str, int] | None) -> str:
    """``pp×dp×tp``, or a dash when there is no plan."""
    return f"{mesh['pp']}×{mesh['dp']}×{mesh['tp']}" if mesh else "—"


def run_once(model: str, world: int, cluster: str, batch: int) -> tuple[float, dict]:
    cmd = [AUTOPAR, "plan", spec_of(model), "--world-size", str(world),
           "--cluster", cluster, "--batch-size", str(batch), "--json"]
    wall, proc = timed(lambda: subprocess.run(cmd, capture_output=True, text=True))
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    if proc.returncode == 3:
        return wall, {"status": "INFEASIBLE", "gap": None, "mesh": None}
    plan = json.loads(proc.stdout)
    return wall, {"status": plan["solver"]["status"], "gap": plan["solver"]["gap"], "mesh": plan["mesh"]}


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """Median wall time of ``repeat`` calls of ``fn``, and the last call's result."""
    walls, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), result


def import_seconds(repeat: int = 3) -> float:
    """Median wall time of a fresh interpreter running only :data:`IMPORTS` (start-up included)."""
    return timed(lambda: subprocess.run([sys.executable, "-c", IMPORTS], check=True), repeat)[0]


@dataclass(frozen=True)
class InProcessCase:
    """One model × world size planned in a warm interpreter; planning = capture + solve."""

    model: str
    params: int
    layers: int  # capture time follows the layer count more than the parameter count
    world: int
    cluster: str
    batch: int
    build_s: float  # constructing the model on the meta device (not part of planning)
    capture_s: float  # once per model, shared by its world sizes
    solve_s: float
    status: str  # the solver's status, or "infeasible"
    gap: float | None
    mesh: Mapping[str, int] | None
    note: str = ""  # why it is infeasible

    @property
    def plan_s(self) -> float:
        return self.capture_s + self.solve_s


def time_in_process(model: str, worlds: Sequence[int] = WORLDS, cluster: str = "a100-80g",
                    repeat: int = 1) -> list[InProcessCase]:
    """Build and capture ``model``, then solve it for each world size at global batch 2×world.

    In-process, so that import and first-use costs (paid once per process)
    do not hide how capture and solve grow with model and world size. Capture
    and each solve are timed ``repeat`` times and the median kept.
    """
    import autopar
    from autopar.tools.spec import load_spec
    from autopar.units import format_bytes

    build_s, (module, inputs) = timed(lambda: load_spec(spec_of(model)))
    params = sum(p.numel() for p in module.parameters())
    capture_s, graph = timed(lambda: autopar.capture(module, inputs), repeat)

    def solve(world: int) -> dict[str, Any]:
        try:
            plan = autopar.solve(graph, world, cluster=cluster, global_batch=2 * world)
        except autopar.InfeasibleError as exc:
            need = exc.min_memory_bytes
            return {"status": "infeasible", "gap": None, "mesh": None,
                    "note": f"needs {format_bytes(need)} per rank" if need else str(exc)}
        return {"status": plan.solver.status, "gap": plan.solver.gap,
                "mesh": {"pp": plan.mesh.pp, "dp": plan.mesh.dp, "tp": plan.mesh.tp}}

    cases = []
    for world in worlds:
        solve_s, info = timed(lambda: solve(world), repeat)
        cases.append(InProcessCase(model, params, len(graph.layers), world, cluster, 2 * world, build_s,
                                   capture_s, solve_s, **info))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| model | world | cluster | batch | wall s (median) | status | gap | mesh pp×dp×tp |")
    print("|---|---:|---|---:|---:|---|---:|---|")
    for model, world, cluster, batch in SWEEP if args.sweep else HEADLINE:
        walls, info = [], {}
        for _ in range(args.repeat):
            wall, info = run_once(model, world, cluster, batch)
            walls.append(wall)
        gap = f"{info['gap']:.2%}" if info["gap"] is not None else "—"
        print(f"| {model} | {world} | {cluster} | {batch} | {statistics.median(walls):.2f} | "
              f"{info['status']} | {gap} | {mesh_text(info['mesh'])} |", flush=True)


if __name__ == "__main__":
    main()
