"""Cases for :mod:`distributed`: hybrid sharding (HSDP, ``dp_replicate``) against one process.

W = 4: 2 replicas × 2 shards under ZeRO-3, ZeRO-2 (two microbatches: a reduce-scatter and an all-reduce
across replicas each) and ZeRO-1, on the GPT of :mod:`equivalence_cases` and a Hugging Face Llama; where
the units' weights live (the 2-D mesh, a rank's half of each); and checkpoints saved under 2 × 2 HSDP
loaded under plain dp = 4 ZeRO-3 and back; 2 replicas beside cp = 2. W = 8: HSDP beside tp = 2 and inside
a pp = 2 pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from equivalence_cases import GPT_TP, PP1, Spec, equivalence, gpt_tiny, hf_llama, plan_for
from training_cases import load_case, save_case

import autopar

HSDP = ("dp=4", "dp_replicate=2")
SPECS: dict[str, Spec] = {
    "gpt_zero3": Spec(gpt_tiny, PP1 + HSDP + ("tp=1", "zero=3", "microbatches=1"), 4, adam=True),
    "gpt_zero2": Spec(gpt_tiny, PP1 + ("dp=4", "dp_shard=2", "tp=1", "zero=2", "microbatches=2"), 8),
    "gpt_zero1": Spec(gpt_tiny, PP1 + HSDP + ("tp=1", "zero=1", "microbatches=2"), 8),
    "llama_zero3": Spec(hf_llama, PP1 + HSDP + ("tp=1", "zero=3", "microbatches=1"), 4),
    "llama_zero2": Spec(hf_llama, PP1 + HSDP + ("tp=1", "zero=2", "microbatches=2"), 8),
    # beside cp: the shard group is a replica's dp × cp ranks (here 1 × 2), replicas over dp
    "gpt_cp2": Spec(gpt_tiny, PP1 + ("dp=2", "dp_replicate=2", "cp=2", "tp=1", "zero=3", "microbatches=1"), 4),
    # W = 8
    "gpt_tp2": Spec(gpt_tiny, PP1 + HSDP + ("tp=2", "zero=3", "microbatches=1") + GPT_TP, 8),
    "llama_tp2": Spec(hf_llama, PP1 + HSDP + ("tp=2", "zero=2", "microbatches=2", "model.layers.*:tp=megatron"), 8),
    "llama_pp2": Spec(hf_llama, ("pp=2", "recompute=none") + HSDP + ("tp=1", "zero=3", "microbatches=2",
                                                                    "schedule=1f1b"), 8),
}


def layout(rank: int, world_size: int) -> dict[str, Any]:
    """Where a 2 × 2 HSDP plan's ZeRO-3 weights live: each a DTensor on the (dp_replicate, dp_shard_cp) mesh,
    replicated over the first dimension and sharded over the second, and a rank holding half the model."""
    from torch.distributed.tensor import DTensor

    plan, graph = plan_for(SPECS["gpt_zero3"], world_size)
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    total = sum(p.numel() for p in model.parameters())
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    params = [p for m in pm.lowered.parts for p in m.parameters()]
    meshes = {(tuple(p.device_mesh.mesh_dim_names), tuple(str(x) for x in p.placements))
              for p in params if isinstance(p, DTensor)}
    return {"dp_replicate": plan.mesh.dp_replicate, "meshes": sorted(meshes),
            "plain": sum(not isinstance(p, DTensor) for p in params),
            "local_frac": sum(p.to_local().numel() for p in params if isinstance(p, DTensor)) / total}


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}
CASES["layout"] = layout
# checkpoints across shard degrees (W = 4, one request: saved, then loaded under the other plan)
CASES["save_hsdp"] = save_case("hsdp_zero3_w4")
CASES["save_zero3"] = save_case("zero3_w4")
CASES["hsdp_to_zero3"] = load_case("hsdp_zero3_w4", "zero3_w4")
CASES["zero3_to_hsdp"] = load_case("zero3_w4", "hsdp_zero3_w4")
W4 = ["gpt_zero3", "gpt_zero2", "gpt_zero1", "llama_zero3", "llama_zero2", "gpt_cp2", "layout", "save_hsdp",
      "save_zero3", "hsdp_to_zero3", "zero3_to_hsdp"]
W8 = ["gpt_tp2", "llama_tp2", "llama_pp2"]
