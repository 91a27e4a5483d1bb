"""Mixture-of-experts blocks found by their structure, and captured where their routing is data-dependent.

:func:`find_blocks` walks the model's modules for a router beside experts:

- **experts**: a child (or the block itself) holding a per-expert GEMM chain:
  two or more 3-D parameters of one leading expert dim E ≥ 2 (whatever their
  names: ``autopar.experts.layouts`` names the libraries' layouts; a single 3-D
  weight, such as a Mamba mixer's ``conv1d``, is no chain), or an
  ``nn.ModuleList`` of E ≥ 2 modules of one class with equal parameter shapes;
- **router**: another child with a 2-D weight of E rows (``nn.Linear(H, E)``,
  HF's ``*TopKRouter``), ``gate`` or ``router`` preferred;
- **top-k**: ``top_k`` / ``num_experts_per_tok`` / ``k`` on the block, the
  router, the experts or their ``config``; a block whose top-k cannot be read
  is not taken for an MoE (it is captured and priced as written).

Shared experts are the block's children named ``shared*``. A capacity factor
is read from ``capacity_factor`` where the model has one. How the block calls
an experts module of its own is recorded and proved splittable for ep
(``autopar.capturing.moe_calls``).

Hugging Face's eager expert path (``config._experts_implementation`` eager
or unset) loops over the experts a batch hit, which neither FX nor export
can follow; :func:`static_hf_experts` has capture run HF's own ``grouped_mm``
path instead — the same function of the same weights, with static shapes —
and the facts say so (:attr:`~autopar.experts.Dispatch`). A hand-written
per-expert loop is traced with each block as one leaf
(:func:`leaf_blocks`); on real example inputs the leaf runs as written and
is measured, and on the meta device it runs :func:`stand_in`: the router,
then every expert on its even share of the routed rows — the work and the
saved tensors of a perfectly balanced step, which for dropless routing is
the step's true total.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.capturing import moe_capacity
from autopar.capturing.moe_calls import call_of
from autopar.capturing.moe_reroute import proof
from autopar.errors import CaptureError
from autopar.experts import Call, Dispatch, ExpertLayout, MoEFacts, RouterKind
from autopar.experts.calls import per_expert
from autopar.experts.layouts import (
    HF_EXPERTS_SWITCH,
    ROUTER_BIAS,
    ROUTER_NAMES,
    SHARED_PREFIX,
    TOP_K_ATTRS,
    identify,
    uses_hf_switch,
)

__all__ = ["Block", "Dispatch", "batched_hf_experts", "find_blocks", "stand_in", "static_hf_experts"]


@dataclass(frozen=True)
class Block:
    """One MoE block as found in the model (before capture measures it)."""

    path: str
    experts_path: str
    num_experts: int
    top_k: int
    layout: ExpertLayout
    expert_params: int
    expert_flops_per_token: float
    router_path: str
    router_params: int
    router: RouterKind
    shared_params: int
    shared_flops_per_token: float
    capacity_factor: float | None
    reroute_refusal: str = ""  # why ep cannot reroute its experts (moe_reroute.proof, moe_calls.call_of, …)
    call: Call = Call.NONE
    weights: str = ""
    per_expert: tuple[str, ...] = ()
    shared_paths: tuple[str, ...] = ()
    router_bias: str = ""

    def facts(self, dispatch: Dispatch, routed_activation_bytes_per_sample: float) -> MoEFacts:
        return MoEFacts(self.path, self.experts_path, self.num_experts, self.top_k, self.expert_params,
                        self.expert_flops_per_token, self.router_params, self.router, self.layout, dispatch,
                        self.shared_params, self.shared_flops_per_token, self.capacity_factor,
                        routed_activation_bytes_per_sample, self.reroute_refusal, self.call, self.weights,
                        self.per_expert, self.router_path, self.shared_paths, self.router_bias)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _matrix_flops(module_params: list[torch.Tensor]) -> float:
    """Forward FLOPs per row of weights applied as matrices: one multiply-add per element."""
    return 2.0 * sum(p.numel() for p in module_params if p.dim() >= 2)


def _fused_experts(module: nn.Module) -> tuple[int, int, float] | None:
    """(E, one expert's parameters, its FLOPs per token) of a module holding 3-D expert weights itself."""
    own = list(module.parameters(recurse=False))
    cubes = [p for p in own if p.dim() == 3]
    # a GEMM chain: two or more [E, ·, ·] weights (one 3-D weight, a conv1d's [C, 1, K], is no experts)
    if len(cubes) < 2 or len({p.shape[0] for p in cubes}) != 1 or cubes[0].shape[0] < 2:
        return None
    e = int(cubes[0].shape[0])
    stacked = [p for p in own if p.dim() >= 2 and p.shape[0] == e]  # weights [E, …] and biases [E, N]
    return e, sum(p.numel() for p in stacked) // e, 2.0 * sum(p.numel() for p in cubes) / e


def _module_list_experts(module: nn.Module) -> tuple[int, int, float] | None:
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return None
    first = list(module[0].parameters())
    shapes = [p.shape for p in first]
    if not first or any(type(m) is not type(module[0]) or [p.shape for p in m.parameters()] != shapes
                        for m in module):
        return None
    return len(module), sum(p.numel() for p in first), _matrix_flops(first)


def _read_top_k(*modules: nn.Module) -> int | None:
    for m in modules:
        for holder in (m, getattr(m, "config", None)):
            for attr in TOP_K_ATTRS:
                value = getattr(holder, attr, None) if holder is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _router_kind(router: nn.Module) -> RouterKind:
    names = {n for n, _ in router.named_buffers()} | {n for n, _ in router.named_parameters()}
    if ROUTER_BIAS in names or hasattr(router, "n_group") or hasattr(router, "num_group"):
        return RouterKind.SIGMOID_GROUPED
    if "topkrouter" in type(router).__name__.lower():
        return RouterKind.SOFTMAX_TOPK
    return RouterKind.UNREAD


def _router(module: nn.Module, e: int, skip: str) -> tuple[str, nn.Module] | None:
    found = [(name, child) for name, child in module.named_children()
             if name != skip and any(p.dim() == 2 and p.shape[0] == e for p in child.parameters())]
    found.sort(key=lambda nc: (not any(r in nc[0].lower() for r in ROUTER_NAMES),
                               sum(p.numel() for p in nc[1].parameters())))
    return found[0] if found else None


def _block(path: str, module: nn.Module) -> Block | None:
    experts: tuple[str, nn.Module, ExpertLayout, tuple[int, int, float]] | None = None
    if (own := _fused_experts(module)) is not None:
        experts = ("", module, ExpertLayout.FUSED, own)
    for name, child in module.named_children():
        if experts is not None:
            break
        if (fused := _fused_experts(child)) is not None:
            experts = (name, child, ExpertLayout.FUSED, fused)
        elif (listed := _module_list_experts(child)) is not None:
            experts = (name, child, ExpertLayout.MODULE_LIST, listed)
    if experts is None:
        return None
    name, child, layout, (e, expert_params, expert_flops) = experts
    router = _router(module, e, name)
    if router is None:
        return None
    top_k = _read_top_k(module, router[1], child)
    if top_k is None or top_k > e:
        return None
    shared_names = [n for n, _ in module.named_children() if n.lower().startswith(SHARED_PREFIX)]
    shared = [p for n in shared_names for p in module.get_submodule(n).parameters()]
    cf = getattr(module, "capacity_factor", getattr(router[1], "capacity_factor", None))
    cf = float(cf) if isinstance(cf, (int, float)) and not isinstance(cf, bool) else None
    # a module list is run by the block's own loop: ep reroutes it where that is proved exact; a capacity
    # block's own 3-D experts: ep splits the region between its dispatch and combine where that is proved
    why = proof(module, name, e) if layout is ExpertLayout.MODULE_LIST else ""
    if layout is ExpertLayout.FUSED and not name and cf is not None:
        why = moe_capacity.proof(module, e, int(router[1].weight.shape[1])) if hasattr(router[1], "weight") \
            else "its router holds no weight to read the hidden size from"
    call, weights, stacked = Call.NONE, "", ()
    if layout is ExpertLayout.FUSED and name:  # an experts module of its own: its call recorded and proved
        call, why = call_of(module, name, e)
        found = identify(child, str(call))
        weights, stacked = (found.name if found else ""), per_expert(child, e)
    bias = ROUTER_BIAS if ROUTER_BIAS in {n for n, _ in router[1].named_buffers()} else ""
    return Block(path, _join(path, name) if name else path, e, top_k, layout, expert_params, expert_flops,
                 _join(path, router[0]), sum(p.numel() for p in router[1].parameters()), _router_kind(router[1]),
                 sum(p.numel() for p in shared), _matrix_flops(shared), cf, why, call, weights, stacked,
                 tuple(_join(path, n) for n in shared_names), bias)


def find_blocks(model: nn.Module) -> list[Block]:
    """Every MoE block of ``model``, outermost first (a block inside another's experts is not one)."""
    blocks: list[Block] = []
    for path, module in model.named_modules():
        if any(path == b.experts_path or path.startswith(b.experts_path + ".") for b in blocks if b.experts_path):
            continue
        if (block := _block(path, module)) is not None:
            blocks.append(block)
    return blocks


# ----------------------------------------------------------------------------- HF's eager experts


def _hf_eager_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Hugging Face experts modules (``@use_experts_implementation``) set to the eager loop or unset."""
    return [(p, m) for p, m in model.named_modules()
            if uses_hf_switch(m) and getattr(m.config, HF_EXPERTS_SWITCH, None) in (None, "eager")]


@contextlib.contextmanager
def static_hf_experts(model: nn.Module) -> Iterator[set[str]]:
    """Run HF's eager experts through HF's own ``grouped_mm`` path while capturing (module docstring);
    yields the experts' paths so swapped."""
    swapped = _hf_eager_experts(model)
    configs = {id(m.config): (m.config, getattr(m.config, HF_EXPERTS_SWITCH)) for _, m in swapped}
    try:
        for config, _ in configs.values():
            setattr(config, HF_EXPERTS_SWITCH, "grouped_mm")
        yield {p for p, _ in swapped}
    finally:
        for config, before in configs.values():
            setattr(config, HF_EXPERTS_SWITCH, before)


@contextlib.contextmanager
def batched_hf_experts(model: nn.Module) -> Iterator[None]:
    """Hugging Face experts run through HF's own ``batched_mm`` path (every routed row's expert weights
    gathered, one ``bmm``) instead of ``grouped_mm`` while the cp probe runs the forward on fake tensors
    (``autopar.capturing.context``): ``aten::_grouped_mm``'s meta kernel takes bf16 inputs only, so an fp32
    model's probe failed and cp was refused on it. The same per-token function of the same weights,
    static shapes; only the probe sees it (shapes and calls, no numbers)."""
    grouped = [m for _, m in model.named_modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "config")
               and getattr(m.config, HF_EXPERTS_SWITCH, None) == "grouped_mm"]
    configs = {id(m.config): m.config for m in grouped}
    try:
        for config in configs.values():
            setattr(config, HF_EXPERTS_SWITCH, "batched_mm")
        yield
    finally:
        for config in configs.values():
            setattr(config, HF_EXPERTS_SWITCH, "grouped_mm")


# ----------------------------------------------------------------------------- hand-written loops


def _grouped_stand_in(experts: nn.Module, block: Block, routed: torch.Tensor, shares: list[int]) -> torch.Tensor:
    """3-D experts called as torchtitan calls them (rows sorted by expert, the rows per expert), with the
    balanced counts as a real CPU tensor: a loop that takes the counts to Python (``.tolist()``) runs on
    meta rows so. Any other call is the block's own code, which no tracer could follow: capture then
    reports the model's own failure (trace.capture)."""
    try:
        out = experts(routed, torch.tensor(shares, dtype=torch.int64))
    except Exception as exc:  # noqa: BLE001 - not the grouped call
        raise CaptureError(f"{block.experts_path}: its 3-D experts are run by routing code no tracer could "
                           "follow, and called with (rows sorted by expert, rows per expert) on the meta device "
                           f"they fail: {type(exc).__name__}") from exc
    if not isinstance(out, torch.Tensor) or out.shape != routed.shape:
        raise CaptureError(f"{block.experts_path}: called with (rows sorted by expert, rows per expert) its "
                           "3-D experts return no tensor shaped like their rows")
    return out


def stand_in(module: nn.Module, block: Block, hidden: torch.Tensor) -> torch.Tensor:
    """The block's work on the meta device for a balanced step (module docstring): the router on every
    token, each expert on its share of the tokens × top-k routed rows, the shared experts on every
    token; returns a tensor shaped like ``hidden`` (an MoE block maps hidden states to hidden states)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens = flat.shape[0]
    router = module.get_submodule(block.router_path[len(block.path) + 1:] if block.path else block.router_path)
    try:
        scores = router(flat)
    except (NotImplementedError, RuntimeError):  # a router counting its tokens (torchtitan's bincount): no meta
        scores = next(m for m in router.modules() if isinstance(m, nn.Linear))(flat)  # kernel; its projection's
    scores = scores[0] if isinstance(scores, tuple) else scores
    weights = torch.softmax(scores.float(), dim=-1).to(flat.dtype)
    rows = tokens * block.top_k
    shares = [rows // block.num_experts + (1 if e < rows % block.num_experts else 0)
              for e in range(block.num_experts)]
    routed = flat.repeat_interleave(block.top_k, dim=0)
    experts = module.get_submodule(block.experts_path[len(block.path) + 1:] if block.path else block.experts_path)
    if block.layout is not ExpertLayout.MODULE_LIST:
        rows = _grouped_stand_in(experts, block, routed, shares)
    else:
        outs, start = [], 0
        for e, share in enumerate(shares):
            if share:
                outs.append(experts[e](routed[start:start + share]))
            start += share
        rows = torch.cat(outs)
    mixed = rows * weights.repeat_interleave(block.top_k, dim=0)[:, :1]
    out = mixed.reshape(tokens, block.top_k, -1).sum(dim=1)
    for name, child in module.named_children():
        if name.lower().startswith(SHARED_PREFIX):
            shared = child(flat)
            if shared.shape == out.shape:
                out = out + shared
    return out.reshape(hidden.shape)

