"""The one H200's measured training steps beside what the presets predict for them now.

    python benchmarks/h200_rows.py            # the table, with the median and largest |error|

One session of this project was lent one H200 (docs/benchmarks.md, "One H200: the GPU check"): 21
single-device bf16 plans of three GPTs (``benchmarks/gpu_check.py``'s models and plans: 125M and 350M at
1,024 tokens, 125M at 8,192; recompute, microbatches, compiled, float8), each timed as the median of 10
steps. Their measured step times are written here as the check printed them. Each plan is priced again on
the ``h200`` preset as it is: device facts (the GEMM's measured rate, the cited per-op terms), the stack's
share fitted on the calibration set, and the host's time issuing each op (``OpModel.host_op_s``,
``gpu_figures.CHECKPOINT_HOST_OPS``). Nothing is fitted to these rows: they are the check that the host
and kernel terms carry to small models, whose steps the host paces.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "examples"))
sys.path.insert(0, str(ROOT))

from gpu_check import COMPILED_PLANS, FLOAT8_PLANS, GPU_MODELS, PLANS, solve_plan  # noqa: E402

BATCH = 8  # gpu_check's batch on a GPU
# (model, plan) → median measured step seconds on the H200 (torch 2.11.0+cu130, 2026-12-04; docs/benchmarks.md)
MEASURED_S = {
    ("gpt-125m", "m1"): 0.0327, ("gpt-125m", "m1 recompute"): 0.0665, ("gpt-125m", "m2"): 0.0622,
    ("gpt-125m", "m4 recompute"): 0.2507, ("gpt-125m", "m1 compiled"): 0.0331, ("gpt-125m", "m1 float8"): 0.1483,
    ("gpt-125m", "m1 compiled float8"): 0.0633,
    ("gpt-125m-8k", "m1"): 0.2345, ("gpt-125m-8k", "m1 recompute"): 0.2794, ("gpt-125m-8k", "m2"): 0.2403,
    ("gpt-125m-8k", "m4 recompute"): 0.2953, ("gpt-125m-8k", "m1 compiled"): 0.2288,
    ("gpt-125m-8k", "m1 float8"): 0.4939, ("gpt-125m-8k", "m1 compiled float8"): 0.2899,
    ("gpt-350m", "m1"): 0.0698, ("gpt-350m", "m1 recompute"): 0.1307, ("gpt-350m", "m2"): 0.1126,
    ("gpt-350m", "m4 recompute"): 0.4428, ("gpt-350m", "m1 compiled"): 0.0881, ("gpt-350m", "m1 float8"): 0.3487,
    ("gpt-350m", "m1 compiled float8"): 0.1132,
}
# what the GPU check predicted beside each, on the cluster it fitted on the H200 then (docs/benchmarks.md)
PREDICTED_THEN_S = {
    ("gpt-125m", "m1"): 0.0183, ("gpt-125m", "m1 recompute"): 0.0234, ("gpt-125m", "m2"): 0.0198,
    ("gpt-125m", "m4 recompute"): 0.0352, ("gpt-125m", "m1 compiled"): 0.0168, ("gpt-125m", "m1 float8"): 0.0460,
    ("gpt-125m", "m1 compiled float8"): 0.0174,
    ("gpt-125m-8k", "m1"): 0.1912, ("gpt-125m-8k", "m1 recompute"): 0.2414, ("gpt-125m-8k", "m2"): 0.1929,
    ("gpt-125m-8k", "m4 recompute"): 0.2472, ("gpt-125m-8k", "m1 compiled"): 0.1808,
    ("gpt-125m-8k", "m1 float8"): 0.3445, ("gpt-125m-8k", "m1 compiled float8"): 0.1756,
    ("gpt-350m", "m1"): 0.0416, ("gpt-350m", "m1 recompute"): 0.0541, ("gpt-350m", "m2"): 0.0442,
    ("gpt-350m", "m4 recompute"): 0.0770, ("gpt-350m", "m1 compiled"): 0.0376, ("gpt-350m", "m1 float8"): 0.1118,
    ("gpt-350m", "m1 compiled float8"): 0.0392,
}


def plans():
    """(model, plan name, pins, compiled, float8 recipe) of every measured row, in the check's order."""
    for model in GPU_MODELS:
        for name, pins in PLANS:
            yield model, name, pins, False, None
        for name, pins in COMPILED_PLANS:
            yield model, name, pins, True, None
        for name, pins, compiled, recipe in FLOAT8_PLANS:
            yield model, name, pins, compiled, recipe


def rows(cluster_name: str = "h200") -> list[dict]:
    """Each measured plan priced on ``cluster_name`` (one device): predicted now beside measured."""
    from autopar.cost_models.presets import load_cluster

    cluster = load_cluster(cluster_name).for_world_size(1)
    out = []
    for model, name, pins, compiled, recipe in plans():
        key = (model.name, name)
        # the loss they ran: torch's cross-entropy over the whole logits (the chunked loss came later)
        plan = solve_plan(model, (*pins, "loss=full"), cluster, BATCH, compiled=compiled, float8=recipe)[3]
        predicted, measured = plan.predicted.step_time_s, MEASURED_S[key]
        out.append({"model": model.name, "plan": name, "measured_s": measured, "predicted_s": predicted,
                    "ratio": measured / predicted, "ratio_then": measured / PREDICTED_THEN_S[key]})
    return out


def render(table: list[dict]) -> str:
    lines = ["| model | plan | measured s | predicted s | measured / predicted | before (fitted cluster) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['plan']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | "
                     f"{r['ratio']:.2f} | {r['ratio_then']:.2f} |")
    errors = [abs(r["ratio"] - 1) for r in table]
    then = [abs(r["ratio_then"] - 1) for r in table]
    within = sum(e <= 0.25 for e in errors)
    lines.append(f"\nmedian |measured / predicted − 1| {statistics.median(errors):.1%} "
                 f"(before {statistics.median(then):.1%}); largest {max(errors):.1%} (before {max(then):.1%}); "
                 f"{within} of {len(table)} rows within 25%")
    return "\n".join(lines)


def main() -> None:
    print(render(rows()))


if __name__ == "__main__":
    main()
