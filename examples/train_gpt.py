"""Train a GPT with autopar on any number of processes: a complete loop on synthetic data.

    autopar run examples/train_gpt.py --nproc 2 -- --steps 20
    autopar run examples/train_gpt.py --nproc 2 --max-restarts 2 -- --steps 200 \\
        --checkpoint-dir ckpt --checkpoint-every 50                 # resumes after a rank dies
    torchrun --nproc-per-node 8 examples/train_gpt.py --preset gpt2-small --steps 1000

autopar plans the model for the launched world size (``--pin`` fixes parts of
the plan, e.g. ``--pin tp=2``), lowers it for this rank and trains it: bf16
mixed precision where there is a GPU (fp32 on CPU), gradient clipping, a linear
warm-up then cosine decay of the learning rate, a distributed checkpoint every
``--checkpoint-every`` steps, and on start the newest complete checkpoint in
``--checkpoint-dir`` is loaded — whatever plan or world size wrote it — so a
job restarted by ``autopar run --max-restarts`` (torchrun's elastic agent)
loses only the steps since the last checkpoint. Rank 0 logs one line a step:
the loss, tokens/s, the model FLOP utilisation against the plan's predicted
figure, and peak memory against the plan's (on CPU, the process's resident
memory, which also holds the interpreter and its libraries).

The data is a fixed random "language" every rank can generate alike: global
batch k is drawn from a generator seeded with k, and each rank keeps its
data-parallel slice, so the data position is the step count the checkpoint
holds. ``--simulate-failure STEP`` makes the last rank kill itself (SIGKILL)
at that step on the first attempt, once the saves already started have finished, to watch a
restart resume from a known checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402

import autopar  # noqa: E402

MiB = 2**20


def synthetic_batch(step: int, batch: int, cfg: gpt.GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences that follow a fixed rule (next = 3·prev + 1 mod vocab), so the loss falls."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    steps = torch.arange(cfg.seq_len + 1)
    seq = (start * (3 ** steps) + ((3 ** steps) - 1) // 2) % cfg.vocab_size
    return seq[:, :-1], seq[:, 1:]


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """The learning-rate multiplier at step k: linear warm-up over ``warmup`` steps, then a
    cosine decay to ``min_ratio`` at ``total``."""
    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows this file's docstring as written, and every option's default."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--preset", default="gpt-tiny", choices=sorted(gpt.CONFIGS), help="model size")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to train in all")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (samples)")
    p.add_argument("--pin", action="append", default=[], help="plan pins, e.g. tp=2 (repeatable)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="precision: auto is bf16 on a GPU, fp32 on CPU")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--checkpoint-dir", default=None, help="save and resume checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in the background")
    p.add_argument("--export", default=None, metavar="DIR", help="write the final weights as safetensors")
    p.add_argument("--simulate-failure", type=int, default=None, metavar="STEP",
                   help="the last rank kills itself (SIGKILL) at STEP on the first attempt")
    return p.parse_args()


def log_line(step: int, loss: float, lr: float, step_s: float, pm: autopar.ParallelModel,
             tokens: int, flops_per_step: float, peak_flops: float) -> str:
    """One step: loss, learning rate, gradient norm, tokens/s, MFU and peak memory against the plan."""
    plan = pm.plan
    mfu = flops_per_step / plan.world_size / step_s / peak_flops
    mfu_plan = plan.predicted.tflops_per_gpu * 1e12 / peak_flops
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        peak, what = torch.cuda.max_memory_allocated(), "peak"
    else:
        peak, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"
    planned = max(plan.predicted.memory_per_rank_bytes)
    norm = f"{pm.grad_norm:.3f}" if pm.grad_norm is not None else "-"
    return (f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  grad norm {norm}  "
            f"{tokens / step_s:,.0f} tok/s  MFU {mfu:.1%} (plan {mfu_plan:.1%})  "
            f"{what} {peak / MiB:,.0f} MiB (plan {planned / MiB:,.0f} MiB)")


def main() -> None:
    args = parse_args()
    cfg = gpt.CONFIGS[args.preset]
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if torch.cuda.is_available() else "fp32")
    torch.manual_seed(0)  # every rank builds the same initial model (meta: each its own shards)
    model, example = gpt.build(cfg, device="cpu" if args.preset == "gpt-tiny" else "meta")
    schedule = warmup_cosine(args.warmup, args.steps, args.min_lr_ratio)
    pm = autopar.compile(model, example_inputs=example, pins=["pp=1", *args.pin],
                         global_batch=args.batch_size, dtype=dtype, max_grad_norm=args.max_grad_norm,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.01),
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    rank = dist.get_rank() if dist.is_initialized() else 0
    last_rank = (dist.get_world_size() if dist.is_initialized() else 1) - 1
    if rank == 0:
        print(pm.plan.summary(), flush=True)
    latest = autopar.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if latest is not None:
        extra = pm.load(latest)
        if rank == 0:
            print(f"resumed from {latest} at step {pm.step} (data position {extra['data_position']})", flush=True)
    plan = pm.plan
    flops_per_step = plan.predicted.tflops_per_gpu * 1e12 * plan.predicted.step_time_s * plan.world_size
    peak_flops = plan.cluster.device.peak_flops(plan.training.dtype)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    start = time.perf_counter()
    while pm.step < args.steps:
        step = pm.step
        if step == args.simulate_failure and first_attempt:
            # the saves already started finish first, so the restart's resume point is known; a save
            # still being written when a rank really dies is lost, and the one before it is loaded
            pm.wait_for_checkpoint()
            if rank == last_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = synthetic_batch(step, args.batch_size, cfg)
        lr = pm.optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves it after the step
        t = time.perf_counter()
        loss = pm.train_step(pm.local_batch(x), pm.local_batch(y))
        step_s = time.perf_counter() - t
        if rank == 0:
            print(log_line(step, loss, lr, step_s, pm, x.numel(), flops_per_step, peak_flops), flush=True)
        if args.checkpoint_dir and (pm.step % args.checkpoint_every == 0 or pm.step == args.steps):
            pm.save(Path(args.checkpoint_dir) / f"step-{pm.step:08d}", extra={"data_position": pm.step},
                    async_save=args.async_checkpoint)
    pm.wait_for_checkpoint()
    if args.export:
        pm.export(args.export)
    if rank == 0:
        print(f"trained to step {pm.step} in {time.perf_counter() - start:.1f} s", flush=True)
    pm.close()


if __name__ == "__main__":
    main()
