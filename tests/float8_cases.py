"""Cases for :mod:`distributed`: float8 training (torchao's emulation on CPU) on 2 gloo ranks against one process.

Each case solves a float8 plan on rank 0 (``solve(..., float8=settings_for(...))``; sent to every
rank), trains with ``autopar.compile(plan=...)`` — the plan's linears swapped for torchao's
``Float8Linear`` before DDP or FSDP2 — for :data:`STEPS` SGD-with-momentum steps, and compares
losses, first-step gradients and the parameters after the last step with two one-process runs on
rank 0: the same linears converted the same way (``float8_ref``: what the parallel run should
match: exactly under rowwise scaling, whose scales are powers of 2, so a value's rounding to float8
does not depend on which amax set its scale; up to the scales under tensorwise, whose scale is the
amax of the rank's own half of the batch, not of the whole batch, so the rounding differs) and the
unconverted fp32 model (``fp32_ref``: how far float8's rounding itself moves training).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from equivalence_cases import PP1, SGD, Spec, _max_rel, from_rank0, gpt_tiny, hf_llama, make_batch

import autopar
from autopar.float8 import settings_for
from autopar.graph import LayerGraph
from autopar.plan import Plan
from autopar.runtime.float8 import convert
from autopar.runtime.loss import default_loss

STEPS = 3


def _plan(spec: Spec, world_size: int, recipe: str) -> tuple[Plan, LayerGraph]:
    def make() -> tuple[str, dict]:
        torch.manual_seed(0)
        model, inputs = spec.build()
        graph = autopar.capture(model, inputs)
        plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", pins=list(spec.pins),
                             global_batch=spec.global_batch, float8=settings_for(model, graph, recipe))
        return plan.to_json(), graph.to_dict()

    text, graph = from_rank0(make)
    return Plan.from_json(text), LayerGraph.from_dict(graph)


def _one_process(spec: Spec, plan: Plan | None) -> dict[str, Any]:
    """SGD steps of the whole model in this process: converted as ``plan`` says (None: fp32, unconverted)."""
    torch.manual_seed(0)
    model, inputs = spec.build()
    if plan is not None:
        convert(model, plan.training.float8, emulate=True)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    out: dict[str, Any] = {"losses": [], "start": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for k in range(STEPS):
        x, y = make_batch(inputs, model, spec.global_batch, seed=1 + k)
        opt.zero_grad()
        loss = default_loss(model(x), y)
        loss.backward()
        if k == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        out["losses"].append(float(loss.detach()))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _global_rel(got: dict, ref: dict, start: dict | None = None) -> float:
    """‖got − ref‖ / ‖ref‖ over all of ``ref``'s tensors together (less ``start`` on both sides: the
    change SGD made, so that a parameter's norm does not hide an error in its updates)."""
    num = den = 0.0
    for n, b in ref.items():
        a, b = got[n].detach().double(), b.detach().double()
        if start is not None:
            a, b = a - start[n].double(), b - start[n].double()
        num, den = num + float((a - b).pow(2).sum()), den + float(b.pow(2).sum())
    return (num / den) ** 0.5


def float8_equivalence(spec: Spec, recipe: str) -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = _plan(spec, world_size, recipe)
        torch.manual_seed(0)
        model, inputs = spec.build()
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph,
                             optimizer=lambda p: torch.optim.SGD(p, **SGD))
        converted = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
        # FSDP2 gathers these in float8 (torchao's float8-cast weight inside the DTensor shard)
        gathered = sorted(n for n, m in model.named_modules() if type(getattr(getattr(m, "weight", None),
                          "_local_tensor", None)).__name__ == "WeightWithDynamicFloat8CastTensor")
        losses, grads = [], {}
        for k in range(STEPS):
            x, y = make_batch(inputs, model, spec.global_batch, seed=1 + k)
            losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
            if k == 0:
                grads = pm.full_grads()
        params = {n: v.clone() for n, v in pm.state_dict(full=True).items()}
        refs = from_rank0(lambda: {"float8": _one_process(spec, plan), "fp32": _one_process(spec, None)})
        out: dict[str, Any] = {"converted": converted, "planned": sorted(plan.training.float8.paths()),
                               "recipe": plan.training.float8.recipe.value, "zero": sorted({l.choice.zero
                                                                                          for l in plan.layers}),
                               "losses": losses, "gathered": gathered}
        for name, ref in refs.items():
            out[f"{name}_loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
            out[f"{name}_grad_rel"], out[f"{name}_grad_worst"] = _max_rel(grads, ref["grads"])
            out[f"{name}_param_rel"], out[f"{name}_param_worst"] = _max_rel(params, ref["params"])
            out[f"{name}_grads_rel"] = _global_rel(grads, ref["grads"])
            out[f"{name}_updates_rel"] = _global_rel(params, ref["params"], ref["start"])
        return out

    return case


DDP = PP1 + ("dp=2", "tp=1", "zero=0", "microbatches=1")
ZERO3 = PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1")
CP2 = PP1 + ("dp=1", "cp=2", "tp=1", "zero=3", "microbatches=1")

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "ddp_tensorwise": float8_equivalence(Spec(gpt_tiny, DDP, 4), "tensorwise"),
    "zero3_tensorwise": float8_equivalence(Spec(gpt_tiny, ZERO3, 4), "tensorwise"),
    "zero3_rowwise": float8_equivalence(Spec(gpt_tiny, ZERO3, 4), "rowwise"),
    "hf_llama_zero3": float8_equivalence(Spec(hf_llama, ZERO3, 4), "tensorwise"),
    "hf_llama_ddp_rowwise": float8_equivalence(Spec(hf_llama, DDP, 4), "rowwise"),
    "cp2_rowwise": float8_equivalence(Spec(gpt_tiny, CP2 + ("cp_attention=allgather",), 2), "rowwise"),
    "cp2_ulysses_tensorwise": float8_equivalence(Spec(gpt_tiny, CP2 + ("cp_attention=ulysses",), 2), "tensorwise"),
    "hf_llama_cp2_ring_rowwise": float8_equivalence(Spec(hf_llama, CP2 + ("cp_attention=ring",), 2), "rowwise"),
}
