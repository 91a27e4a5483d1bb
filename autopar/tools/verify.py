"""``autopar verify``: run a plan on W local gloo processes against one process.

The model comes from a SPEC built with ``device="cpu"`` under a fixed seed, in
fp32, trained with SGD with momentum on synthetic global batches (the same in
every process). Rank 0 also trains the unsharded model in-process on the whole
global batch and compares: first-step loss and gradients, every step's loss,
and parameters after K steps, each as ‖Δ‖/‖ref‖ (max over tensors).

Synthetic batches follow the example inputs: integer inputs become random
token ids below the first ``nn.Embedding``'s size, with random next-token ids
as targets; float inputs and targets are standard normal, shaped like the
inputs (so the default loss is mean squared error).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autopar.errors import AutoparError

SEED, LR, MOMENTUM = 0, 0.05, 0.9
TOLERANCE = 1e-5


@dataclass(frozen=True)
class VerifyReport:
    """Largest relative differences of a W-rank run from one process, and the losses."""

    world_size: int
    steps: int
    losses: list[float]
    ref_losses: list[float]
    loss_rel: float  # max over steps
    grad_rel: float  # first step, max over tensors
    grad_worst: str
    param_rel: float  # after the last step, max over tensors
    param_worst: str

    @property
    def max_rel(self) -> float:
        return max(self.loss_rel, self.grad_rel, self.param_rel)

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return self.max_rel <= tolerance


def synthetic_batch(model: nn.Module, example_inputs: tuple, batch: int,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch shaped like the example inputs (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ex = example_inputs[0]
    shape = (batch, *ex.shape[1:])
    if ex.is_floating_point():
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise AutoparError("verify makes token ids for integer inputs and needs an nn.Embedding "
                           "to know the vocabulary size")
    vocab = emb.num_embeddings
    return torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = b.norm().item()
    return (a - b).norm().item() / (d if d > 0 else 1.0)


def _worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    missing = sorted(set(ref) - set(got))
    if missing:
        raise AutoparError(f"the parallel run has no values for {missing[:3]}")
    return max(((_rel(got[k], ref[k]), k) for k in ref), default=(0.0, ""))


def _build(spec: str, seq_len: int | None) -> tuple[nn.Module, tuple]:
    from autopar.tools.spec import load_spec

    torch.manual_seed(SEED)
    return load_spec(spec, seq_len=seq_len, device="cpu")


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _reference(spec: str, seq_len: int | None, batches: list, steps: int) -> dict[str, Any]:
    from autopar.runtime import default_loss

    model, _ = _build(spec, seq_len)
    opt, losses, grads = _sgd(model.parameters()), [], {}
    for k, (x, y) in enumerate(batches[:steps]):
        opt.zero_grad()
        loss = default_loss(model(x), y)
        loss.backward()
        if k == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _worker(rank: int, world_size: int, store_path: str, spec: str, seq_len: int | None,
            plan_json: str, graph: dict, steps: int, out: str) -> None:
    import torch.distributed as dist

    import autopar
    from autopar.graph import LayerGraph
    from autopar.plan import Plan
    from autopar.tools.host import threads_per_process

    torch.set_num_threads(threads_per_process(world_size))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=300))
    plan = Plan.from_json(plan_json)
    model, inputs = _build(spec, seq_len)
    batches = [synthetic_batch(model, inputs, plan.training.global_batch, SEED + 1 + k)
               for k in range(steps)]
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=LayerGraph.from_dict(graph),
                         optimizer=_sgd)
    losses, grads = [], {}
    for k, (x, y) in enumerate(batches):
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
        if k == 0:
            grads = pm.full_grads()
    params = pm.state_dict(full=True)
    dist.destroy_process_group()
    if rank == 0:
        ref = _reference(spec, seq_len, batches, steps)
        grad_rel, grad_worst = _worst(grads, ref["grads"])
        param_rel, param_worst = _worst(params, ref["params"])
        report = VerifyReport(world_size, steps, losses, ref["losses"],
                              max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
                              grad_rel, grad_worst, param_rel, param_worst)
        Path(out).write_text(json.dumps(asdict(report)))


def verify(spec: str, plan_json: str, graph: dict, *, steps: int = 3, seq_len: int | None = None,
           timeout_s: float = 900.0) -> VerifyReport:
    """Spawn ``plan.world_size`` gloo processes running the plan; return rank 0's comparison."""
    import torch.multiprocessing as mp

    from autopar.plan import Plan

    world_size = Plan.from_json(plan_json).world_size
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        out = os.path.join(tmp, "report.json")
        ctx = mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), spec, seq_len,
                                                plan_json, graph, steps, out),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AutoparError(f"verify did not finish in {timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:
            lines = [l for l in str(exc).strip().splitlines() if l.strip()]
            raise AutoparError(f"a rank failed: {lines[-1] if lines else exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return VerifyReport(**json.loads(Path(out).read_text()))
