"""Cases for :mod:`distributed`: issue 41's done-when matrix, one case per family on 2 ranks (run on demand
by ``benchmarks/outside_matrix.py``, not by the suite: the suite keeps each claim in its own test).

For each family, rank 0 captures the model once and solves, at world 2: ZeRO-3 over dp=2; pp=2 with the
stages pinned at each cut capture offers; tp=2 with the blocks pinned Megatron (refused: Megatron pinned
on every layer that admits it, the refusal kept); ep=2 beside ZeRO-3 over dp=2 on an MoE. A plan the planner refuses
is a cell of its own (``refused: …``). Each plan trains 3 SGD-with-momentum steps on batches as ``verify``
makes them, against one process running :func:`autopar.tools.reference.train_reference` (what ``verify``
runs: the plan's splits for batch-coupled layers, BatchNorm's sums in the ranks' order); the cell is the
worst relative difference of first-step gradients, parameters after 3 steps and losses, or the error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import batch_coupling_cases
import meta_models
import moe_cases
import moe_layouts
import torch
import torch.distributed as dist
import torch.nn as nn
import verify_specs
import zoo
from cut_cases import stage_pins
from equivalence_cases import SGD, _max_rel, from_rank0

import autopar
from autopar.errors import AutoparError
from autopar.graph import LayerGraph
from autopar.plan import Plan
from autopar.runtime import default_loss

VOCAB, SEQ = 128, 16


class MhaBlock(nn.Module):
    """A pre-norm GPT block on PyTorch's own ``nn.MultiheadAttention`` (batch first, a causal bool mask,
    ``need_weights=False``: its fast path's conditions as people meet them)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class MhaLM(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList([MhaBlock(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TorchSeq2Seq(nn.Module):
    """PyTorch's ``nn.TransformerEncoder`` over source ids and ``nn.TransformerDecoder`` over target ids
    (causal ``tgt_mask``, cross-attention to the encoder's memory), batch first, post-norm, as the
    translation tutorial writes it."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.src_tok, self.tgt_tok = nn.Embedding(VOCAB, dim), nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ, dim)
        enc = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        dec = nn.TransformerDecoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, depth, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, depth)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(src.shape[1], device=src.device))
        memory = self.encoder(self.src_tok(src) + pos)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.head(self.decoder(self.tgt_tok(tgt) + pos, memory, tgt_mask=mask, tgt_is_causal=True))


def torch_seq2seq() -> tuple[nn.Module, tuple]:
    return TorchSeq2Seq(), _ids(2)


def _ids(n: int = 1) -> tuple:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(n))


def jamba() -> tuple[nn.Module, tuple]:
    """Hugging Face's Jamba (Mamba mixers, attention every other layer, an MoE in every layer), small."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.JambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                   expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                                   attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                                   mamba_dt_rank=4, use_cache=False, use_mamba_kernels=False,
                                   tie_word_embeddings=False)
    return transformers.JambaForCausalLM(cfg), _ids()


def _seeded(build: Callable[[], tuple]) -> Callable[[], tuple]:
    def run() -> tuple:
        torch.manual_seed(0)
        return build()
    return run


# family -> (builder, blocks pattern, is an MoE, loss or None)
FAMILIES: dict[str, tuple[Callable[[], tuple], str, bool, Callable | None]] = {
    "titan_llama (Meta's reference Llama, torchtitan's nn.Linear)": (
        lambda: meta_models.meta_llama(n_kv_heads=2), "layers.*", False, None),
    "titan_moe": (moe_layouts.titan_moe, "layers.*", True, None),
    "nanogpt": (lambda: zoo.build("nanogpt"), "transformer.h.*", False, None),
    "torch_encoder_lm": (lambda: zoo.build("torch_lm"), "encoder.layers.*", False, None),
    "torch_seq2seq (nn.TransformerDecoder)": (torch_seq2seq, "decoder.layers.*", False, None),
    "torch_mha_lm (nn.MultiheadAttention)": (lambda: (MhaLM(), _ids()), "blocks.*", False, None),
    "hf_clip": (lambda: zoo.build("hf_clip"), "vision_model.encoder.layers.*", False, zoo.clip_matched_pairs),
    "unet (integer timestep)": (verify_specs.unet, "mid", False, None),
    "gpt_oss": (moe_layouts.gpt_oss, "model.layers.*", True, None),
    "llama4": (moe_layouts.llama4, "model.layers.*", True, None),
    "jamba": (jamba, "model.layers.*", True, None),
    "qwen2_moe": (moe_cases.hf_qwen2_moe, "model.layers.*", True, None),
    "capacity_moe (Switch, cf 1 × top-1 < 8)": (batch_coupling_cases.switch_dropping8, "h.*", True, None),
    "resnet_bn": (lambda: zoo.build("resnet_bn"), "layer1.*", False, None),
}
BATCH = 4
PP1 = ("pp=1", "recompute=none", "tp=1")
PLANS = {"zero3": PP1 + ("dp=2", "zero=3", "microbatches=1", "ep=1"),
         "ep2": PP1 + ("dp=2", "zero=3", "microbatches=2", "ep=2")}
PP2 = ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=2", "schedule=1f1b")


def _solve(graph: LayerGraph, pins: tuple[str, ...]) -> str:
    try:
        return autopar.solve(graph, 2, cluster="cpu", dtype="fp32", pins=list(pins), global_batch=BATCH).to_json()
    except AutoparError as exc:
        return "refused: " + " ".join(str(exc).split())


def _plans(build: Callable[[], tuple], blocks: str, moe: bool) -> tuple[dict, dict[str, str], list[str]]:
    """Rank 0: the graph, each cell's plan (JSON) or refusal, and the tp refusal lines the plan notes."""
    torch.manual_seed(0)
    model, inputs = build()
    graph = autopar.capture(model, inputs)
    plans = {"zero3": _solve(graph, PLANS["zero3"])}
    tp = _solve(graph, PP1[:2] + ("dp=1", "tp=2", "zero=0", f"{blocks}:tp=megatron"))
    if tp.startswith("refused: "):  # Megatron on every layer that admits it, the blocks pin's refusal kept
        plans["tp2 (blocks pinned megatron)"] = tp
        able = [layer.name for layer in graph if any(s.name == "megatron" for s in layer.tp_styles)]
        tp = _solve(graph, PP1[:2] + ("dp=1", "tp=2", "zero=0") + tuple(f"{n}:tp=megatron" for n in able))
    plans["tp2"] = tp
    if moe:
        plans["ep2"] = _solve(graph, PLANS["ep2"])
    names = [layer.name for layer in graph]
    for layer in graph.layers[:-1]:
        if layer.can_cut_after:
            plans[f"pp2 after {layer.name}"] = _solve(graph, PP2 + stage_pins(names, layer.name))
    untp = sorted({f"{l.name}: {l.tp_refusal}" for l in graph if getattr(l, "tp_refusal", "")})
    return graph.to_dict(), plans, untp


def _batches(model: nn.Module, inputs: Any) -> list:
    from autopar.tools.batches import probe, synthetic_batch

    probed = probe(model, inputs)
    return [synthetic_batch(model, inputs, BATCH, 1 + k, probed) for k in range(3)]


def _train(build: Callable[[], tuple], plan: Plan, graph: LayerGraph, loss: Callable | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = build()
    batches = _batches(model, inputs)
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph,
                         optimizer=lambda p: torch.optim.SGD(p, **SGD), loss_fn=loss)
    out: dict[str, Any] = {"losses": []}
    for k, (x, y) in enumerate(batches):
        out["losses"].append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
        if k == 0:
            out["grads"] = pm.full_grads()
    out["params"] = pm.state_dict(full=True)
    return out


def _reference(build: Callable[[], tuple], plan: Plan, graph: LayerGraph, loss: Callable | None) -> dict:
    from autopar.tools.reference import train_reference

    torch.manual_seed(0)
    model, inputs = build()
    batches = _batches(model, inputs)
    return train_reference(model, batches, loss or default_loss, torch.optim.SGD(model.parameters(), **SGD),
                           plan, graph)


def _cell(build: Callable[[], tuple], plan: Plan, graph: LayerGraph, loss: Callable | None) -> dict[str, Any]:
    try:
        got = _train(build, plan, graph, loss)
    except Exception as exc:  # noqa: BLE001 - the cell reports it
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    ref = from_rank0(lambda: _reference(build, plan, graph, loss))
    grad, grad_worst = _max_rel(got["grads"], ref["grads"])
    param, param_worst = _max_rel({k: got["params"][k] for k in ref["params"]}, ref["params"])
    lrel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    tp_layers = [f"{lp.name}:{lp.choice.tp}" for lp in plan.layers if lp.choice.tp and plan.mesh.tp > 1]
    return {"rel": max(grad, param, lrel), "worst": grad_worst if grad >= param else param_worst,
            "mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.ep, plan.mesh.tp], "tp_layers": tp_layers,
            "notes": [n for n in plan.notes if "tensor parallel" in n or "batch-coupled" in n or "tp" in n][:4]}


def family(name: str) -> Callable[[int, int], dict[str, Any]]:
    build, blocks, moe, loss = FAMILIES[name]
    build = _seeded(build)

    def case(rank: int, world_size: int) -> dict[str, Any]:
        graph_dict, plans, untp = from_rank0(lambda: _plans(build, blocks, moe))
        graph = LayerGraph.from_dict(graph_dict)
        out: dict[str, Any] = {"tp_refusals": untp}
        for kind, plan in plans.items():
            if plan.startswith("refused: "):
                out[kind] = {"refused": plan.removeprefix("refused: ")}
                continue
            out[kind] = _cell(build, Plan.from_json(plan), graph, loss)
            failed = [None] * world_size
            dist.all_gather_object(failed, "error" in out[kind])
            if any(failed) and not all(failed):  # one rank failed alone: the group is no longer in step
                out[kind].setdefault("error", "another rank failed")
                break
        return out

    return case


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {name: family(name) for name in FAMILIES}
