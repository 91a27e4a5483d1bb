"""Checkpoint cost: save and load time and bytes written per rank, asynchronous against blocking save.

    python benchmarks/checkpoint.py [--world-size 2] [--repeat 3] [--json FILE]

A GPT (8 layers, d 512, vocab 8192: ~34M parameters, AdamW, fp32) is
compiled under three plans on W gloo processes (DDP, ZeRO-3, tensor
parallel) and trained a step so the optimizer holds its state. Then, per
plan, the median of ``--repeat`` runs of:

- **blocking save**: ``pm.save(path)`` until it returns (written, checksummed,
  published);
- **async save**: ``pm.save(path, async_save=True)`` until it returns (the
  state copied in memory: what training waits for), and until the handle's
  ``result()`` (written and published in the background);
- **a step during an async save**: one ``train_step`` while the write goes on,
  beside one without;
- **load**: ``pm.load(path)`` (files checked, resharded into this plan);

and the bytes each rank wrote (its own ``.distcp`` files; rank 0 also DCP's
``.metadata`` and ``autopar.json``). Times are rank 0's, each started after a
barrier; the directory is on this machine's local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

GPT = dict(n_layer=8, d_model=512, n_head=8, vocab_size=8192, seq_len=64)
BATCH = 8
PINS = {
    "DP": ["pp=1", "dp=2", "tp=1", "zero=0", "recompute=none", "microbatches=1"],
    "ZeRO-3": ["pp=1", "dp=2", "tp=1", "zero=3", "recompute=none", "microbatches=1"],
    "TP": ["pp=1", "dp=1", "tp=2", "zero=0", "recompute=none", "microbatches=1", "blocks.*:tp=megatron",
           "tok_emb:tp=vocab", "pos_emb:tp=vocab", "lm_head:tp=vocab"],
}


def _timed(fn: Any) -> tuple[Any, float]:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


def _bytes_written(path: Path, rank: int) -> int:
    own = [f for f in path.iterdir() if f.name.startswith(f"__{rank}_")]
    if rank == 0:
        own += [path / ".metadata", path / "autopar.json"]
    return sum(f.stat().st_size for f in own)


def _plan_figures(pm: Any, root: Path, repeat: int, batch: tuple[Any, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, x, y = dist.get_rank(), *batch
    blocking, async_return, async_done, step_during, step_alone, load = [], [], [], [], [], []
    pm.save(root / "warm-up")  # the checkpoint group and DCP's first-call costs, untimed
    for k in range(repeat):
        path = root / f"ckpt-{k}"
        _, s = _timed(lambda: pm.save(path))
        blocking.append(s)
        _, s = _timed(lambda: pm.train_step(x, y))
        step_alone.append(s)
        handle, s = _timed(lambda: pm.save(root / f"async-{k}", async_save=True))
        async_return.append(s)
        t = time.perf_counter()
        pm.train_step(x, y)
        step_during.append(time.perf_counter() - t)
        handle.result()
        async_done.append(time.perf_counter() - t + s)
        _, s = _timed(lambda: pm.load(path))
        load.append(s)
        written = _bytes_written(path, rank)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / f"async-{k}", ignore_errors=True)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, written)
    med = statistics.median
    return {"blocking_save_s": med(blocking), "async_save_return_s": med(async_return),
            "async_save_done_s": med(async_done), "step_s": med(step_alone),
            "step_during_async_save_s": med(step_during), "load_s": med(load), "bytes_per_rank": per_rank}


def _worker(rank: int, world_size: int, store: str, repeat: int, root: str, out: str) -> None:
    import gpt
    import torch
    import torch.distributed as dist

    import autopar

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    model, inputs = gpt.gpt(**GPT, device="meta")
    graph = autopar.capture(model, inputs)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, GPT["vocab_size"], (BATCH, GPT["seq_len"]), generator=g)
    results = {}
    for name, pins in PINS.items():
        plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=BATCH, pins=pins,
                             memory_gb=64)
        pm = autopar.compile(gpt.gpt(**GPT, device="meta")[0], example_inputs=inputs, plan=plan, graph=graph)
        xl = pm.local_batch(x)
        pm.train_step(xl, xl)
        results[name] = _plan_figures(pm, Path(root) / name, repeat, (xl, xl))
        del pm
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    params = (GPT["vocab_size"] * GPT["d_model"] * 2 + GPT["seq_len"] * GPT["d_model"]
              + GPT["n_layer"] * 12 * GPT["d_model"] ** 2)
    with tempfile.TemporaryDirectory(prefix="autopar-ckpt-bench-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(args.world_size, os.path.join(tmp, "store"), args.repeat,
                                          os.path.join(tmp, "ckpt"), out),
                           nprocs=args.world_size, start_method="spawn")
        results = json.loads(Path(out).read_text())
    MiB = 2**20
    lines = [f"GPT ~{params / 1e6:.0f}M parameters, AdamW fp32 (model + 2 moments ≈ "
             f"{params * 12 / MiB:.0f} MiB of state), W={args.world_size} gloo on CPU, "
             f"median of {args.repeat}", "",
             "| plan | blocking save s | async save returns s | async save done s | step s | "
             "step during async save s | load s | MiB written per rank |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        per_rank = " / ".join(f"{b / MiB:.1f}" for b in r["bytes_per_rank"])
        lines.append(f"| {name} | {r['blocking_save_s']:.3f} | {r['async_save_return_s']:.3f} | "
                     f"{r['async_save_done_s']:.3f} | {r['step_s']:.3f} | {r['step_during_async_save_s']:.3f} | "
                     f"{r['load_s']:.3f} | {per_rank} |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"gpt": GPT, "world_size": args.world_size, "plans": results},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
