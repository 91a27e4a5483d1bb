"""The chosen plan against every baseline of `autopar compare`, over a matrix of cases.

    python benchmarks/compare_matrix.py

For each case (model × cluster × world size × batch, some memory-tight) it
prints the chosen plan's predicted step time, the best baseline that fits and
their ratio. The chosen plan must never be slower than a baseline under the
same cost model; the script exits 1 if it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autopar  # noqa: E402

import convnet  # noqa: E402
import gpt  # noqa: E402
import llama  # noqa: E402

# (label, spec function, cluster, world size, global batch, memory budget GiB or None)
CASES = [
    ("gpt2-small", gpt.gpt2_small, "a100-40g", 8, 64, None),
    ("gpt2-small", gpt.gpt2_small, "v100-16g", 16, 128, None),
    ("gpt2-xl", gpt.gpt2_xl, "v100-16g", 32, 64, None),
    ("gpt2-xl", gpt.gpt2_xl, "a100-40g", 64, 512, 8),
    ("gpt3-6.7b", gpt.gpt3_6_7b, "a100-40g", 64, 256, None),
    ("gpt3-6.7b", gpt.gpt3_6_7b, "v100-16g", 128, 256, None),
    ("gpt3-13b", gpt.gpt3_13b, "a100-80g", 128, 512, None),
    ("gpt3-13b", gpt.gpt3_13b, "h100-80g", 32, 64, 20),
    ("gpt3-175b", gpt.gpt3_175b, "a100-80g", 1024, 1536, None),
    ("gpt3-175b", gpt.gpt3_175b, "h100-80g", 512, 1024, None),
    ("llama3-8b", llama.llama3_8b, "h100-80g", 64, 64, None),
    ("llama3-8b", llama.llama3_8b, "a100-40g", 32, 32, None),
    ("llama3-70b", llama.llama3_70b, "h100-80g", 256, 256, None),
    ("resnet18ish", convnet.resnet18ish, "a100-40g", 8, 256, None),
]


def main() -> int:
    graphs: dict[str, autopar.LayerGraph] = {}
    print("| model | cluster | world | batch | memory GiB | chosen s | best baseline | baseline s | "
          "baseline / chosen |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    failures = 0
    for label, spec, cluster, world, batch, memory in CASES:
        if label not in graphs:
            graphs[label] = autopar.capture(*spec())
        chosen, baselines = autopar.compare(graphs[label], world, cluster=cluster, global_batch=batch,
                                            memory_gb=memory)
        fitting = [b for b in baselines if b.fits]
        best = min(fitting, key=lambda b: b.plan.predicted.step_time_s, default=None)
        chosen_s = chosen.plan.predicted.step_time_s if chosen.fits else float("inf")
        best_s = best.plan.predicted.step_time_s if best else float("inf")
        if chosen_s > best_s * (1 + 1e-9):
            failures += 1
        ratio = f"{best_s / chosen_s:.3f}" if best and chosen.fits else "—"
        mem = f"{memory}" if memory else "default"
        print(f"| {label} | {cluster} | {world} | {batch} | {mem} | {chosen_s:.4g} | "
              f"{best.name if best else 'none fits'} | {best_s:.4g} | {ratio} |", flush=True)
    print(f"\n{len(CASES)} cases, {failures} where a baseline beat the chosen plan")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
