"""Pipeline cases for :mod:`distributed`: pp > 1 plans against one process.

Same protocol and the same case factory as :mod:`equivalence_cases` (model
seed 0, global batches seeds 1…3, 3 SGD-with-momentum steps, 3 AdamW
steps on pp_1f1b alone (ADAM_CASES), every rank compares with the unsharded model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from equivalence_cases import GPT_TP, Spec, equivalence, gpt_tiny, hf_llama, plan_for

import autopar
from autopar.errors import AutoparError


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
    # the cut between the blocks (the solver may move it where the loss's time weighs on the last stage)
    "pp_1f1b": Spec(gpt_tiny, PP2 + NO_RC + ("microbatches=4", "schedule=1f1b", "blocks.1:stage=1"), 8, adam=True),
    "pp_interleaved": Spec(gpt_tiny, PP2 + NO_RC + ("microbatches=4", "schedule=interleaved_1f1b",
                                                   "chunks=2"), 8),
    "pp_model_parallel": Spec(gpt_tiny, PP2 + NO_RC + ("microbatches=1",), 4),
    "pp_hf_llama": Spec(hf_llama, PP2 + NO_RC + ("microbatches=2", "schedule=1f1b"), 4),
    # W = 4
    "pp2_dp2_zero3": Spec(gpt_tiny, ("pp=2", "dp=2", "tp=1", "zero=3", "microbatches=2",
                                     "schedule=1f1b", "blocks.1:stage=1") + NO_RC, 8),
    "pp2_dp2_hf_llama": Spec(hf_llama, ("pp=2", "dp=2", "tp=1", "zero=3", "microbatches=2",
                                        "schedule=1f1b") + NO_RC, 8),
    # plain DP inside pipeline stages (FSDP2's replicate, not DDP), and the solver's own
    # choices under interleaved 1F1B over dp (it may cut anywhere a batched value crosses)
    "pp2_dp2_plain_dp": Spec(gpt_tiny, ("pp=2", "dp=2", "tp=1", "zero=0", "microbatches=2",
                                        "schedule=1f1b") + NO_RC, 8),
    "pp2_dp2_interleaved": Spec(gpt_tiny, ("pp=2", "dp=2", "tp=1", "microbatches=2",
                                           "schedule=interleaved_1f1b", "chunks=2"), 8),
    # a sharded plan's stages that hold only blocks (no root layer): one of ZeRO-0 blocks alone
    # (a replicate root around a replicate unit), one of ZeRO-3 blocks (a fully_shard root)
    "pp2_dp2_block_stages": Spec(gpt_4layer, ("pp=2", "dp=2", "tp=1", "microbatches=2",
                                              "schedule=interleaved_1f1b", "chunks=2", "blocks.0:stage=0",
                                              "blocks.1:stage=1", "blocks.2:stage=2", "blocks.3:stage=3",
                                              "blocks.0:zero=3", "blocks.1:zero=0", "blocks.2:zero=3",
                                              "blocks.3:zero=0") + NO_RC, 8),
    # W = 8
    # loss=full: the tied head split over tp with its embedding (the chunked loss keeps a pipeline's tied head
    # whole on every tp rank), so each rank holds an eighth
    "pp2_dp2_tp2": Spec(gpt_4layer, ("pp=2", "dp=2", "tp=2", "zero=3", "microbatches=2",
                                     "schedule=1f1b", "loss=full") + NO_RC + GPT_TP, 8),
    "solver_pick_w8": Spec(gpt_4layer, (), 16),
}

# an export-captured model's pipeline stages call its layer modules (exported with their call
# signatures kept): recompute and tensor parallelism run inside them
SPECS["pp_hf_llama_recompute"] = Spec(hf_llama, PP2 + ("microbatches=2", "schedule=1f1b", "recompute=all"), 4)
SPECS["pp2_tp2_hf_llama"] = Spec(hf_llama, ("pp=2", "dp=1", "tp=2", "zero=0", "microbatches=2", "schedule=1f1b",
                                            "model.layers.*:tp=megatron") + NO_RC, 4)
ERROR_SPECS: dict[str, Spec] = {}


def meta_pipeline(rank: int, world_size: int) -> dict[str, Any]:
    """A meta-device GPT under pp = 2: each rank allocates only its own stage, then trains."""
    import gpt

    model, inputs = gpt.gpt(n_layer=4, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="meta")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=4,
                         pins=list(PP2) + ["microbatches=2", "schedule=1f1b", "zero=0", "recompute=none"])
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 16), generator=g)
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(x)) for _ in range(3)]
    own = [p for mod in pm.lowered.pipeline.modules for p in mod.parameters()]
    return {"local_bytes_frac": sum(p.numel() * p.element_size() for p in own) / full,
            "any_meta": any(p.is_meta for p in own), "losses": losses}


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    **{k: equivalence(v) for k, v in SPECS.items()},
    **{k: lowering_error(v) for k, v in ERROR_SPECS.items()},
    "meta_pipeline": meta_pipeline,
}
