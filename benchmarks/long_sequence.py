"""Long-sequence plans: Llama 3 8B at 131,072 tokens on 64 × h100-80g, 70B at 131,072 on 512.

Usage: python benchmarks/long_sequence.py

Prints, for each, the plan (mesh, step time, memory, solver status and time)
or the one line saying why none fits. Issue 25's goal: a plan, OPTIMAL, ≤ 10 s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import hf_llama  # noqa: E402

from autopar import capture  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.planning.api import solve  # noqa: E402

CASES = [("llama3_8b", 131_072, 64), ("llama3_70b", 131_072, 512)]


def main() -> None:
    for name, seq, world in CASES:
        with torch.device("meta"):
            model, inputs = getattr(hf_llama, name)(seq)
        start = time.perf_counter()
        graph = capture(model, inputs, name=name)
        captured = time.perf_counter() - start
        try:
            plan = solve(graph, world, cluster="h100-80g", time_limit_s=60.0)
        except AutoparError as exc:
            print(f"{name} S={seq:,} on {world}: no plan ({time.perf_counter() - start:.1f} s, "
                  f"capture {captured:.1f} s): {exc}")
            continue
        p = plan.predicted
        print(f"{name} S={seq:,} on {world}: {plan.mesh} step {p.step_time_s:.2f} s, "
              f"{max(p.memory_per_rank_bytes) / 2**30:.1f} GiB/rank, {plan.solver.status} in "
              f"{plan.solver.wall_s:.1f} s (total {time.perf_counter() - start:.1f} s, capture {captured:.1f} s)")


if __name__ == "__main__":
    main()
