"""Cases for :mod:`distributed`: each runs a plan on W ranks against one process.

Every equivalence case builds the same model (seed 0) and global batches
(seed 1) on each rank, compiles it under a fully pinned plan (rank 0 captures
and solves; the plan is broadcast), trains 3 SGD-with-momentum steps (and, on
the one case an engine marks ``adam=True``: :data:`ADAM_CASES`, 3 AdamW steps),
and on every rank compares with the unsharded model trained on the whole
global batch in-process (by rank 0, which sends it to the others).
Metrics are relative differences ‖Δ‖/‖ref‖ per tensor (max over tensors) and
|Δ|/|ref| for losses.

More cases (pipeline plans) register in ``CASES`` the same way.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autopar  # noqa: E402
from autopar.contract import plan_layout  # noqa: E402
from autopar.graph import LayerGraph  # noqa: E402
from autopar.inputs import call  # noqa: E402
from autopar.mesh import MeshAxis, declared  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.runtime import default_loss  # noqa: E402

STEPS = 3
SGD = dict(lr=0.05, momentum=0.9)
ADAMW = dict(lr=1e-3)


# ------------------------------------------------------------------ models


def gpt_tiny() -> tuple[nn.Module, tuple]:
    """A GPT whose LM head is wide enough (vocab ≥ 8·d_model) to get the vocab style."""
    import gpt

    return gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="cpu")


def plain_gpt_small() -> tuple[nn.Module, tuple]:
    """examples/plain_gpt.py's GPT (no config: ``qkv.chunk(3)``, ``reshape(b, t, heads, c // heads)``)."""
    import plain_gpt

    model = plain_gpt.GPT(vocab=256, width=64, heads=4, layers=2, seq=16)
    return model, (torch.zeros(2, 16, dtype=torch.long),)


def mlp_small() -> tuple[nn.Module, tuple]:
    import mlp

    return mlp.mlp(width=32, depth=3, batch=2, device="cpu")


def hf_llama() -> tuple[nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg), (torch.zeros(2, 16, dtype=torch.long),)


@dataclass(frozen=True)
class Spec:
    """A model, a fully pinned plan and a global batch size."""

    build: Callable[[], tuple[nn.Module, tuple]]
    pins: tuple[str, ...]
    global_batch: int
    world_size: int | None = None  # the plan's, when it differs from the launch (error cases)
    classes: int | None = None  # targets are one class index per sample (an image classifier)
    synthetic: bool = False  # batches as verify makes them (any inputs; targets that fit the output)
    ep: int = 1  # expert-parallel degree set on the plan after solving (that mesh runs, whatever was picked)
    loss: Callable[[Any, Any], torch.Tensor] | None = None  # both sides' loss (None: the default loss)
    adam: bool = False  # also 3 AdamW steps against one process: one case an engine carries it (ADAM_CASES)


def make_batch(model_inputs: tuple, model: nn.Module, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch shaped like the example inputs: token ids → next-token ids, floats → floats."""
    g = torch.Generator().manual_seed(seed)
    ex = model_inputs[0]
    if ex.is_floating_point():
        x = torch.randn((batch, *ex.shape[1:]), generator=g)
        return x, torch.randn((batch, *ex.shape[1:]), generator=g)
    vocab = _vocab(model)
    x = torch.randint(0, vocab, (batch, *ex.shape[1:]), generator=g)
    return x, torch.randint(0, vocab, (batch, *ex.shape[1:]), generator=g)


def _vocab(model: nn.Module) -> int:
    emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    return emb.num_embeddings


# ------------------------------------------------------------------ planning


# Rank 0's captures in this worker, by what a capture reads: the model's builder (the same function object,
# so the same model and inputs, built under seed 0) and the module globals cases patch around it. A worker
# runs the cases of many modules, most of them plans of a few models: each model is captured once a worker.
_CAPTURED: dict[tuple, dict] = {}


def _captured(build: Callable[[], tuple[nn.Module, tuple]]) -> LayerGraph:
    from autopar.mesh import AXES
    from autopar.sharding import check, narrow

    key = (build, check.MAX_CHECK_PARAMS, narrow.narrow_copy, tuple(AXES))
    if key not in _CAPTURED:
        torch.manual_seed(0)
        _CAPTURED[key] = autopar.capture(*build()).to_dict()
    return LayerGraph.from_dict(_CAPTURED[key])


def plan_for(spec: Spec, world_size: int) -> tuple[Plan, LayerGraph]:
    """Rank 0 captures (once a worker per model: :func:`_captured`) and solves; every rank gets the same
    plan and graph."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        graph = _captured(spec.build)
        plan = autopar.solve(graph, spec.world_size or world_size, cluster="cpu", dtype="fp32",
                             pins=list(spec.pins), global_batch=spec.global_batch)
        if spec.ep > 1:
            plan = dataclasses.replace(plan, mesh=plan.mesh.replace(ep=spec.ep))
        box[0] = (plan.to_json(), graph.to_dict())
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0][0]), LayerGraph.from_dict(box[0][1])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def _batches(spec: Spec, inputs: tuple, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if spec.synthetic:
        from autopar.tools.batches import probe, synthetic_batch

        probed = probe(model, inputs)
        return [synthetic_batch(model, inputs, spec.global_batch, 1 + k, probed) for k in range(STEPS)]
    if spec.classes is not None:
        gens = [torch.Generator().manual_seed(1 + k) for k in range(STEPS)]
        return [(torch.randn((spec.global_batch, *inputs[0].shape[1:]), generator=g),
                 torch.randint(0, spec.classes, (spec.global_batch,), generator=g)) for g in gens]
    return [make_batch(inputs, model, spec.global_batch, seed=1 + k) for k in range(STEPS)]


def run_parallel(spec: Spec, plan: Plan, graph: LayerGraph, opt: Callable) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = spec.build()
    batches = _batches(spec, inputs, model)
    # example inputs: a pipeline plan traces the model again to split it into stages
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph, optimizer=opt, loss_fn=spec.loss)
    out: dict[str, Any] = {"losses": [], "local_param_bytes": pm.local_param_bytes(),
                           "tracer": pm.lowered.pipeline.tracer if pm.lowered.pipeline else None,
                           "mesh_dims": list(pm.lowered.mesh.mesh_dim_names)}
    for k, (x, y) in enumerate(batches):
        out["losses"].append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
        if k == 0:
            out["grads"] = pm.full_grads()
    out["params"] = pm.state_dict(full=True)
    return out


def run_reference(spec: Spec, opt: Callable) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = spec.build()
    batches = _batches(spec, inputs, model)
    optimizer = opt(model.parameters())
    out: dict[str, Any] = {"losses": [], "param_bytes": sum(p.numel() * p.element_size()
                                                            for p in model.parameters())}
    for k, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = (spec.loss or default_loss)(call(model, x), y)
        loss.backward()
        if k == 0:
            # a parameter the forward never uses (BERT's unused MLM bias) has no gradient to compare
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        out["losses"].append(loss.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # BatchNorm's running statistics: what one device holds after the steps
    out["params"] |= {n: b.detach().clone() for n, b in model.named_buffers() if ".running_" in f".{n}"}
    return out


FLOOR = 0.1  # a tensor is judged against max(‖ref‖, FLOOR · rms · √numel) (verify's floor)


def _max_rel(got: dict, ref: dict) -> tuple[float, str]:
    """Worst per-tensor relative error; a tensor whose exact value is ~0 (an attention key bias's
    gradient) is judged against the model-wide scale, so rounding noise over zero is not a failure."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise AssertionError(f"the parallel run lacks {missing}")
    total = sum(float(t.detach().double().pow(2).sum()) for t in ref.values())
    rms = (total / max(sum(t.numel() for t in ref.values()), 1)) ** 0.5

    def judged(n: str) -> float:
        a, b = got[n].detach().double(), ref[n].detach().double()
        return float((a - b).norm()) / max(float(b.norm()), FLOOR * rms * b.numel() ** 0.5, 1e-300)
    return max(((judged(n), n) for n in ref), default=(0.0, ""))


def from_rank0(make: Callable[[], Any]) -> Any:
    """``make()`` run on rank 0 alone, its result sent to every rank."""
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def equivalence(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    """A case: SGD-momentum exactness of ``spec`` against one process, on every rank (rank 0 trains the
    one-process reference; each rank compares its own losses, full gradients and full parameters with
    it), and AdamW agreement where ``spec.adam`` (the AdamW leg is a second compile and 3 more steps on
    both sides, so one case an engine runs it: :data:`ADAM_CASES`)."""

    def case(rank: int, world_size: int) -> dict[str, Any]:
        plan, graph = plan_for(spec, world_size)
        sgd = run_parallel(spec, plan, graph, lambda p: torch.optim.SGD(p, **SGD))
        adam = run_parallel(spec, plan, graph, lambda p: torch.optim.AdamW(p, **ADAMW)) if spec.adam else None
        lowered = plan_layout(graph, plan)
        metrics: dict[str, Any] = {"mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp], "ep": plan.mesh.ep,
                                   "cp": plan.mesh.cp,
                                   "mesh_dims": sgd["mesh_dims"],
                                   "microbatches": plan.microbatches, "schedule": plan.schedule.value,
                                   "chunks": plan.chunks, "tracer": sgd["tracer"],
                                   "cp_attention": str(plan.cp_attention),
                                   "stages": [l.stage for l in plan.layers],
                                   "layers": [[l.name, l.choice.tp, l.choice.zero, l.choice.recompute, l.choice.sp]
                                              for l in plan.layers],
                                   "losses": sgd["losses"], "adam_losses": adam["losses"] if adam else None,
                                   # as the contract lowers the plan: the modules checkpointed and how, and
                                   # each data-parallel unit (module path, ZeRO stage, engine)
                                   "recomputed": {p: str(k) for p, k in lowered.recompute_kinds(graph).items()},
                                   "units": [[u.path, u.zero, u.engine.value] for units in lowered.units.values()
                                             for u in units]}
        ref_sgd, ref_adam_losses = from_rank0(lambda: (
            run_reference(spec, lambda p: torch.optim.SGD(p, **SGD)),
            run_reference(spec, lambda p: torch.optim.AdamW(p, **ADAMW))["losses"] if spec.adam else None))
        metrics["loss1_rel"] = abs(sgd["losses"][0] - ref_sgd["losses"][0]) / abs(ref_sgd["losses"][0])
        metrics["grad_rel"], metrics["grad_worst"] = _max_rel(sgd["grads"], ref_sgd["grads"])
        metrics["sgd_loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(sgd["losses"], ref_sgd["losses"]))
        metrics["param_rel"], metrics["param_worst"] = _max_rel(sgd["params"], ref_sgd["params"])
        # None: this case runs no AdamW leg (check_equivalent asserts the bar where it ran)
        metrics["adam_loss_rel"] = (max(abs(a - b) / abs(b) for a, b in zip(adam["losses"], ref_adam_losses))
                                    if adam else None)
        metrics["ref_losses"] = ref_sgd["losses"]
        metrics["local_bytes_frac"] = sgd["local_param_bytes"] / ref_sgd["param_bytes"]
        return metrics

    return case


# The one case per engine or feature that also trains 3 AdamW steps against one process (Spec.adam): the
# claim "AdamW trains the same numbers as one process under each engine" is made once an engine; every
# other equivalence case checks SGD with momentum alone (at 1e-5, which AdamW's 1e-3 bar cannot tighten).
# compile_cases and float8_cases train SGD alone (no AdamW leg). test_adam_cases checks this table.
ADAM_CASES: dict[str, str] = {
    "dp (DDP)": "equivalence_cases:dp",
    "ZeRO-1": "equivalence_cases:zero1",
    "ZeRO-2": "equivalence_cases:zero2",
    "ZeRO-3 (FSDP2)": "equivalence_cases:zero3",
    "tp": "equivalence_cases:tp_gpt",
    "sp": "zoo_cases:nanogpt/sp",
    "pp (1F1B)": "pipeline_cases:pp_1f1b",
    "cp allgather": "context_cases:cp2_gpt",
    "cp ulysses": "context_cases:uly_cp2_gpt",
    "cp ring": "ring_cases:ring_cp2_gpt",
    "ep": "moe_cases:ep2_mixtral",
    "HSDP": "hsdp_cases:gpt_zero3",
    "vocab-parallel loss": "vocab_loss_cases:vp_tp2_gpt",
    "chunked loss": "chunked_loss_cases:chunk_ddp_gpt",
}


# ------------------------------------------------------------------ the cases

GPT_TP = ("tok_emb:tp=vocab", "pos_emb:tp=vocab", "blocks.*:tp=megatron", "lm_head:tp=vocab")
PP1 = ("pp=1", "recompute=none")

SPECS: dict[str, Spec] = {
    "dp": Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=0", "microbatches=1"), 4, adam=True),
    "zero1": Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=1", "microbatches=2"), 4, adam=True),
    "zero2": Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=2", "microbatches=2"), 4, adam=True),
    "zero3": Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4, adam=True),
    "tp_mlp": Spec(mlp_small, PP1 + ("dp=1", "tp=2", "zero=0", "*:tp=megatron"), 4),
    "tp_gpt": Spec(gpt_tiny, PP1 + ("dp=1", "tp=2", "zero=0") + GPT_TP, 4, adam=True),
    "hf_llama_tp": Spec(hf_llama, PP1 + ("dp=1", "tp=2", "zero=0", "model.layers.*:tp=megatron",
                                         "model.embed_tokens:tp=vocab"), 4),
    "dp2_tp2_gpt": Spec(gpt_tiny, PP1 + ("dp=2", "tp=2", "zero=3", "microbatches=2") + GPT_TP, 8),
    "mixed_zero_recompute": Spec(gpt_tiny, (
        "pp=1", "dp=2", "tp=2", "microbatches=2", "tok_emb:zero=0", "pos_emb:zero=1",
        "blocks.0:zero=3", "blocks.1:zero=1", "ln_f:zero=2", "lm_head:zero=3",
        "blocks.*:recompute=on", "ln_f:recompute=on", "tok_emb:recompute=off", "pos_emb:recompute=off",
        "drop:recompute=off", "lm_head:recompute=off", "drop:zero=0") + GPT_TP, 8),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}

# A toy mesh axis, declared through the one mesh type alone (autopar.mesh): at degree 1 it is
# planned, pinned, sent in the plan and made a dimension of the device mesh, and changes no number.
TOY_AXIS = MeshAxis("xp", "nothing: a toy axis", searched=False)


def _with_toy_axis(case: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    def run(rank: int, world_size: int) -> dict[str, Any]:
        with declared(TOY_AXIS):
            return case(rank, world_size)

    return run


CASES["toy_axis_dp_zero3"] = _with_toy_axis(equivalence(
    Spec(gpt_tiny, PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1", "xp=1"), 4)))


def _narrowed(case: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    """``case`` with every block over a lowered ``MAX_CHECK_PARAMS``: capture proves its style on a
    narrower copy of the block's own class (no config) and a shape proof at its real size, and the
    runtime runs the full-size block. ``narrowed`` counts the copies built (rank 0 captures)."""
    def run(rank: int, world_size: int) -> dict[str, Any]:
        from autopar.sharding import check, narrow

        built: list[int] = []
        real_copy, limit = narrow.narrow_copy, check.MAX_CHECK_PARAMS

        def counted(*a: Any, **k: Any) -> Any:
            out = real_copy(*a, **k)
            built.append(out.factor)
            return out
        narrow.narrow_copy, check.MAX_CHECK_PARAMS = counted, 1_000  # type: ignore[assignment]
        try:
            metrics = case(rank, world_size)
        finally:
            narrow.narrow_copy, check.MAX_CHECK_PARAMS = real_copy, limit  # type: ignore[assignment]
        metrics["narrowed"] = from_rank0(lambda: list(built))
        return metrics

    return run


CASES["tp_plain_gpt_narrowed"] = _narrowed(equivalence(Spec(
    plain_gpt_small, PP1 + ("dp=1", "tp=2", "zero=0", "blocks.*:tp=megatron", "tok:tp=vocab", "head:tp=vocab"), 4)))
