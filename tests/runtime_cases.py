"""Cases for :mod:`distributed` that test one pass or one error of the runtime on 2 ranks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from equivalence_cases import GPT_TP, Spec, gpt_tiny, make_batch, plan_for, rel

import autopar
from autopar.errors import AutoparError

DP2_ZERO3 = Spec(gpt_tiny, ("pp=1", "recompute=none", "dp=2", "tp=1", "zero=3", "microbatches=1"), 4)
TP2_GPT = Spec(gpt_tiny, ("pp=1", "recompute=none", "dp=1", "tp=2", "zero=0") + GPT_TP, 4)
MIXED = Spec(gpt_tiny, ("pp=1", "recompute=none", "dp=2", "tp=1", "microbatches=1", "tok_emb:zero=0",
                        "pos_emb:zero=1", "blocks.0:zero=3", "blocks.1:zero=2", "ln_f:zero=1",
                        "lm_head:zero=3", "drop:zero=0"), 4)


def _mesh(plan):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp),
                            mesh_dim_names=("pp", "dp", "tp"))


def tp_pass(rank: int, world_size: int) -> dict[str, Any]:
    """apply_tensor_parallel alone: local shapes, head counts, same forward as unsharded."""
    from autopar.passes.tensor_parallel import apply_tensor_parallel

    plan, graph = plan_for(TP2_GPT, world_size)
    torch.manual_seed(0)
    model, _ = gpt_tiny()
    torch.manual_seed(0)
    ref, _ = gpt_tiny()
    x, _ = make_batch((torch.zeros(1, 16, dtype=torch.long),), ref, 4, seed=3)
    result = apply_tensor_parallel(model, graph, plan, _mesh(plan)["tp"])
    attn = model.blocks[0].attn
    return {
        "layers": result.layers,
        "permuted": sorted(result.permutations),
        "c_attn_local": list(attn.c_attn.weight.to_local().shape),
        "c_proj_local": list(attn.c_proj.weight.to_local().shape),
        "tok_emb_local": list(model.tok_emb.weight.to_local().shape),
        "lm_head_local": list(model.lm_head.weight.to_local().shape),
        "n_head": attn.n_head, "d_model": attn.d_model,
        "forward_rel": rel(model(x), ref(x)),
    }


def zero_pass(rank: int, world_size: int) -> dict[str, Any]:
    """apply_data_parallel alone: which engine per layer, deferred modules, local shards."""
    from torch.distributed.fsdp import FSDPModule

    from autopar.contract import plan_layout
    from autopar.passes.zero import apply_data_parallel

    plan, graph = plan_for(MIXED, world_size)
    torch.manual_seed(0)
    model, _ = gpt_tiny()
    result = apply_data_parallel(model, plan_layout(graph, plan).stage_units(0), _mesh(plan)["dp"])
    deferred = [n for n, m in model.named_modules() if any(m is d for d in result.deferred)]
    return {
        "zero_by_path": result.zero_by_path,
        "deferred": sorted(deferred),
        "types": {p: type(model.get_submodule(p)).__name__ for p in ("tok_emb", "blocks.0", "ln_f")},
        "all_fsdp": all(isinstance(model.get_submodule(p), FSDPModule) for p in result.zero_by_path if p),
        "blocks0_c_fc_local": list(model.blocks[0].mlp.c_fc.weight.to_local().shape),
        "tok_emb_local": list(model.tok_emb.weight.to_local().shape),
    }


def _compiled_meta_gpt(spec: Any, world_size: int) -> tuple[Any, int, torch.Tensor, torch.Tensor]:
    """A 2-layer GPT built on the meta device, compiled under ``spec``'s plan: the model,
    its full parameter bytes, and one global batch."""
    import gpt

    plan, graph = plan_for(spec, world_size)
    model, _ = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="meta")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    pm = autopar.compile(model, plan=plan, graph=graph)
    x, y = make_batch((torch.zeros(1, 16, dtype=torch.long),), pm.module, 4, seed=1)
    return pm, full, x, y


def meta_zero3(rank: int, world_size: int) -> dict[str, Any]:
    """A meta-device model is materialised shard by shard: each rank holds about half."""
    pm, full, x, y = _compiled_meta_gpt(DP2_ZERO3, world_size)
    loss = pm.train_step(pm.local_batch(x), pm.local_batch(y))
    return {"local_bytes_frac": pm.local_param_bytes() / full, "loss": loss,
            "any_meta": any(p.is_meta for p in pm.module.parameters())}


def state_dicts(rank: int, world_size: int) -> dict[str, Any]:
    """Full state dicts are unsharded and in the original layout; sharded ones keep the keys."""
    plan, graph = plan_for(TP2_GPT, world_size)
    torch.manual_seed(0)
    model, _ = gpt_tiny()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    pm = autopar.compile(model, plan=plan, graph=graph)
    full, sharded = pm.state_dict(full=True), pm.state_dict(full=False)
    return {"same_keys": sorted(full) == sorted(original) == sorted(sharded),
            "max_rel": max(rel(full[k], original[k]) for k in original)}


def _raised(fn) -> dict[str, Any]:
    try:
        fn()
    except AutoparError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def err_world_size(rank: int, world_size: int) -> dict[str, Any]:
    pins = ("pp=1", "recompute=none", "dp=4", "tp=1", "zero=3", "microbatches=1")
    plan, graph = plan_for(replace(DP2_ZERO3, pins=pins, global_batch=8, world_size=4), world_size)
    torch.manual_seed(0)
    model, _ = gpt_tiny()
    return _raised(lambda: autopar.compile(model, plan=plan, graph=graph))


def _compiled(**kwargs: Any):
    # a loss of the user's own is planned with the loss over whole logits (a chunked plan runs the default's)
    spec = Spec(gpt_tiny, DP2_ZERO3.pins + ("loss=full",), 4) if "loss_fn" in kwargs else DP2_ZERO3
    plan, graph = plan_for(spec, dist.get_world_size())
    torch.manual_seed(0)
    model, _ = gpt_tiny()
    pm = autopar.compile(model, plan=plan, graph=graph, **kwargs)
    x, y = make_batch((torch.zeros(1, 16, dtype=torch.long),), model, 4, seed=1)
    return pm, x, y


def err_bad_batch(rank: int, world_size: int) -> dict[str, Any]:
    pm, x, y = _compiled()
    out = {"local": _raised(lambda: pm.train_step(x, y))}  # the global batch, not this rank's shard
    out["global"] = _raised(lambda: pm.local_batch(x[:3]))
    return out


def err_nonscalar_loss(rank: int, world_size: int) -> dict[str, Any]:
    def per_sample(out, y):
        return torch.nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none")

    pm, x, y = _compiled(loss_fn=per_sample)
    return _raised(lambda: pm.train_step(pm.local_batch(x), pm.local_batch(y)))


CASES = {f.__name__: f for f in (tp_pass, zero_pass, meta_zero3, state_dicts, err_world_size,
                                 err_bad_batch, err_nonscalar_loss)}


def meta_tp(rank: int, world_size: int) -> dict[str, Any]:
    """A meta model under TP is initialised on its DTensor shards and trains."""
    pm, full, x, y = _compiled_meta_gpt(TP2_GPT, world_size)
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(y)) for _ in range(3)]
    return {"local_bytes_frac": pm.local_param_bytes() / full, "losses": losses}


CASES["meta_tp"] = meta_tp


DP2 = Spec(gpt_tiny, ("pp=1", "recompute=none", "dp=2", "tp=1", "zero=0", "microbatches=1"), 4)


def ddp_replicas(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks that initialise differently start DDP training from the first rank's weights."""
    plan, graph = plan_for(DP2, world_size)
    torch.manual_seed(rank)  # a different model on every rank
    model, _ = gpt_tiny()
    pm = autopar.compile(model, plan=plan, graph=graph)
    weights = torch.cat([p.detach().reshape(-1) for p in pm.module.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    torch.manual_seed(0)
    first, _ = gpt_tiny()
    return {"replicas_rel": max(rel(g, gathered[0]) for g in gathered),
            "first_rank_rel": rel(gathered[0], torch.cat([p.detach().reshape(-1) for p in first.parameters()]))}


CASES["ddp_replicas"] = ddp_replicas
