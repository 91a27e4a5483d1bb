"""Data stall: the time a training step waits for its batch, as a share of the step (goal ≤ 2%).

    python benchmarks/data_stall.py [--steps 3] [--batch-size 1] [--tokens-mb 64]

The project's GPT at its small preset (``examples/gpt.py`` ``gpt2-small``: 124M
parameters, 1,024 tokens a sample) is compiled for one process on this CPU
(the plan's memory budget raised to 16 GiB: the ``cpu`` preset's 1.5 GiB holds no
plan of it) and trained on a uint16 token file of ``--tokens-mb`` MB read through
:class:`autopar.data.DataLoader` (memory map, shuffled windows, read ahead by
a thread, the global batch's tokens hash on, as rank 0 computes it). Each
step's time runs from asking for the batch to ``train_step``'s return; the
wait is the time ``next(loader)`` blocked. The first step (warm-up) is left
out. Two more rows train ``gpt-tiny`` (steps of milliseconds, where reading
weighs most), with read-ahead and without (``prefetch=0``: every read on
the step's path).
Prints one row per run: median step, median and total wait, wait / step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

GOAL = 0.02


def token_file(path: Path, megabytes: float, vocab: int) -> Path:
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, int(megabytes * 1e6) // 2, dtype=np.uint16).tofile(path)
    return path


def run(preset: str, data_path: Path, steps: int, batch: int, prefetch: int) -> dict[str, float]:
    import gpt

    import autopar
    from autopar.data import DataLoader, open_dataset

    cfg = gpt.CONFIGS[preset]
    torch.manual_seed(0)
    model, inputs = gpt.build(cfg, device="cpu")
    pm = autopar.compile(model, world_size=1, example_inputs=inputs, cluster="cpu", global_batch=batch,
                         dtype="fp32", pins=["pp=1"], memory_gb=16.0, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    data = open_dataset(data_path, cfg.seq_len, vocab_size=cfg.vocab_size)
    loader = DataLoader.for_model(data, pm, seed=0, prefetch=prefetch, hashes=True)
    step_s, wait_s = [], []
    for _ in range(steps + 1):
        waited = loader.wait_s
        t = time.perf_counter()
        b = next(loader)
        pm.train_step(b.inputs, b.targets)
        step_s.append(time.perf_counter() - t)
        wait_s.append(loader.wait_s - waited)
    loader.close()
    step_s, wait_s = step_s[1:], wait_s[1:]  # the first step warms up
    return {"step_s": statistics.median(step_s), "wait_s": statistics.median(wait_s),
            "share": sum(wait_s) / sum(step_s), "tokens": batch * cfg.seq_len}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps of gpt2-small (after one warm-up)")
    p.add_argument("--tiny-steps", type=int, default=50, help="timed steps of gpt-tiny")
    p.add_argument("--batch-size", type=int, default=1, help="global batch of gpt2-small (samples)")
    p.add_argument("--tokens-mb", type=float, default=64.0, help="size of the token file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="autopar-stall-") as tmp:
        path = token_file(Path(tmp) / "tokens.bin", args.tokens_mb, 50304)
        tiny = token_file(Path(tmp) / "tiny.bin", args.tokens_mb, 128)  # gpt-tiny's vocabulary is 128
        runs = [("gpt2-small", path, args.steps, args.batch_size, 2),
                ("gpt-tiny", tiny, args.tiny_steps, 8, 2), ("gpt-tiny", tiny, args.tiny_steps, 8, 0)]
        rows = []
        for preset, data, steps, batch, prefetch in runs:
            r = run(preset, data, steps, batch, prefetch)
            rows.append((preset, prefetch, r))
            print(f"{preset:10s}  read-ahead {prefetch}  {r['tokens']:6,d} tokens/step  "
                  f"step {r['step_s'] * 1e3:9.2f} ms  wait median {r['wait_s'] * 1e3:7.3f} ms  "
                  f"wait/step {r['share']:6.2%}", flush=True)
    small = next(r for preset, prefetch, r in rows if preset == "gpt2-small" and prefetch == 2)
    verdict = "met" if small["share"] <= GOAL else "MISSED"
    print(f"gpt2-small with read-ahead: waiting for data {small['share']:.2%} of step time "
          f"(goal ≤ {GOAL:.0%}: {verdict})")


if __name__ == "__main__":
    main()
