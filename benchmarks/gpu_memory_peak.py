"""What is live at a training step's peak on one GPU, by the code that allocated it, beside the plan's price.

    python benchmarks/gpu_memory_peak.py --json peak.json      # on a machine with a GPU

The GPU check (``gpu_check.py``) sets each plan's measured peak beside the priced one; where they differ,
this says by what. One bf16 single-device plan per (model, pins) of the check's GPT sizes is compiled and
warmed up two steps; the next step runs under the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``), whose trace is replayed to the moment most bytes were
live. Those blocks are grouped by the innermost Python frame in the project's, the model's or torch's
module code that allocated them; the bytes already live when recording began (weights, masters, AdamW
state, gradients kept between steps) are one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "examples"))
sys.path.insert(0, str(ROOT))

RUNS = (("gpt-125m-8k", ("recompute=none", "microbatches=1")), ("gpt-125m-8k", ("recompute=all", "microbatches=1")),
        ("gpt-125m", ("recompute=none", "microbatches=1")))
SKIP = ("/torch/utils/_", "/torch/_ops.py", "/torch/autograd/", "/torch/_tensor.py", "/torch/overrides.py",
        "/torch/nn/modules/module.py", "contextlib.py", "/torch/_compile.py", "/torch/_dynamo/")


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame that names the code responsible, as ``file:line function``."""
    for f in frames:
        name = f.get("filename", "")
        if name and not any(s in name for s in SKIP) and name != "??":
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def peak_live(trace: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """(most bytes live at once above the start, the blocks live then) from one device's allocator trace."""
    live: dict[int, dict[str, Any]] = {}
    total = best = 0
    best_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > best:
            best, best_at = total, i
    live.clear()
    for e in trace[:best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] in ("free_requested", "free_completed"):
            live.pop(e["addr"], None)
    return best, live


def run(model_name: str, pins: tuple[str, ...], device: Any) -> dict[str, Any]:
    import torch
    from gpu_check import GPU_MODELS, solve_plan, train_and_time

    from autopar.cost_models.presets import load_cluster
    from autopar.runtime.launch import local_cluster

    model = next(m for m in GPU_MODELS if m.name == model_name)
    cluster = load_cluster(local_cluster())
    net, inputs, graph, plan = solve_plan(model, pins, cluster, batch=8)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, model.vocab, (8, model.seq), generator=g) for _ in range(2))
    pm = train_and_time(net, inputs, graph, plan, (x, y), device, steps=0)[0]  # compiled, two steps warm
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    pm.train_step(x, y)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    above, live = peak_live(snapshot["device_traces"][device.index or 0])
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        key = where(e.get("frames", []))
        groups[key][0] += e["size"]
        groups[key][1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:30]
    del pm, net
    torch.cuda.empty_cache()
    b = plan.predicted.breakdown
    return {"model": model_name, "pins": list(pins), "predicted_bytes": plan.predicted.memory_per_rank_bytes[0],
            "peak_bytes": peak, "live_at_step_start_bytes": start, "replayed_above_start_bytes": above,
            "breakdown": {k: getattr(b, k) for k in getattr(b, "__dataclass_fields__", {})},
            "at_peak": [{"where": k, "bytes": v[0], "blocks": v[1]} for k, v in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        parser.error("no CUDA device here: this reads the CUDA caching allocator's history")
    from gpu_check import init_group

    device = init_group(False)
    results = []
    for name, pins in RUNS:
        try:
            results.append(run(name, pins, device))
        except Exception as exc:  # noqa: BLE001 - one run's failure is reported, the others still run
            results.append({"model": name, "pins": list(pins), "error": f"{type(exc).__name__}: {exc}"})
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
        r = results[-1]
        if "error" in r:
            print(f"{name} {' '.join(pins)}: FAILED {r['error']}")
            continue
        print(f"\n{name} {' '.join(pins)}: peak {r['peak_bytes'] / 2**20:.0f} MiB, predicted "
              f"{r['predicted_bytes'] / 2**20:.0f} MiB; live at step start {r['live_at_step_start_bytes'] / 2**20:.0f}"
              f" MiB, above it at the peak {r['replayed_above_start_bytes'] / 2**20:.0f} MiB")
        for g in r["at_peak"][:20]:
            print(f"  {g['bytes'] / 2**20:9.1f} MiB {g['blocks']:5d} blocks  {g['where']}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
