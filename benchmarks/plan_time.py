"""Planning time as a whole process, tracing included: the `autopar plan` command, timed.

    python benchmarks/plan_time.py              # GPT-3 175B on 1024 × A100 80GB (the README figure)
    python benchmarks/plan_time.py --sweep      # GPT sizes × world sizes

Each figure is the median wall time of ``--repeat`` runs of the console script
in a fresh interpreter (imports, model construction on the meta device,
capture, solve), with the solver's status and gap as it reported them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = [("gpt3_175b", 1024, "a100-80g", 1536)]
SWEEP = [(m, w, "a100-80g", 2 * w) for m in ("gpt2_small", "gpt3_6_7b", "gpt3_175b", "gpt_1t")
         for w in (8, 64, 512, 4096)]


# The console script installed beside this interpreter (not a version manager's shim,
# which adds its own start-up to every run).
AUTOPAR = str(Path(sys.executable).with_name("autopar")) if Path(sys.executable).with_name(
    "autopar").exists() else "autopar"


def run_once(model: str, world: int, cluster: str, batch: int) -> tuple[float, dict]:
    cmd = [AUTOPAR, "plan", f"{ROOT}/examples/gpt.py:{model}", "--world-size", str(world),
           "--cluster", cluster, "--batch-size", str(batch), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    if proc.returncode == 3:
        return wall, {"status": "INFEASIBLE", "gap": None, "mesh": None}
    plan = json.loads(proc.stdout)
    return wall, {"status": plan["solver"]["status"], "gap": plan["solver"]["gap"], "mesh": plan["mesh"]}


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
        mesh = info["mesh"]
        mesh_text = f"{mesh['pp']}×{mesh['dp']}×{mesh['tp']}" if mesh else "—"
        gap = f"{info['gap']:.2%}" if info["gap"] is not None else "—"
        print(f"| {model} | {world} | {cluster} | {batch} | {statistics.median(walls):.2f} | "
              f"{info['status']} | {gap} | {mesh_text} |", flush=True)


if __name__ == "__main__":
    main()
