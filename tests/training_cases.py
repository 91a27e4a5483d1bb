"""Cases for :mod:`distributed` on training beyond one step: clipping, schedules, evaluation, bf16,
dropout streams, checkpoints saved under one plan and loaded under another, weights in and out.

Every case builds the 2-layer GPT of :mod:`equivalence_cases` (seed 0) and the
global batches ``BATCHES`` (seeds 100 + k), and every rank compares with the same
model trained in one process (:func:`reference`, trained by rank 0 and sent to the others). Checkpoints and weight files
live in the directory named by ``$AUTOPAR_TEST_DIR``, which the parent sets,
so a checkpoint saved by a W = 4 spawn is loaded by a later W = 2 one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from equivalence_cases import GPT_TP, Spec, from_rank0, gpt_tiny, hf_llama, make_batch, plan_for, rel

import autopar
from autopar.plan import Plan
from autopar.runtime import default_loss

DIR_ENV = "AUTOPAR_TEST_DIR"
K = 2  # optimizer steps before a checkpoint, and again after loading it
BATCH = 8
SGD = dict(lr=0.05, momentum=0.9)
MAX_NORM = 0.5
BF16_LOSS_TOL = 1e-2  # relative, per step over 3 AdamW steps: bf16 compute, fp32 masters and loss
PP1 = ("pp=1", "recompute=none")

PLANS: dict[str, tuple[str, ...]] = {
    "zero3_w4": PP1 + ("dp=4", "tp=1", "zero=3", "microbatches=1"),
    "zero1_w4": PP1 + ("dp=4", "tp=1", "zero=1", "microbatches=2"),
    "hsdp_zero3_w4": PP1 + ("dp=4", "dp_replicate=2", "tp=1", "zero=3", "microbatches=1"),  # tests/hsdp_cases.py
    "dp2tp2_w4": PP1 + ("dp=2", "tp=2", "zero=3", "microbatches=2") + GPT_TP,
    "zero3_w2": PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"),
    "zero1_w2": PP1 + ("dp=2", "tp=1", "zero=1", "microbatches=2"),
    "ddp_w2": PP1 + ("dp=2", "tp=1", "zero=0", "microbatches=2"),
    "tp_w2": PP1 + ("dp=1", "tp=2", "zero=0") + GPT_TP,
    # the cut between the blocks, so each rank runs one (the loss's time may move the solver's cut after both)
    "pp_w2": ("pp=2", "recompute=none", "dp=1", "tp=1", "zero=0", "microbatches=2", "schedule=1f1b",
              "blocks.1:stage=1"),
    "w1": PP1 + ("dp=1", "tp=1", "zero=0", "microbatches=1"),
}


def test_dir() -> Path:
    return Path(os.environ[DIR_ENV])


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **SGD)


def warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    return [make_batch(inputs, model, BATCH, seed=100 + k) for k in range(n)]


def plan_of(name: str, world_size: int, dtype: str = "fp32", build: Callable = gpt_tiny,
            pins: tuple[str, ...] | None = None) -> tuple[Plan, Any]:
    plan, graph = plan_for(Spec(build, pins or PLANS[name], BATCH), world_size)
    if dtype != "fp32":
        data = json.loads(plan.to_json())
        data["training"]["dtype"] = dtype
        plan = Plan.from_json(json.dumps(data))
    return plan, graph


def compiled(name: str, world_size: int, **kwargs: Any) -> Any:
    dtype = kwargs.pop("dtype", "fp32")
    build = kwargs.pop("build", gpt_tiny)
    plan, graph = plan_of(name, world_size, dtype, build)
    torch.manual_seed(kwargs.pop("model_seed", 0))
    model, inputs = build()
    kwargs.setdefault("optimizer", sgd)
    return autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, **kwargs)


def train(pm: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    return [pm.train_step(pm.local_batch(x), pm.local_batch(y)) for x, y in data]


@dataclass
class Reference:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    eval_loss: float | None = None


def reference(steps: int, *, clip: float | None = None, scheduler: bool = False,
              evaluate: bool = False) -> Reference:
    """The same training on one process: SGD with momentum, optionally clipped and scheduled."""
    torch.manual_seed(0)
    model, _ = gpt_tiny()
    opt = sgd(model.parameters())
    sched = warmup(opt) if scheduler else None
    losses, norms = [], []
    for x, y in batches(steps):
        opt.zero_grad()
        loss = default_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    out = Reference(losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()})
    if evaluate:
        model.eval()
        with torch.no_grad():
            x, y = batches(steps + 1)[-1]
            out.eval_loss = default_loss(model(x), y).item()
    return out


def worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    missing = sorted(set(ref) - set(got))
    if missing:
        raise AssertionError(f"missing {missing[:3]}")
    return max(rel(got[n], ref[n]) for n in ref)


def loss_rel(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


# ------------------------------------------------------------------ checkpoints under other plans


def save_case(name: str, *, async_save: bool = False) -> Callable[[int, int], dict[str, Any]]:
    """Train K steps under plan ``name`` and save a checkpoint ``<dir>/<name>`` (async: then
    train a step more before waiting, so the checkpoint must hold a copy of step K)."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        pm = compiled(name, world_size)
        losses = train(pm, batches(K))
        handle = pm.save(test_dir() / name, extra={"data_position": K, "plan": name}, async_save=async_save)
        if async_save:
            x, y = batches(K + 1)[-1]
            pm.train_step(pm.local_batch(x), pm.local_batch(y))  # moves the weights while writing
            handle.result()
        return {"losses": losses, "saved": str(handle.path)}

    return case


def load_case(saved: str, name: str) -> Callable[[int, int], dict[str, Any]]:
    """Load checkpoint ``saved`` under plan ``name``, train K more steps, compare with one process."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        pm = compiled(name, world_size)
        extra = pm.load(test_dir() / saved)
        step = pm.step
        losses = train(pm, batches(2 * K)[K:])
        params = pm.state_dict(full=True)
        ref = from_rank0(lambda: reference(2 * K))
        return {"losses": losses, "extra": extra, "step": step, "ref_losses": ref.losses,
                "loss_rel": loss_rel(losses, ref.losses[K:]), "param_rel": worst(params, ref.params)}

    return case


# ------------------------------------------------------------------ clipping, schedules, evaluation


def clip_case(name: str) -> Callable[[int, int], dict[str, Any]]:
    """3 steps clipped to MAX_NORM with a warm-up schedule, then an evaluation, against one device."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        pm = compiled(name, world_size, max_grad_norm=MAX_NORM, lr_scheduler=warmup)
        norms = []
        for x, y in batches(3):
            pm.train_step(pm.local_batch(x), pm.local_batch(y))
            norms.append(pm.grad_norm)
        before = pm.state_dict(full=True)
        x, y = batches(4)[-1]
        eval_loss = pm.evaluate(pm.local_batch(x), pm.local_batch(y))
        after = pm.state_dict(full=True)
        ref = from_rank0(lambda: reference(3, clip=MAX_NORM, scheduler=True, evaluate=True))
        return {"norms": norms, "dp": [pm.dp_rank, pm.dp_size], "step": pm.step,
                "lr": pm.optimizer.param_groups[0]["lr"], "ref_norms": ref.grad_norms,
                "norm_rel": loss_rel(norms, ref.grad_norms), "param_rel": worst(before, ref.params),
                "eval_rel": abs(eval_loss - ref.eval_loss) / ref.eval_loss, "eval_moved": worst(after, before)}

    return case


# ------------------------------------------------------------------ mixed precision


def bf16_case(name: str) -> Callable[[int, int], dict[str, Any]]:
    """A bf16 plan: what the optimizer steps and holds is fp32, compute is bf16, losses follow fp32."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        adam = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
        pm = compiled(name, world_size, dtype="bf16", optimizer=adam)
        seen: list[str] = []
        # every block's (a pipeline rank runs only its own stage's blocks)
        hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(str(out.dtype)))
                 for n, m in pm.module.named_modules() if n.endswith("mlp.c_fc")]
        losses = train(pm, batches(3))
        for hook in hooks:
            hook.remove()
        fp32 = compiled(name, world_size, optimizer=adam)
        ref = train(fp32, batches(3))
        optimized = {str(p.dtype) for g in pm.optimizer.param_groups for p in g["params"]}
        state = {str(v.dtype) for s in pm.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim()}
        return {"losses": losses, "fp32_losses": ref, "loss_rel": loss_rel(losses, ref),
                "optimized": sorted(optimized), "state": sorted(state), "compute": sorted(set(seen)),
                "masters": pm.masters is not None,
                "module": sorted({str(p.dtype) for p in pm.lowered.parameters()})}

    return case


# ------------------------------------------------------------------ dropout under tensor parallelism


def dropout_tp(rank: int, world_size: int) -> dict[str, Any]:
    """With dropout, the ranks of a tp group compute the same (replicated) loss: they drew the
    same masks on the activations they replicate, from the step's shared stream."""
    import gpt

    from autopar.runtime.training import step_rng

    def build() -> tuple[nn.Module, tuple]:
        cfg = gpt.GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32, dropout=0.2)
        return gpt.build(cfg, device="cpu")

    plan, graph = plan_of("tp_w2", world_size, build=build)
    torch.manual_seed(rank)  # the ranks' own generators differ: the step's stream must not
    model, inputs = build()
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, optimizer=sgd)
    x, y = batches(1)[0]
    with torch.no_grad(), step_rng(pm.seed, 0, pm._stream(), torch.device("cpu")):
        local = default_loss(pm.module(x), y)
    gathered = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(gathered, local.detach())
    with torch.no_grad(), step_rng(pm.seed, 1, pm._stream(), torch.device("cpu")):
        other = default_loss(pm.module(x), y)
    return {"tp_losses": [float(g) for g in gathered], "next_step_differs": float(other) != float(local)}


# ------------------------------------------------------------------ weights in and out


def _hf_reference() -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(test_dir() / "hf_in"))
    return {k: v for k, v in model.state_dict().items()}


def weights_in(name: str, build: str) -> Callable[[int, int], dict[str, Any]]:
    """Compile a differently initialised model with ``weights=``: it holds the file's weights."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        if build == "hf":
            pm = _compiled_hf(name, world_size)
            ref = _hf_reference()
        else:
            pm = compiled(name, world_size, model_seed=7, weights=test_dir() / "gpt_in.safetensors")
            from safetensors.torch import load_file

            ref = load_file(str(test_dir() / "gpt_in.safetensors"))
        return {"local_bytes": pm.local_param_bytes(), "rel": worst(pm.state_dict(full=True), ref)}

    return case


def _compiled_hf(name: str, world_size: int) -> Any:
    pins = {"tp_w2": PP1 + ("dp=1", "tp=2", "zero=0", "model.layers.*:tp=megatron",
                            "model.embed_tokens:tp=vocab"),
            "zero3_w2": PLANS["zero3_w2"]}[name]
    plan, graph = plan_for(Spec(hf_llama, pins, 4), world_size)
    torch.manual_seed(7)
    model, inputs = hf_llama()
    return autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, optimizer=sgd,
                           weights=test_dir() / "hf_in")


def export_hf(rank: int, world_size: int) -> dict[str, Any]:
    """Export an HF Llama trained a step under tensor parallelism; ``from_pretrained`` reads it back."""
    pm = _compiled_hf("tp_w2", world_size)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    pm.train_step(pm.local_batch(x), pm.local_batch(x))
    full = pm.state_dict(full=True)
    pm.export(test_dir() / "hf_out")
    dist.barrier()  # every rank reads the export back, whichever wrote it
    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM.from_pretrained(str(test_dir() / "hf_out"))
    return {"rel": worst(back.state_dict(), {k: v for k, v in full.items() if k in back.state_dict()}),
            "files": sorted(p.name for p in (test_dir() / "hf_out").iterdir())}


def export_gpt_tp(rank: int, world_size: int) -> dict[str, Any]:
    """A GPT's fused q/k/v rows, permuted by tensor parallelism, are exported in the original order."""
    pm = compiled("tp_w2", world_size)
    train(pm, batches(1))
    full = pm.state_dict(full=True)
    pm.export(test_dir() / "gpt_tp.safetensors")
    dist.barrier()  # every rank reads the export back, whichever wrote it
    from safetensors.torch import load_file

    ref = from_rank0(lambda: reference(1))
    return {"rel": worst(load_file(str(test_dir() / "gpt_tp.safetensors")), full),
            "ref_rel": worst(full, ref.params)}


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    # W = 4, saving
    "save_zero3_w4": save_case("zero3_w4"),
    "save_zero1_w4": save_case("zero1_w4"),
    "save_dp2tp2_w4": save_case("dp2tp2_w4"),
    # W = 2, loading what W = 4 saved, and pairs of its own
    "zero3_w4_to_tp": load_case("zero3_w4", "tp_w2"),
    "zero1_w4_to_pp": load_case("zero1_w4", "pp_w2"),
    "save_tp_w2": save_case("tp_w2"),
    "tp_to_pp": load_case("tp_w2", "pp_w2"),
    "tp_to_zero3": load_case("tp_w2", "zero3_w2"),
    "save_pp_w2": save_case("pp_w2", async_save=True),
    "pp_to_zero1": load_case("pp_w2", "zero1_w2"),
    "pp_to_tp": load_case("pp_w2", "tp_w2"),
    # W = 2: the training loop
    "clip_zero3": clip_case("zero3_w2"),
    "clip_tp": clip_case("tp_w2"),
    "clip_pp": clip_case("pp_w2"),
    "bf16_zero3": bf16_case("zero3_w2"),
    "bf16_ddp": bf16_case("ddp_w2"),
    "bf16_tp": bf16_case("tp_w2"),
    "bf16_pp": bf16_case("pp_w2"),
    "dropout_tp": dropout_tp,
    # W = 2: weights
    "weights_hf_tp": weights_in("tp_w2", "hf"),
    "weights_hf_zero3": weights_in("zero3_w2", "hf"),
    "weights_gpt_tp": weights_in("tp_w2", "gpt"),
    "export_hf": export_hf,
    "export_gpt_tp": export_gpt_tp,
}
