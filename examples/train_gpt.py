"""Train a GPT with autopar on any number of processes: a complete loop, on a text or token file or
on synthetic data.

    autopar run examples/train_gpt.py --nproc 2 -- --steps 20
    python examples/stdlib_corpus.py corpus.txt                 # Python's own sources: no download
    autopar run examples/train_gpt.py --nproc 2 -- --data corpus.txt --steps 300 \\
        --metrics-file metrics.jsonl --log-every 10 --checkpoint-dir ckpt
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
loses only the steps since the last checkpoint. Every ``--log-every`` steps
rank 0 reports (:class:`autopar.runtime.metrics.MetricsLogger`) the loss,
gradient norm, learning rate, tokens/s and TFLOP/s per rank, MFU and peak
memory, each beside the plan's prediction and the ratio (on CPU no MFU, the
preset's peak being a guess, and the memory is the host's resident set, which
also holds the interpreter and its libraries, shown without a ratio): a
progress bar on a terminal, plain lines otherwise; one JSON
object a report in ``--metrics-file``, TensorBoard events in ``--tensorboard``.

``--data PATH``: a ``.bin`` of token ids (``--data-dtype`` uint16 or uint32,
nanoGPT's format) or a text file, tokenized by its UTF-8 bytes (the model's
vocabulary is then at least 256). Samples are packed windows of the preset's
sequence length; their global order depends on ``--seed`` and the step only
(:mod:`autopar.data`), each data-parallel rank reads its share, and the
checkpoint holds the data position, so a job resumed under any plan or world
size trains on exactly the samples an uninterrupted one would have (a
checkpoint of other data is refused, naming both). Without ``--data`` the
data is a fixed random "language" every rank can generate alike: global
batch k is drawn from a generator seeded with k. Bad input (a missing file,
one shorter than a sequence, token ids beyond the vocabulary, TensorBoard
without its package) is one line on stderr and exit code 2, before any
process group starts. ``--simulate-failure STEP`` makes the last rank kill itself (SIGKILL)
at that step on the first attempt, once the saves already started have finished, to watch a
restart resume from a known checkpoint.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402

import autopar  # noqa: E402
from autopar.data import BYTE_VOCAB, DataLoader, PackedDataset, open_dataset, tokens_hash  # noqa: E402
from autopar.errors import AutoparError, DataError  # noqa: E402
from autopar.runtime.metrics import MetricsLogger, check_tensorboard  # noqa: E402


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
    p.add_argument("--pin", action="append", default=[], help="plan pins, e.g. tp=2 (repeatable; pp=1 "
                   "unless pp is pinned)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="precision: auto is bf16 on a GPU, fp32 on CPU")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--data", default=None, metavar="PATH", help="a .bin of token ids or a text file "
                   "(default: synthetic data)")
    p.add_argument("--data-dtype", choices=["uint16", "uint32"], default=None,
                   help="token width of a .bin file (default uint16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--log-every", type=int, default=1, help="steps between metrics reports")
    p.add_argument("--metrics-file", default=None, metavar="FILE", help="write each report as a JSON line")
    p.add_argument("--save-plan", default=None, metavar="FILE",
                   help="write the plan trained with (for autopar calibrate --from-metrics)")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard events here")
    p.add_argument("--checkpoint-dir", default=None, help="save and resume checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in the background")
    p.add_argument("--export", default=None, metavar="DIR", help="write the final weights as safetensors")
    p.add_argument("--simulate-failure", type=int, default=None, metavar="STEP",
                   help="the last rank kills itself (SIGKILL) at STEP on the first attempt")
    return p.parse_args()


def model_config(args: argparse.Namespace) -> tuple[gpt.GPTConfig, PackedDataset | None]:
    """The preset (its vocabulary at least the byte tokenizer's for a text file) and the data,
    opened and checked before anything starts (DataError on bad input)."""
    cfg = gpt.CONFIGS[args.preset]
    if args.data is None:
        if args.data_dtype is not None:
            raise DataError("--data-dtype applies to a --data token file: give --data")
        return cfg, None
    if Path(args.data).suffix != ".bin":
        cfg = gpt.GPTConfig(max(cfg.vocab_size, BYTE_VOCAB), cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model,
                            cfg.dropout)
    data = open_dataset(args.data, cfg.seq_len, dtype=args.data_dtype, vocab_size=cfg.vocab_size)
    data.require_batch(args.batch_size)
    return cfg, data


def resume_data(extra: dict, latest: Path, loader: DataLoader | None) -> None:
    """Put the loader at the checkpoint's data position; refuse a checkpoint of other data."""
    saved = extra.get("data")
    if loader is None:
        if saved is not None:
            raise DataError(f"checkpoint {latest} was trained on {saved['dataset']['path']}: "
                            "give it as --data, or start a new checkpoint directory")
        return
    if saved is None:
        raise DataError(f"checkpoint {latest} was trained on synthetic data, this run reads "
                        f"{loader.dataset.identity.path}: start a new checkpoint directory")
    loader.load_state_dict(saved)


def batches(loader: DataLoader | None, pm: autopar.ParallelModel, args: argparse.Namespace, cfg: gpt.GPTConfig,
            hashes: bool):
    """(step, this rank's inputs, targets, global tokens, tokens hash) from pm.step on."""
    while pm.step < args.steps:
        if loader is not None:
            b = next(loader)
            yield b.step, b.inputs, b.targets, b.global_tokens, b.tokens_hash
            continue
        x, y = synthetic_batch(pm.step, args.batch_size, cfg)
        digest = tokens_hash(torch.cat([x, y[:, -1:]], dim=1)) if hashes else None
        yield pm.step, pm.local_batch(x), pm.local_batch(y), x.numel(), digest


def train(args: argparse.Namespace) -> None:
    cfg, data = model_config(args)
    if args.tensorboard is not None:
        check_tensorboard()
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if torch.cuda.is_available() else "fp32")
    torch.manual_seed(0)  # every rank builds the same initial model (meta: each its own shards)
    model, example = gpt.build(cfg, device="cpu" if args.preset == "gpt-tiny" else "meta")
    schedule = warmup_cosine(args.warmup, args.steps, args.min_lr_ratio)
    pins = args.pin if any(p.strip().startswith("pp=") for p in args.pin) else ["pp=1", *args.pin]
    pm = autopar.compile(model, example_inputs=example, pins=pins, global_batch=args.batch_size, dtype=dtype,
                         max_grad_norm=args.max_grad_norm or None,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.01),
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    rank = dist.get_rank() if dist.is_initialized() else 0
    last_rank = (dist.get_world_size() if dist.is_initialized() else 1) - 1
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        if args.save_plan:
            pm.plan.save(args.save_plan)
    loader = DataLoader.for_model(data, pm, seed=args.seed, hashes=rank == 0) if data is not None else None
    latest = autopar.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if latest is not None:
        extra = pm.load(latest)
        resume_data(extra, latest, loader)
        if rank == 0:
            print(f"resumed from {latest} at step {pm.step} (data position {extra['data_position']})", flush=True)
    metrics = MetricsLogger(pm, log_every=args.log_every, metrics_file=args.metrics_file,
                            tensorboard=args.tensorboard, total_steps=args.steps)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    start = time.perf_counter()
    t = time.perf_counter()
    for step, x, y, tokens, digest in batches(loader, pm, args, cfg, hashes=rank == 0):
        if step == args.simulate_failure and first_attempt:
            # the saves already started finish first, so the restart's resume point is known; a save
            # still being written when a rank really dies is lost, and the one before it is loaded
            pm.wait_for_checkpoint()
            if rank == last_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        lr = pm.optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves it after the step
        # the step's own time is what the plan predicts (and `autopar tune` measures); making the
        # batch (reading, generating, hashing it) is reported apart, as the wait for data
        began = time.perf_counter()
        loss = pm.train_step(x, y)
        metrics.log(step, loss, step_s=time.perf_counter() - began, tokens=tokens, lr=lr, tokens_hash=digest,
                    data_wait_s=began - t)
        if args.checkpoint_dir and (pm.step % args.checkpoint_every == 0 or pm.step == args.steps):
            extra = {"data_position": pm.step, **({"data": loader.state_dict()} if loader is not None else {})}
            pm.save(Path(args.checkpoint_dir) / f"step-{pm.step:08d}", extra=extra, async_save=args.async_checkpoint)
        t = time.perf_counter()
    metrics.close()
    if loader is not None:
        loader.close()
    pm.wait_for_checkpoint()
    if args.export:
        pm.export(args.export)
    if rank == 0:
        print(f"trained to step {pm.step} in {time.perf_counter() - start:.1f} s", flush=True)
    pm.close()


def main() -> None:
    args = parse_args()
    try:
        train(args)
    except AutoparError as exc:  # bad input: one line, exit 2 (every rank raises the same)
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
