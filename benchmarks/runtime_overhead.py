"""Runtime overhead: autopar-compiled training step vs hand-written torch.distributed.

    python benchmarks/runtime_overhead.py [--steps 60] [--world-size 2]

For DP, ZeRO-3 and TP at W=2 on CPU/gloo, the same GPT (a few million
parameters), batch and SGD optimizer are trained by ``autopar.compile`` under a
fully pinned plan and by the hand-written equivalent: DDP; ``fully_shard`` per
block then the root (torchtitan's wrapping), the root resharded after forward
as the plan's ``zero=3`` asks ("ZeRO-3"), or blocks at ZeRO-3 and the root at
ZeRO-2, FSDP2's default for a root ("ZeRO-3/2"); ``parallelize_module`` with the
Megatron column/row styles (fused q/k/v rows permuted by hand). Both steps
return the global mean loss (an all-reduce and a host sync), as
``train_step`` does. Steps alternate between the two so machine noise hits
both alike; the median step time of each and their ratio are printed
(target: autopar / hand-written ≤ 1.05).

A second table measures what the training loop's additions cost an fp32
plan that uses none of them: ``train_step`` (each step's RNG stream, the
bf16-master and clipping checks, the scheduler hook, the step count, the
wait for gloo to release the loss) against the step as it was before them
(:func:`step_as_before`: zero the gradients, the microbatches, the optimizer
step, the loss's all-reduce), alternating on the same compiled model
(target ≤ 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

SEQ, BATCH = 64, 8
PINS = {
    "DP": ["pp=1", "dp=2", "tp=1", "zero=0", "recompute=none", "microbatches=1"],
    "ZeRO-3": ["pp=1", "dp=2", "tp=1", "zero=3", "recompute=none", "microbatches=1"],
    "ZeRO-3/2": ["pp=1", "dp=2", "tp=1", "blocks.*:zero=3", "recompute=none", "microbatches=1",
                 *(f"{root}:zero=2" for root in ("tok_emb", "pos_emb", "ln_f", "lm_head"))],
    "TP": ["pp=1", "dp=1", "zero=0", "recompute=none", "microbatches=1", "blocks.*:tp=megatron",
           "tok_emb:tp=none", "pos_emb:tp=none", "drop:tp=none", "ln_f:tp=none", "lm_head:tp=none"],
}


def build() -> tuple[nn.Module, tuple]:
    import gpt

    torch.manual_seed(0)
    return gpt.gpt(n_layer=4, d_model=256, n_head=8, vocab_size=2048, seq_len=SEQ, device="cpu")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def hand_written(strategy: str, model: nn.Module) -> nn.Module:
    """The strategy written directly against torch.distributed."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if strategy == "DP":
        return nn.parallel.DistributedDataParallel(model)
    if strategy.startswith("ZeRO-3"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        # "ZeRO-3": every unit resharded after forward, the root too, as the plan's zero=3 asks;
        # "ZeRO-3/2": FSDP2's default root (kept gathered from forward to backward: ZeRO-2)
        fully_shard(model, mesh=mesh, reshard_after_forward=True if strategy == "ZeRO-3" else None)
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    for block in model.blocks:
        attn = block.attn
        hd, h = attn.d_model // attn.n_head, attn.n_head
        rows = torch.arange(3 * attn.d_model).view(3, tp, h // tp * hd)  # (q|k|v, rank, rows)
        perm = rows.transpose(0, 1).reshape(-1)  # rank-major: each rank's q, k, v heads together
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[perm])
            attn.c_attn.bias.copy_(attn.c_attn.bias[perm])
        attn.n_head, attn.d_model = h // tp, attn.d_model // tp
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    return model


def _manual_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = _loss(model(x), y)
    loss.backward()
    opt.step()
    total = loss.detach().double()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def step_as_before(pm, x: torch.Tensor, y: torch.Tensor) -> float:
    """``train_step`` as it was before clipping, schedules, RNG streams and checkpoints."""
    pm._check_batch((x,), y)
    pm.optimizer.zero_grad(set_to_none=True)
    loss = pm._accumulate(pm.lowered, (x,), y)
    pm.optimizer.step()
    dist.all_reduce(loss)
    loss = loss / (pm.plan.mesh.dp * pm.plan.mesh.tp)
    return float(loss)


def _alternate(steps: int, runs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Median seconds of each run, taking turns (the order flipped every step), after 3 warm-ups."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(steps + 3):
        for name in names if i % 2 else names[::-1]:
            dist.barrier()
            t = time.perf_counter()
            runs[name]()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _worker(rank: int, world_size: int, store: str, steps: int, out: str) -> None:
    import autopar

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank,
                            world_size=world_size)
    model, inputs = build()
    graph = autopar.capture(model, inputs)
    lines, added = [], []
    for strategy, pins in PINS.items():
        pins = pins + ([f"tp={world_size}"] if strategy == "TP" else [])
        plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=BATCH, pins=pins)
        def sgd(p):
            return torch.optim.SGD(p, lr=0.01, momentum=0.9)

        pm = autopar.compile(build()[0], plan=plan, graph=graph, optimizer=sgd)
        manual = hand_written(strategy, build()[0])
        opt = sgd(manual.parameters())
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
        y = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
        xl, yl = pm.local_batch(x), pm.local_batch(y)
        t = _alternate(steps, {"autopar": lambda: pm.train_step(xl, yl),
                               "manual": lambda: _manual_step(manual, opt, xl, yl)})
        a, m = t["autopar"], t["manual"]
        lines.append(f"{strategy:8s} autopar {a * 1e3:8.1f} ms   hand-written {m * 1e3:8.1f} ms   "
                     f"ratio {a / m:5.3f}")
        t = _alternate(steps, {"new": lambda: pm.train_step(xl, yl), "before": lambda: step_as_before(pm, xl, yl)})
        added.append(f"{strategy:8s} train_step {t['new'] * 1e3:8.1f} ms   as before {t['before'] * 1e3:8.1f} ms   "
                     f"ratio {t['new'] / t['before']:5.3f}")
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n\nthe training loop's additions, fp32 (target ≤ 1.02):\n"
                             + "\n".join(added) + "\n")
    dist.destroy_process_group()


def spawn_and_report(worker: Callable[..., None], world_size: int, steps: int,
                     header: str, extra: tuple = ()) -> None:
    """Run ``worker(rank, world_size, store, steps, out, *extra)`` on ``world_size`` spawned ranks (gloo,
    CPU), then print ``header`` and what rank 0 wrote to ``out``: the launcher every overhead benchmark
    shares (``extra``: a benchmark's own arguments, picklable)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.txt")
        mp.start_processes(worker, args=(world_size, os.path.join(tmp, "store"), steps, out, *extra),
                           nprocs=world_size, start_method="spawn")
        sys.stdout.write(header + "\n")
        sys.stdout.write(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    model, _ = build()
    params = sum(p.numel() for p in model.parameters())
    spawn_and_report(_worker, args.world_size, args.steps,
                     f"GPT {params / 1e6:.1f}M params, batch {BATCH}×{SEQ}, W={args.world_size} "
                     f"gloo on CPU, median of {args.steps} steps")


if __name__ == "__main__":
    main()
