"""Cases for :mod:`distributed` on the data pipeline: the same 8 steps of ``gpt-tiny`` on a token file,
uninterrupted under dp = 2, and 4 steps under dp = 2, a checkpoint, 4 more under pp = 2 (and in one
process, :func:`resume`, called by the test itself at W = 1 with gradient accumulation).

Every run feeds its plan with :class:`autopar.data.DataLoader` and reports with
:class:`autopar.runtime.metrics.MetricsLogger` into a JSON-lines file, one report a step, so the
test compares the files: the tokens hash and the loss of every step. SGD with momentum (the
exactness bar: Adam turns rounding noise into full-size updates), no clipping but the norm measured.
The token file, the checkpoint and the metrics files live in ``$AUTOPAR_DATA_TEST_DIR``.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from equivalence_cases import Spec, plan_for

import autopar
from autopar.data import DataLoader, open_dataset
from autopar.runtime.metrics import MetricsLogger

DIR_ENV = "AUTOPAR_DATA_TEST_DIR"
STEPS, HALF, BATCH = 8, 4, 8
SGD = dict(lr=0.05, momentum=0.9)
PLANS: dict[str, tuple[str, ...]] = {
    "dp2": ("pp=1", "dp=2", "tp=1", "zero=0", "microbatches=1", "recompute=none"),
    "pp2": ("pp=2", "dp=1", "tp=1", "zero=0", "microbatches=2", "schedule=1f1b", "recompute=none"),
    "w1": ("pp=1", "dp=1", "tp=1", "zero=0", "microbatches=2", "recompute=none"),  # accumulates 2 × 4
}


def test_dir() -> Path:
    return Path(os.environ[DIR_ENV])


def gpt_tiny() -> tuple[torch.nn.Module, tuple]:
    """examples/gpt.py's ``gpt-tiny`` preset: vocabulary 128, 32 tokens, 2 blocks of width 64."""
    import gpt

    return gpt.build(gpt.CONFIGS["gpt-tiny"], device="cpu")


def write_tokens(path: Path, n: int = 4097) -> Path:
    """A uint16 token file of ids below the preset's vocabulary (128 samples of 32 + 1 tokens)."""
    rng = np.random.default_rng(0)
    rng.integers(0, 128, n, dtype=np.uint16).tofile(path)
    return path


def compiled(plan_name: str, world_size: int) -> Any:
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    if world_size == 1 and not torch.distributed.is_initialized():
        graph = autopar.capture(model, inputs)
        plan = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", pins=list(PLANS[plan_name]),
                             global_batch=BATCH)
    else:
        plan, graph = plan_for(Spec(gpt_tiny, PLANS[plan_name], BATCH), world_size)
        torch.manual_seed(0)
        model, inputs = gpt_tiny()
    return autopar.compile(model, world_size=world_size, example_inputs=inputs, plan=plan, graph=graph,
                           optimizer=lambda p: torch.optim.SGD(p, **SGD), max_grad_norm=float("inf"))


def train(pm: Any, name: str, until: int, resume_from: str | None = None) -> dict[str, Any]:
    """Train ``pm`` to step ``until`` on the token file, reporting into ``<name>.jsonl``; loading the
    checkpoint ``resume_from`` first (its data position too); saving ``<name>.ckpt`` at the end."""
    loader = DataLoader.for_model(open_dataset(test_dir() / "tokens.bin", 32, vocab_size=128), pm,
                                  seed=7, hashes=True)
    extra: dict[str, Any] = {}
    if resume_from is not None:
        extra = pm.load(test_dir() / resume_from)
        loader.load_state_dict(extra["data"])
    lines = io.StringIO()
    metrics = MetricsLogger(pm, metrics_file=test_dir() / f"{name}.jsonl", total_steps=until, progress=False,
                            stream=lines)
    shapes = []
    while pm.step < until:
        batch = next(loader)
        shapes.append(list(batch.inputs.shape))
        loss = pm.train_step(batch.inputs, batch.targets)
        metrics.log(batch.step, loss, step_s=1.0, tokens=batch.global_tokens, tokens_hash=batch.tokens_hash)
    metrics.close()
    loader.close()
    handle = pm.save(test_dir() / f"{name}.ckpt", extra={"data": loader.state_dict()})
    return {"shapes": shapes, "extra_step": extra.get("data", {}).get("step"), "saved": str(handle.path),
            "dp_rank": pm.dp_rank, "records": len(metrics.records),
            "last_line": lines.getvalue().splitlines()[-1] if lines.getvalue() else None}


def resume(plan_name: str, world_size: int, name: str) -> dict[str, Any]:
    """The second half under ``plan_name``: the first half's metrics file is continued (with a stale
    report of a step past the checkpoint, as a run that died after it leaves one, to be dropped)."""
    first = (test_dir() / "half.jsonl").read_text()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        stale = json.loads(first.splitlines()[-1]) | {"step": HALF + 1, "tokens_hash": "stale"}
        (test_dir() / f"{name}.jsonl").write_text(first + json.dumps(stale) + "\n")
    pm = compiled(plan_name, world_size)
    return train(pm, name, STEPS, resume_from="half.ckpt")


def run(fn: Callable[[int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        return fn(world_size)

    return case


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "uninterrupted_dp2": run(lambda w: train(compiled("dp2", w), "full", STEPS)),
    "half_dp2": run(lambda w: train(compiled("dp2", w), "half", HALF)),
    "resume_pp2": run(lambda w: resume("pp2", w, "pp2")),
}
