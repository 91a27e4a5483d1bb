"""float8's price beside torchtitan's published figures: Llama 3.1 8B on 8 × H100, FSDP with SAC.

    python benchmarks/float8_pricing.py

torchtitan's docs/performance.md reports, for this run (local batch 2, 8,192 tokens, FSDP, op-level
SAC): 5,762 tokens/s per GPU eager, 6,667 with each block under torch.compile, 8,532 with float8
(tensorwise) on top. This prices the same plan three ways with the presets as they are (the
calibration set's first row, benchmarks/calibration_set.py) — eager, compiled, compiled + float8 on
every linear of the 32 blocks — and prints predicted against published. Nothing here is fitted to
the compiled or float8 figures: the gap is what the compile and float8 terms of the cost model get
wrong (docs/cost-model.md, "torch.compile" and "float8").
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "examples"))
sys.path.insert(0, str(ROOT))

PUBLISHED = {"eager": 5762, "compiled": 6667, "compiled + float8": 8532}


def main() -> None:
    import llama
    from calibration_set import BLOCKS, NOT_BLOCKS, RUNS

    import autopar
    from autopar.cost_models.presets import PRESETS
    from autopar.float8 import settings_for

    run = RUNS[0]
    model, inputs = getattr(llama, run.model)()
    graph = autopar.capture(model, inputs)
    f8 = settings_for(model, graph, "tensorwise")
    pins = ["pp=1", "tp=1", "microbatches=1", "zero=3", "loss=full", f"{BLOCKS}:recompute={run.recompute}",
            *(f"{name}:recompute=none" for name in NOT_BLOCKS)]
    kw = dict(cluster=PRESETS[run.cluster], global_batch=run.local_batch * run.gpus, pins=pins, memory_gb=10_000)
    plans = {"eager": autopar.solve(graph, run.gpus, **kw),
             "compiled": autopar.solve(graph, run.gpus, compiled=True, **kw),
             "compiled + float8": autopar.solve(graph, run.gpus, compiled=True, float8=f8, **kw),
             "eager + float8": autopar.solve(graph, run.gpus, float8=f8, **kw)}
    print(f"{run.name}: {len(f8.linears)} linears in float8 ({f8.recipe.value})")
    print(f"{'plan':18s} {'published':>10s} {'predicted':>10s} {'error':>7s} {'vs eager':>9s}")
    base = plans["eager"].predicted.tokens_per_s_per_gpu
    for name, plan in plans.items():
        tokens = plan.predicted.tokens_per_s_per_gpu
        published = PUBLISHED.get(name)
        error = f"{tokens / published - 1:+.1%}" if published else "—"
        print(f"{name:18s} {published or '—':>10} {tokens:>10,.0f} {error:>7s} {tokens / base:>8.2f}×")


if __name__ == "__main__":
    main()
