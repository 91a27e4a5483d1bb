"""Pipeline cases for :mod:`distributed`: pp > 1 plans against one process.

Same protocol as :mod:`equivalence_cases` (model seed 0, global batches seeds
1…3, 3 SGD-with-momentum steps and 3 AdamW steps, rank 0 compares with the
unsharded model), except that ``compile`` gets the example inputs: splitting
a model into stages traces it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import autopar
from autopar.errors import AutoparError
from equivalence_cases import (ADAMW, GPT_TP, SGD, Spec, _batches, _max_rel, gpt_tiny, hf_llama,
                               plan_for, run_reference)


def run_parallel(spec: Spec, plan: Any, graph: Any, opt: Callable) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = spec.build()
    batches = _batches(spec, inputs, model)
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, optimizer=opt)
    out: dict[str, Any] = {"losses": [], "local_param_bytes": pm.local_param_bytes(),
                           "tracer": pm.lowered.pipeline.tracer if pm.lowered.pipeline else None}
    for k, (x, y) in enumerate(batches):
        out["losses"].append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
        if k == 0:
            out["grads"] = pm.full_grads()
    out["params"] = pm.state_dict(full=True)
    return out


def _rel_losses(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def equivalence(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    """A case: SGD-momentum exactness and AdamW agreement of ``spec`` against one process."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = plan_for(spec, world_size)
        sgd = run_parallel(spec, plan, graph, lambda p: torch.optim.SGD(p, **SGD))
        adam = run_parallel(spec, plan, graph, lambda p: torch.optim.AdamW(p, **ADAMW))
        metrics: dict[str, Any] = {
            "mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp], "microbatches": plan.microbatches,
            "schedule": plan.schedule, "chunks": plan.chunks, "tracer": sgd["tracer"],
            "stages": [l.stage for l in plan.layers], "losses": sgd["losses"],
        }
        if rank != 0:
            return metrics
        ref_sgd = run_reference(spec, lambda p: torch.optim.SGD(p, **SGD))
        ref_adam = run_reference(spec, lambda p: torch.optim.AdamW(p, **ADAMW))
        metrics["loss1_rel"] = abs(sgd["losses"][0] - ref_sgd["losses"][0]) / abs(ref_sgd["losses"][0])
        metrics["grad_rel"], metrics["grad_worst"] = _max_rel(sgd["grads"], ref_sgd["grads"])
        metrics["sgd_loss_rel"] = _rel_losses(sgd["losses"], ref_sgd["losses"])
        metrics["param_rel"], metrics["param_worst"] = _max_rel(sgd["params"], ref_sgd["params"])
        metrics["adam_loss_rel"] = _rel_losses(adam["losses"], ref_adam["losses"])
        metrics["local_bytes_frac"] = sgd["local_param_bytes"] / ref_sgd["param_bytes"]
        return metrics

    return case


def lowering_error(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    """A case: compiling ``spec`` raises a typed error on every rank (recorded, not raised)."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = plan_for(spec, world_size)
        torch.manual_seed(0)
        model, inputs = spec.build()
        try:
            autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
        except AutoparError as exc:
            return {"raised": type(exc).__name__, "message": str(exc)}
        return {"raised": None}

    return case


def gpt_4layer() -> tuple[torch.nn.Module, tuple]:
    import gpt

    return gpt.gpt(n_layer=4, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="cpu")


PP2 = ("pp=2", "dp=1", "tp=1", "zero=0")
NO_RC = ("recompute=none",)

SPECS: dict[str, Spec] = {
    # W = 2
    "pp_gpipe": Spec(gpt_tiny, PP2 + ("microbatches=4", "schedule=gpipe", "recompute=all"), 8),
    "pp_1f1b": Spec(gpt_tiny, PP2 + NO_RC + ("microbatches=4", "schedule=1f1b"), 8),
    "pp_interleaved": Spec(gpt_tiny, PP2 + NO_RC + ("microbatches=4", "schedule=interleaved_1f1b",
                                                   "chunks=2"), 8),
    "pp_model_parallel": Spec(gpt_tiny, PP2 + NO_RC + ("microbatches=1",), 4),
    "pp_hf_llama": Spec(hf_llama, PP2 + NO_RC + ("microbatches=2", "schedule=1f1b"), 4),
    # W = 4
    "pp2_dp2_zero3": Spec(gpt_tiny, ("pp=2", "dp=2", "tp=1", "zero=3", "microbatches=2",
                                     "schedule=1f1b") + NO_RC, 8),
    "pp2_dp2_hf_llama": Spec(hf_llama, ("pp=2", "dp=2", "tp=1", "zero=3", "microbatches=2",
                                        "schedule=1f1b") + NO_RC, 8),
    # W = 8
    "pp2_dp2_tp2": Spec(gpt_4layer, ("pp=2", "dp=2", "tp=2", "zero=3", "microbatches=2",
                                     "schedule=1f1b") + NO_RC + GPT_TP, 8),
    "solver_pick_w8": Spec(gpt_4layer, (), 16),
}

ERROR_SPECS: dict[str, Spec] = {
    # an export-captured model's layers are never called: recompute cannot hook them
    "err_hf_recompute": Spec(hf_llama, PP2 + ("microbatches=2", "schedule=1f1b", "recompute=all"), 4),
    # ... nor tensor parallelism (W = 4: pp 2 × tp 2)
    "err_hf_tp": Spec(hf_llama, ("pp=2", "dp=1", "tp=2", "zero=0", "microbatches=2", "schedule=1f1b",
                                 "model.layers.*:tp=megatron") + NO_RC, 4),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    **{k: equivalence(v) for k, v in SPECS.items()},
    **{k: lowering_error(v) for k, v in ERROR_SPECS.items()},
}
