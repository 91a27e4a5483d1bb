"""Predicted against measured, here: plans of a small GPT run for real on gloo.

    python benchmarks/fidelity.py [--json FILE] [--steps 8] [--cluster W=FILE ...]

For W = 2 and W = 4, each plan below (every choice pinned) is run with
``autopar.compile`` on W gloo processes (AdamW, the plan's batch; fp32, and
three bf16 plans: bf16 compute with fp32 master weights, AdamW state and
gradient reduction — FSDP2's mixed-precision policy under ZeRO-3, the
runtime's fp32 masters under DDP and a pipeline).
The same W processes calibrate the machine with ``autopar calibrate``'s
probes and fitting (its cluster file is written beside ``--json``) halfway
through the timed steps, and each plan is priced on that
cluster with ``autopar.reprice``; ``--cluster W=FILE`` prices on a given file
instead.

- Step time: the median over ``--steps`` timed steps (after one warm-up step)
  of rank 0's ``train_step`` wall time, each step started after a barrier.
  The plans of one world size take turns step by step, so the machine's slow
  spells fall on all of them alike.
- Peak memory per rank: the most bytes of tensors live at once on that rank
  over four training steps (the first creates the optimizer state; in the
  second DDP rebuilds its gradient buckets), counting everything allocated
  since compiling began (the model is built on the meta device, so only the
  rank's shards are ever allocated); read from the profiler's allocation
  events on CPU (``torch.cuda.max_memory_allocated`` on GPUs). It is compared
  with the plan's prediction for that rank's pipeline stage.

Prints a Markdown table, the median absolute step-time error, the Spearman
rank correlation of predicted and measured step times, and the worst
measured / predicted memory. Goals: rank correlation ≥ 0.8, median error
≤ 25 %, memory never more than 10 % above prediction. The step-time
figures are over the fp32 plans: this CPU has no bf16 matrix units (its
bf16 GEMM ran ~5× slower than fp32), so bf16 step times say nothing about
the GPUs the model is for; the memory goal covers every plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

GPT = dict(n_layer=4, d_model=256, n_head=8, vocab_size=2048, seq_len=64)
GLOBAL_BATCH = 16
GOALS = {"spearman": 0.8, "median_abs_step_error": 0.25, "max_memory_ratio": 1.10}

_PLAIN = ["recompute=none", "microbatches=1"]
_TP_BLOCKS = ["blocks.*:tp=megatron", "tok_emb:tp=none", "pos_emb:tp=none", "drop:tp=none",
              "ln_f:tp=none", "lm_head:tp=none"]


@dataclass(frozen=True)
class Case:
    """One plan to run: a name, the world size and the pins that fix it."""

    name: str
    world_size: int
    pins: tuple[str, ...]
    dtype: str = "fp32"


CASES = [
    Case("DP", 2, ("pp=1", "dp=2", "tp=1", "zero=0", *_PLAIN)),
    Case("DP, 4 microbatches", 2, ("pp=1", "dp=2", "tp=1", "zero=0", "recompute=none", "microbatches=4")),
    Case("DP, recompute", 2, ("pp=1", "dp=2", "tp=1", "zero=0", "recompute=all", "microbatches=1")),
    Case("ZeRO-2", 2, ("pp=1", "dp=2", "tp=1", "zero=2", *_PLAIN)),
    Case("ZeRO-3", 2, ("pp=1", "dp=2", "tp=1", "zero=3", *_PLAIN)),
    Case("ZeRO-0/3 blocks", 2, ("pp=1", "dp=2", "tp=1", "blocks.0:zero=3", "blocks.1:zero=0",
                                "blocks.2:zero=0", "blocks.3:zero=3", *_PLAIN)),
    Case("ZeRO-3, root asks 0", 2, ("pp=1", "dp=2", "tp=1", "blocks.*:zero=3", "tok_emb:zero=0",
                                    "pos_emb:zero=0", "ln_f:zero=0", "lm_head:zero=0", *_PLAIN)),
    Case("TP", 2, ("pp=1", "dp=1", "tp=2", "zero=0", *_PLAIN, *_TP_BLOCKS)),
    Case("PP GPipe m4", 2, ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "schedule=gpipe",
                            "microbatches=4")),
    Case("PP 1F1B m2", 2, ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "schedule=1f1b",
                           "microbatches=2")),
    Case("DP", 4, ("pp=1", "dp=4", "tp=1", "zero=0", *_PLAIN)),
    Case("ZeRO-3", 4, ("pp=1", "dp=4", "tp=1", "zero=3", *_PLAIN)),
    Case("DP×TP", 4, ("pp=1", "dp=2", "tp=2", "zero=0", *_PLAIN, *_TP_BLOCKS)),
    Case("PP×DP 1F1B m2", 4, ("pp=2", "dp=2", "tp=1", "zero=0", "recompute=none", "schedule=1f1b",
                              "microbatches=2")),
    Case("PP×TP GPipe m2", 4, ("pp=2", "dp=1", "tp=2", "zero=0", "recompute=none", "schedule=gpipe",
                               "microbatches=2", *_TP_BLOCKS)),
    Case("DP, selective", 2, ("pp=1", "dp=2", "tp=1", "zero=0", "recompute=selective", "microbatches=1")),
    Case("TP, selective", 2, ("pp=1", "dp=1", "tp=2", "zero=0", "recompute=selective", "microbatches=1",
                              *_TP_BLOCKS)),
    Case("TP+SP", 2, ("pp=1", "dp=1", "tp=2", "zero=0", *_PLAIN, *_TP_BLOCKS, "blocks.*:sp=on")),
    Case("DP×TP+SP", 4, ("pp=1", "dp=2", "tp=2", "zero=0", *_PLAIN, *_TP_BLOCKS, "blocks.*:sp=on")),
    Case("PP×TP+SP GPipe m2, selective", 4, ("pp=2", "dp=1", "tp=2", "zero=0", "recompute=selective",
                                             "schedule=gpipe", "microbatches=2", *_TP_BLOCKS, "blocks.*:sp=on")),
    Case("ZeRO-3 bf16", 2, ("pp=1", "dp=2", "tp=1", "zero=3", *_PLAIN), "bf16"),
    Case("DP bf16", 2, ("pp=1", "dp=2", "tp=1", "zero=0", *_PLAIN), "bf16"),
    Case("PP 1F1B m2 bf16", 2, ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "schedule=1f1b",
                                "microbatches=2"), "bf16"),
]


def build(device: str = "meta") -> tuple[Any, tuple]:
    import gpt
    import torch

    torch.manual_seed(0)
    return gpt.gpt(**GPT, device=device)


# ------------------------------------------------------------------ measuring on a rank


# one home for the CPU memory measurement: autopar tune reads plans' memory the same way
from autopar.tools.tune.memory import MARK as _TRAINING  # noqa: E402
from autopar.tools.tune.memory import peak_tensor_bytes  # noqa: E402,F401 - imported from here by tests
from autopar.tools.tune.memory import profiled as _profiled  # noqa: E402


def _compile_and_measure_memory(plan_json: str, graph: dict) -> tuple[Any, int, tuple]:
    """Compile one plan on this rank and train two steps: the model, its peak tensor bytes, a batch."""
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.graph import LayerGraph
    from autopar.plan import Plan

    plan = Plan.from_json(plan_json)
    g = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, GPT["seq_len"])
    batches = [(torch.randint(0, GPT["vocab_size"], shape, generator=g),
                torch.randint(0, GPT["vocab_size"], shape, generator=g)) for _ in range(4)]
    gc.collect()
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

    def compile_and_train() -> Any:
        model, inputs = build("meta")
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=LayerGraph.from_dict(graph))
        with torch.profiler.record_function(_TRAINING):
            for x, y in batches:
                pm.train_step(pm.local_batch(x), pm.local_batch(y))
        return pm

    if cuda:
        pm = compile_and_train()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        pm, (events, started) = _profiled(compile_and_train)
        peak = peak_tensor_bytes(events, started)
    return pm, peak, tuple(pm.local_batch(t) for t in batches[0])


def _worker(rank: int, world_size: int, store: str, jobs: list[tuple[str, dict]], steps: int,
            calibrate: bool, out: str) -> None:
    """Compile every plan (measuring its memory), then time the plans' steps in turns, calibrating
    halfway through.

    Calibrating here, in the processes that train and amid the steps that
    are timed, keeps the machine's drift out of the comparison: on this shared
    machine the same probe's time moved by ±30 % between minutes.

    Taking turns — step 1 of every plan, then step 2 of every plan, … — spreads
    the slow spells of a shared machine over all plans alike, so they disturb
    the plans' ranking less than timing one plan after another would.
    """
    import torch
    import torch.distributed as dist

    from autopar.tools.host import threads_per_process

    torch.set_num_threads(threads_per_process(world_size))
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=600))
    models, peaks, batches = [], [], []
    for k, (plan_json, graph) in enumerate(jobs):
        pm, peak, batch = _compile_and_measure_memory(plan_json, graph)
        models.append(pm)
        peaks.append(peak)
        batches.append(batch)
        if rank == 0:
            print(f"fidelity: W={world_size} plan {k + 1}/{len(jobs)} compiled, memory measured",
                  file=sys.stderr, flush=True)
    times: list[list[float]] = [[] for _ in jobs]

    def timed_rounds(rounds: int, warm_up: bool = False) -> None:
        for step in range(rounds + warm_up):
            for k, (pm, (x, y)) in enumerate(zip(models, batches)):
                dist.barrier()
                t = time.perf_counter()
                pm.train_step(x, y)
                if step or not warm_up:
                    times[k].append(time.perf_counter() - t)

    # half the steps, the calibration, the other half: the calibration sits amid the steps it prices
    timed_rounds(steps // 2, warm_up=True)
    measurements = None
    if calibrate:
        from autopar.tools.calibrate import measure_in_process_group, probe_sizes
        from autopar.tools.host import available_memory_bytes

        progress = (lambda line: print(f"fidelity: calibrate W={world_size}: {line}", file=sys.stderr,
                                       flush=True)) if rank == 0 else None
        measurements = measure_in_process_group("gloo", probe_sizes("gloo"),
                                                (available_memory_bytes() or 0) // world_size,
                                                progress=progress).__dict__
    timed_rounds(steps - steps // 2)
    results = [{"peak_bytes": peak, "step_s": statistics.median(ts)} for peak, ts in zip(peaks, times)]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, results)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": gathered, "measurements": measurements}))


def measure(jobs: list[tuple[str, dict]], world_size: int, steps: int,
            calibrate: bool) -> tuple[list[list[dict[str, Any]]], dict | None]:
    """Run every plan on ``world_size`` spawned gloo ranks: per rank, per plan, peak bytes and step
    time; and the calibration measurements taken in those ranks (None unless ``calibrate``)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autopar-fidelity-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), jobs, steps, calibrate,
                                          out),
                           nprocs=world_size, start_method="spawn")
        data = json.loads(Path(out).read_text())
        return data["ranks"], data["measurements"]


# ------------------------------------------------------------------ statistics


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


# ------------------------------------------------------------------ main


def _write_cluster(measurements: dict, path: Path) -> str:
    """The cluster the ranks measured, written as `autopar calibrate` writes it."""
    from autopar.tools.calibrate import (
        build_cluster,
        cluster_document,
        describe,
        measurements_from_dict,
        write_atomically,
    )

    m = measurements_from_dict(measurements)
    cluster = build_cluster(m)
    write_atomically(path, json.dumps(cluster_document(cluster, m), indent=2) + "\n")
    print(describe(cluster), file=sys.stderr, flush=True)
    return str(path)


def main() -> int:
    import autopar

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per plan")
    parser.add_argument("--cluster", action="append", default=[], metavar="W=FILE",
                        help="price the plans of world size W on this cluster file instead of "
                             "calibrating in the ranks")
    parser.add_argument("--calibration-dir", default=None,
                        help="where fresh calibrations are written (default: beside --json)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    given = {int(w): path for w, _, path in (item.partition("=") for item in args.cluster)}
    out_dir = Path(args.calibration_dir or (Path(args.json).parent if args.json else tempfile.mkdtemp()))
    out_dir.mkdir(parents=True, exist_ok=True)
    worlds = sorted({c.world_size for c in CASES})
    model, inputs = build("meta")
    graph = autopar.capture(model, inputs)
    rows, clusters = [], {}
    for w in worlds:
        cases = [c for c in CASES if c.world_size == w]
        # every choice is pinned but the pipeline cuts, which the solver makes on the cluster the
        # plans are first priced on; they are then priced again, unchanged, on the calibration
        first = given.get(w, "cpu")
        plans = [autopar.solve(graph, w, cluster=first, dtype=c.dtype, global_batch=GLOBAL_BATCH,
                               pins=list(c.pins), memory_gb=64) for c in cases]
        started = time.perf_counter()
        per_rank, measurements = measure([(p.to_json(), graph.to_dict()) for p in plans], w, args.steps,
                                         calibrate=w not in given)
        print(f"fidelity: W={w}: {len(cases)} plans in {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
        clusters[w] = given.get(w) or _write_cluster(measurements, out_dir / f"cluster-w{w}.json")
        plans = [autopar.reprice(graph, p, clusters[w]) for p in plans]
        for k, (case, plan) in enumerate(zip(cases, plans)):
            ranks = [per_rank[r][k] for r in range(w)]
            stage_of = [r // (plan.mesh.dp * plan.mesh.tp) for r in range(w)]
            predicted_mem = [plan.predicted.memory_per_rank_bytes[s] for s in stage_of]
            worst = max(range(w), key=lambda r: ranks[r]["peak_bytes"] / predicted_mem[r])
            measured_s, predicted_s = ranks[0]["step_s"], plan.predicted.step_time_s
            rows.append({
                "name": case.name, "world_size": w, "dtype": case.dtype,
                "mesh": f"{plan.mesh.pp}×{plan.mesh.dp}×{plan.mesh.tp}", "schedule": plan.schedule.value,
                "microbatches": plan.microbatches,
                "predicted_step_s": predicted_s, "measured_step_s": measured_s,
                "step_error": measured_s / predicted_s - 1,
                "predicted_peak_bytes": predicted_mem[worst], "measured_peak_bytes": ranks[worst]["peak_bytes"],
                "memory_ratio": ranks[worst]["peak_bytes"] / predicted_mem[worst],
                "breakdown": plan.predicted.breakdown.__dict__,
            })
    timed = [r for r in rows if r["dtype"] == "fp32"]  # see the module docstring
    result = {
        "model": f"GPT {GPT['n_layer']} layers, d {GPT['d_model']}, vocab {GPT['vocab_size']}, "
                 f"seq {GPT['seq_len']}, global batch {GLOBAL_BATCH}, AdamW (fp32; bf16 plans: bf16 "
                 "compute, fp32 masters)",
        "machine": f"{platform.platform()}, {os.cpu_count()} cores, gloo",
        "steps": args.steps, "clusters": {str(w): p for w, p in clusters.items()}, "plans": rows,
        "median_abs_step_error": statistics.median(abs(r["step_error"]) for r in timed),
        "spearman": spearman([r["predicted_step_s"] for r in timed], [r["measured_step_s"] for r in timed]),
        "time_plans": "fp32",
        "max_memory_ratio": max(r["memory_ratio"] for r in rows),
    }
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table and the three summary figures against their goals."""
    MiB = 2**20
    lines = [f"{result['model']}; {result['machine']}; median of {result['steps']} steps", "",
             "| plan | W | pp×dp×tp | schedule | m | predicted s | measured s | error | "
             "predicted MiB | measured MiB | measured / predicted |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["plans"]:
        lines.append(f"| {r['name']} | {r['world_size']} | {r['mesh']} | {r['schedule']} | {r['microbatches']} | "
                     f"{r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | {r['step_error']:+.0%} | "
                     f"{r['predicted_peak_bytes'] / MiB:.1f} | {r['measured_peak_bytes'] / MiB:.1f} | "
                     f"{r['memory_ratio']:.2f} |")
    s, e, m = result["spearman"], result["median_abs_step_error"], result["max_memory_ratio"]
    lines += ["", f"Spearman rank correlation of fp32 step times: {s:.2f} (goal ≥ {GOALS['spearman']})",
              f"median absolute fp32 step-time error: {e:.0%} (goal ≤ {GOALS['median_abs_step_error']:.0%})",
              f"worst measured / predicted peak memory: {m:.2f} (goal ≤ {GOALS['max_memory_ratio']:.2f})"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
