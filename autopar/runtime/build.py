"""``autopar.compile``: plan (or take a plan for) a model, admit it here, and lower it for this rank.

:func:`compile` captures the model (or takes a plan), asks admission once
(:func:`autopar.admission.admit`) and, inside a process group, lowers the plan
(:mod:`autopar.runtime.lowering`: every model part through the one lowering path, tensor parallel →
recompute → ZeRO/DP) in the plan's precision (:mod:`autopar.runtime.precision`), then builds the optimizer
over the tensors that hold the fp32 weights and returns the trainable
:class:`~autopar.runtime.model.ParallelModel`. Outside one, with one rank it lowers the plan in this
process and trains there; with more, it returns the plan-only model whose ``train_step`` says how to
launch. Without a ``cluster``, the plan is priced on the machine compile runs on
(:func:`autopar.runtime.launch.local_cluster`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.admission import admit
from autopar.errors import LaunchError
from autopar.float8 import settings_for
from autopar.graph import LayerGraph
from autopar.plan import Plan
from autopar.runtime.balance import BiasBalancer, bias_group, biased_routers
from autopar.runtime.chunked_loss import plan_loss
from autopar.runtime.compiled import compile_plan_blocks, requested
from autopar.runtime.float8 import convert as convert_float8
from autopar.runtime.float8 import gathered_in_float8
from autopar.runtime.float8 import requested as float8_requested
from autopar.runtime.here import here
from autopar.runtime.launch import capture_for, ensure_process_group, resolve_plan
from autopar.runtime.loss import default_loss, fp32_loss
from autopar.runtime.lowering import Lowered, lower, lower_local
from autopar.runtime.model import LossFn, OptimizerFactory, ParallelModel, SchedulerFactory
from autopar.runtime.precision import MasterWeights, attach_masters, plan_dtype
from autopar.runtime.state import param_entries


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with lr 1e-3: the optimizer ``compile`` builds when none is given."""
    return torch.optim.AdamW(params, lr=1e-3)



def _mixed_precision(lowered: Lowered, plan: Plan) -> MasterWeights | None:
    """fp32 masters for the parts of a bf16 plan that no FSDP2 unit holds (none for fp32)."""
    dtype = plan_dtype(plan.training.dtype)
    if dtype is None:
        return None
    ddp = [r.ddp if r is not None else None for r in lowered.data_parallel]
    fsdp = plan.mesh.dp * plan.mesh.cp > 1 and not any(d is not None for d in ddp)
    if fsdp:
        return None
    group = lowered.mesh["dp"].get_group() if lowered.mesh is not None and plan.mesh.dp > 1 else None
    scale = 1.0 / plan.microbatches if lowered.pipeline is not None else 1.0
    # ep's experts stay fp32 outside the dp engine, as beside FSDP2 (passes/expert_parallel.py)
    experts = frozenset(id(p) for r in lowered.experts for m in r.modules for p in m.parameters())
    return attach_masters(lowered.parts, ddp, group, dtype, scale, experts)


def compile(model: nn.Module, world_size: int | None = None, example_inputs: Any = None,
            cluster: Any = None, plan: Plan | str | Path | None = None, pins: Any = None,
            loss_fn: LossFn | None = None, optimizer: OptimizerFactory | None = None, *,
            init_fn: Callable[[nn.Module], None] | None = None, graph: LayerGraph | None = None,
            max_grad_norm: float | None = None, lr_scheduler: SchedulerFactory | None = None,
            weights: str | Path | None = None, seed: int = 0, torch_compile: bool | None = None,
            float8: bool | str | None = None, moe_bias_update: float = 0.0, **solve_kwargs: Any) -> ParallelModel:
    """Plan (or load a plan for) ``model`` and lower it for this rank.

    ``world_size`` defaults to the process group's size (torchrun's env vars
    initialise one: gloo on CPU, NCCL on GPU). ``plan``: a Plan or a plan JSON
    path, checked against the captured graph; else ``autopar.solve`` with
    ``cluster``, ``pins`` and ``solve_kwargs`` (e.g. ``global_batch``,
    ``dtype``). ``cluster`` defaults to this machine: its CUDA device's preset,
    ``cpu`` without a GPU (:func:`autopar.runtime.launch.local_cluster`).
    Outside a process group, ``world_size`` 1 trains in this process and a
    larger one gives a plan-only model (``launched`` false) whose
    ``train_step`` raises :class:`LaunchError`.
    ``loss_fn(output, targets)`` returns the microbatch mean (default
    :func:`default_loss`; a bf16 plan hands it the output in fp32);
    ``optimizer`` is a callable ``params -> Optimizer`` (default AdamW, lr
    1e-3). ``max_grad_norm`` clips by the global gradient norm;
    ``lr_scheduler`` is a callable ``optimizer -> scheduler``, stepped after
    each optimizer step. ``weights`` loads safetensors weights (a file or a
    Hugging Face directory) after lowering. ``init_fn`` initialises a
    meta-device model after sharding (default: ``reset_parameters()``);
    ``graph`` skips capture; ``seed`` seeds each step's dropout.
    ``torch_compile``: each repeated block under ``torch.compile`` after the
    lowering (:mod:`autopar.runtime.compiled`); the plan is solved and priced
    compiled, a given plan must have been (``training.compiled``; None: as the
    plan says). Plans it does not run yet raise
    :class:`~autopar.errors.CompileError` before any collective.
    ``float8``: True (``tensorwise`` scaling), ``"tensorwise"`` or ``"rowwise"``: the plan's linears
    (:func:`autopar.float8.select_linears` when solved here) run torchao's float8 matmuls
    (:mod:`autopar.runtime.float8`; emulated on a CPU); a given plan must have been priced so (None: as
    the plan says). A device without float8, a missing torchao or a lowering float8 does not run raises
    :class:`~autopar.errors.Float8Error` before any collective.
    ``moe_bias_update``: γ ≥ 0 of DeepSeek-V3's auxiliary-loss-free load
    balancing (0, the default: off): after each step every router's
    its balance bias moves by γ · sign(mean − count) per expert,
    the counts summed over every rank that routes different tokens
    (:mod:`autopar.runtime.balance`); a model with no such router, or a plan
    it does not run yet, raises :class:`~autopar.errors.LoweringError` before
    any collective.
    """
    launched = ensure_process_group()
    if world_size is None:
        if not launched:
            raise LaunchError("compile needs world_size outside a process group "
                              "(or launch under torchrun so it can be read)")
        world_size = dist.get_world_size()
    kwargs = dict(solve_kwargs, cluster=cluster, pins=pins, custom_loss=loss_fn not in (None, default_loss))
    torch_compile = requested(torch_compile)
    if plan is None and torch_compile:
        kwargs["compiled"] = True
    float8 = float8_requested(float8)
    if plan is None and float8:
        graph = graph if graph is not None else capture_for(model, example_inputs)
        kwargs["float8"] = settings_for(model, graph, float8)
    plan, graph = resolve_plan(model, example_inputs, plan, graph, world_size, launched, **kwargs)
    facts = here(world_size, launched, model=model, torch_compile=torch_compile, float8=float8,
                 moe_bias_update=moe_bias_update, read_device=plan.training.float8 is not None)
    admit(graph, plan, facts)  # every reason it would not run as priced, before any collective
    routers = biased_routers(model) if moe_bias_update else []
    loss_fn, chunked = plan_loss(model, graph, plan, loss_fn)  # a chunked plan's head returns the hidden state
    if not launched and world_size > 1:
        return ParallelModel(plan, graph, model, None, loss_fn, launched=False)
    dtype = plan_dtype(plan.training.dtype)
    first: dict[int, str] = {}  # a tied weight under the model's first name, whichever stage module holds it
    canonical = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    gathered = gathered_in_float8(plan, graph)
    if plan.training.float8 is not None:  # torchao's Float8Linear in place of the plan's linears, before lowering
        convert_float8(model, plan.training.float8, emulate=facts.device == "cpu", gathered=gathered)
    if launched:
        lowered = lower(model, graph, plan, example_inputs=example_inputs,
                        loss_fn=fp32_loss(loss_fn) if dtype is not None else loss_fn, init_fn=init_fn)
    else:
        lowered = lower_local(model, graph, plan, init_fn)
    if chunked:  # the FSDP2 unit that holds the head, gathered again for the loss under ZeRO-3
        loss_fn.attach(lowered.parts)

    def eager_block(path: str, reason: str) -> None:  # a graph break: the block runs eagerly from now on
        pm.plan = replace(pm.plan, notes=(*pm.plan.notes, f"torch.compile: block {path!r} runs eagerly, not as "
                                          f"priced: {reason}"))

    blocks = compile_plan_blocks(lowered.parts, graph, plan, eager_block)
    masters = _mixed_precision(lowered, plan)
    entries = param_entries([(canonical.get(n, n), p) for n, p in lowered.named_parameters()], masters,
                            lowered.permutations)
    opt = (optimizer or default_optimizer)([e.value for e in entries])
    module = model if lowered.pipeline is not None else lowered.module  # a pipeline's stages: lowered.parts
    pm = ParallelModel(plan, graph, module, opt, loss_fn, launched=launched, lowered=lowered,
                       scheduler=lr_scheduler(opt) if lr_scheduler is not None else None,
                       max_grad_norm=max_grad_norm, masters=masters, seed=seed, entries=entries,
                       compiled=tuple(blocks), float8_gathered=bool(gathered), chunked_loss=chunked,
                       balancer=BiasBalancer(routers, float(moe_bias_update), bias_group(lowered.mesh, plan))
                       if routers else None)
    if weights is not None:
        pm.load_weights(weights)
    return pm


__all__ = ["compile", "default_optimizer"]
