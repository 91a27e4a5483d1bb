"""torch.compile per block against eager, for every lowering, on CPU (issue 24's two CPU figures).

    python benchmarks/compile_speed.py [--steps 20] [--world-size 2] [--only DDP,ZeRO-3] [--json out.json]

On W gloo ranks (CPU, one thread a rank), the project's GPT (``examples/gpt.py``; the width of
``runtime_overhead.py``'s: d_model 256, 8 heads, vocab 2048, sequence 64, batch 8) is trained with
SGD under each lowering autopar compiles: DDP, ZeRO-1/2/3, a 1F1B pipeline (pp = 2, 4
microbatches), selective and full recompute (under DDP), tensor parallelism (tp = 2) and context
parallelism (cp = 2: K/V all-gather, Ulysses, ring). Expert parallelism is not here: the GPT has no
experts (its compiled parity is ``tests/compile_cases.py``'s ``ep2_mixtral``). Per lowering, two models under the
same pins, one planned eager and one planned compiled (``solve(..., compiled=True)``: each block
under ``torch.compile``, inductor's C++ backend), take turns step by step (the order flipped
every step, after 3 warm-ups) so machine noise hits both alike; the table prints the median step
time of each and compiled / eager (the issue expects ≤ 1.0 where the model is compute-bound).

The second table is the compile time of a 12-block GPT of the same width under each plan against
one block's: the first compiled step's time less the median of the next ``--compile-steps`` (the
rest of the first step is a step like the others), from an empty dynamo cache and with inductor's
on-disk caches off, so each measurement compiles from nothing. One block's compile time is
measured on the smallest stack, 2 blocks (a single block is no repeated stack: capture marks no
block, so nothing would be compiled), which compiles one graph both blocks share. Blocks of one
plan share one compiled graph (dynamo treats a module's parameters as graph inputs), so the
12-block model should compile in at most 2× one block's time; the dynamo graph count of each
(rank 0) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SEQ, BATCH, WIDTH, HEADS, VOCAB = 64, 8, 256, 8, 2048
ONE, MANY = 2, 12  # blocks: the smallest stack (one compiled graph), and the 12-block GPT
_OFF = ["tok_emb:recompute=none", "pos_emb:recompute=none", "drop:recompute=none", "ln_f:recompute=none",
        "lm_head:recompute=none"]
DP = ["pp=1", "tp=1", "microbatches=1"]
LOWERINGS: dict[str, list[str]] = {
    "DDP": DP + ["zero=0", "recompute=none"],
    "ZeRO-1": DP + ["zero=1", "recompute=none"],
    "ZeRO-2": DP + ["zero=2", "recompute=none"],
    "ZeRO-3": DP + ["zero=3", "recompute=none"],
    "PP 1F1B": ["pp=2", "tp=1", "zero=0", "microbatches=4", "schedule=1f1b", "recompute=none"],
    "selective": DP + ["zero=0", "blocks.*:recompute=selective"] + _OFF,
    "full": DP + ["zero=0", "blocks.*:recompute=full"] + _OFF,
    "TP": ["pp=1", "tp=2", "microbatches=1", "zero=0", "recompute=none"],
    "cp all-gather": DP + ["cp=2", "cp_attention=allgather", "zero=0", "recompute=none"],
    "cp Ulysses": DP + ["cp=2", "cp_attention=ulysses", "zero=0", "recompute=none"],
    "cp ring": DP + ["cp=2", "cp_attention=ring", "zero=0", "recompute=none"],
}
CACHE_OFF = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"  # each compile from nothing: no FX graph / kernel cache hits


def pins_for(lowering: str, world_size: int) -> list[str]:
    """The pins that make ``lowering`` on ``world_size`` ranks (the rest of the mesh is dp)."""
    pins = LOWERINGS[lowering]
    split = math.prod(int(p.split("=")[1]) for p in pins if p.split("=")[0] in ("pp", "tp", "cp"))
    return pins + [f"dp={world_size // split}"]


def build(n_layer: int = 4) -> tuple[Any, tuple]:
    import gpt
    import torch

    torch.manual_seed(0)
    return gpt.gpt(n_layer=n_layer, d_model=WIDTH, n_head=HEADS, vocab_size=VOCAB, seq_len=SEQ, device="cpu")


def compile_time(first_s: float, later_s: list[float]) -> float:
    """Seconds the first step spent compiling: its time less a step's (the median of the later ones)."""
    return max(0.0, first_s - statistics.median(later_s))


def ratio(a: float, b: float) -> str:
    """``a / b`` to two places, or "-" where ``b`` is no time (nothing compiled)."""
    return f"{a / b:.2f}" if b > 0 else "-"


def _plan(graph: Any, world_size: int, lowering: str, compiled: bool) -> Any:
    import autopar

    return autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=BATCH,
                         pins=pins_for(lowering, world_size), compiled=compiled)


def _model(lowering: str, world_size: int, compiled: bool, n_layer: int = 4) -> Any:
    import torch

    import autopar

    model, inputs = build(n_layer)
    graph = autopar.capture(model, inputs)
    plan = _plan(graph, world_size, lowering, compiled)
    return autopar.compile(build(n_layer)[0], example_inputs=inputs, plan=plan, graph=graph,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))


def _batch(pm: Any) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return pm.local_batch(x), pm.local_batch(y)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _side_by_side(lowering: str, world_size: int, steps: int) -> dict[str, float]:
    import torch._dynamo

    torch._dynamo.reset()
    runs = {}
    for compiled in (False, True):
        pm = _model(lowering, world_size, compiled)
        x, y = _batch(pm)
        runs["compiled" if compiled else "eager"] = (lambda pm=pm, x=x, y=y: pm.train_step(x, y))
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(steps + 3):  # the first step of the compiled model compiles: a warm-up
        for name in names if i % 2 else names[::-1]:
            t = _timed(runs[name])
            if i >= 3:
                times[name].append(t)
    eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3, "ratio": compiled / eager}


def _compile_time(lowering: str, world_size: int, n_layer: int, later: int) -> dict[str, float]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pm = _model(lowering, world_size, True, n_layer)
    x, y = _batch(pm)
    first = _timed(lambda: pm.train_step(x, y))
    rest = [_timed(lambda: pm.train_step(x, y)) for _ in range(later)]
    return {"compile_s": compile_time(first, rest), "step_ms": statistics.median(rest) * 1e3,
            "graphs": int(counters["stats"]["unique_graphs"]), "blocks": len(pm.compiled)}


def _tables(speed: dict[str, dict[str, float]], compile_rows: dict[str, dict[int, dict[str, float]]]) -> str:
    """The two tables, for the lowerings measured so far."""
    lines = [f"{'lowering':10s} {'eager':>9s} {'compiled':>9s}  compiled/eager"]
    for name, r in speed.items():
        lines.append(f"{name:10s} {r['eager_ms']:7.1f}ms {r['compiled_ms']:7.1f}ms  {r['ratio']:6.3f}")
    lines += ["", "compile time (first step less a later one), from empty caches (target: 12 blocks ≤ 2× one "
              f"block's, measured on {ONE} blocks sharing one graph):",
              f"{'lowering':10s} {f'{ONE} blocks':>9s} {f'{MANY} blocks':>10s}  ratio  graphs ({ONE} / {MANY} "
              "blocks, rank 0)"]
    for name, r in compile_rows.items():
        one, twelve = r[ONE], r[MANY]
        lines.append(f"{name:10s} {one['compile_s']:8.1f}s {twelve['compile_s']:9.1f}s  "
                     f"{ratio(twelve['compile_s'], one['compile_s']):>5s}  {one['graphs']} / {twelve['graphs']}")
    return "\n".join(lines) + "\n"


def _worker(rank: int, world_size: int, store: str, steps: int, out: str, lowerings: list[str],
            compile_steps: int, json_path: str | None) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    speed: dict[str, dict[str, float]] = {}
    compile_rows: dict[str, dict[int, dict[str, float]]] = {}
    for lowering in lowerings:  # the tables are rewritten after each lowering: a cut-short run keeps its rows
        speed[lowering] = _side_by_side(lowering, world_size, steps)
        compile_rows[lowering] = {n: _compile_time(lowering, world_size, n, compile_steps) for n in (ONE, MANY)}
        if rank == 0:
            text = _tables(speed, compile_rows)
            Path(out).write_text(text)
            sys.stderr.write(f"[compile_speed] {lowering} done\n{text}\n")
            sys.stderr.flush()
            if json_path:
                Path(json_path).write_text(json.dumps(
                    {"world_size": world_size, "steps": steps, "speed": speed,
                     "compile": {k: {str(n): v for n, v in r.items()} for k, r in compile_rows.items()}}, indent=2))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from runtime_overhead import spawn_and_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per lowering, side by side")
    parser.add_argument("--compile-steps", type=int, default=3, help="steps after the first, for its compile time")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", default=",".join(LOWERINGS), help="comma-separated lowerings "
                        f"(of {', '.join(LOWERINGS)})")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    lowerings = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in lowerings if s not in LOWERINGS]
    if unknown:
        parser.error(f"unknown lowering(s) {unknown}: choose from {', '.join(LOWERINGS)}")
    os.environ[CACHE_OFF] = "1"  # the spawned ranks inherit it
    model, _ = build()
    params = sum(p.numel() for p in model.parameters())
    spawn_and_report(_worker, args.world_size, args.steps,
                     f"GPT {params / 1e6:.1f}M params (4 blocks, d_model {WIDTH}), batch {BATCH}×{SEQ}, "
                     f"W={args.world_size} gloo on CPU, one thread a rank, median of {args.steps} steps, "
                     f"torch.compile per block (inductor, CPU)",
                     extra=(lowerings, args.compile_steps, os.path.abspath(args.json) if args.json else None))


if __name__ == "__main__":
    main()
