"""Train a tiny GPT on synthetic data with autopar, on any number of processes.

    torchrun --nproc-per-node 2 examples/train_gpt.py
    autopar run examples/train_gpt.py --nproc 2 -- --steps 30

autopar plans the model for the launched world size (here on the ``cpu``
cluster preset; pass ``--pin`` to fix parts of the plan, e.g. ``--pin tp=2``),
lowers the plan for this rank and trains it. The data is a fixed random
"language" every rank can generate alike: each global batch is drawn from one
seeded generator, and each rank keeps its data-parallel slice.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402

import autopar  # noqa: E402


def synthetic_batch(step: int, batch: int, cfg: gpt.GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences that follow a fixed rule (next = 3·prev + 1 mod vocab), so the loss falls."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    steps = torch.arange(cfg.seq_len + 1)
    seq = (start * (3 ** steps) + ((3 ** steps) - 1) // 2) % cfg.vocab_size
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (samples)")
    parser.add_argument("--pin", action="append", default=[], help="plan pins, e.g. tp=2")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    cfg = gpt.GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=64)
    torch.manual_seed(0)  # every rank builds the same initial model
    model, example = gpt.build(cfg, device="cpu")
    pm = autopar.compile(model, example_inputs=example, cluster="cpu", pins=["pp=1", *args.pin],
                         global_batch=args.batch_size, dtype="fp32",
                         optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(pm.plan.summary(), flush=True)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = synthetic_batch(step, args.batch_size, cfg)
        loss = pm.train_step(pm.local_batch(x), pm.local_batch(y))
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
