"""DeepSeek-V3's auxiliary-loss-free load balancing: each router's expert bias moved by the step's token counts.

A DeepSeek-V3 router (Hugging Face 5.x ``DeepseekV3TopkRouter``; GLM-4-MoE's
and others' alike) holds a per-expert bias, a buffer
(its name in ``autopar.experts.layouts``), that is added to the scores only to choose each
token's top-k experts (not to weight them). Hugging Face's classes never
move it in training; DeepSeek-V3 (arXiv 2412.19437, §2.1.2) does, after each
step: ``b_e += γ · sign(mean load − load_e)``, where ``load_e`` is the number
of tokens the step routed to expert ``e``. ``compile(..., moe_bias_update=γ)``
turns that on (:class:`BiasBalancer`).

**Counting.** A forward pre-hook on each such block's experts module reads
the ``top_k_index`` [T, k] it is called with (``experts(hidden, top_k_index,
top_k_weights)``: the block's own routing decision, taken before expert
parallelism moves any row) and adds its per-expert counts to an int64
accumulator, over every microbatch of the step. It counts only inside
``train_step`` (not ``evaluate``), and not while a backward replays a
checkpointed forward (activation recompute would count a microbatch twice).

**Whose tokens.** The load is the whole step's: the counts are summed over
every rank that routes different tokens — the data-parallel ranks (ep borrows
its ranks from dp, so the ep ranks are among them) and the cp ranks (each
routes its own chunk of the sequence), i.e. the dp × cp group the ZeRO pass
wraps over (``passes.context_parallel.data_mesh``) — and not over tp, whose
ranks route the same tokens. One all-reduce per step (every router's counts
in one int64 tensor, so the sum is exact), then every rank applies the same
update to its copy of the bias under ``torch.no_grad()``: replicas stay
equal, and one device's run (its own counts, no all-reduce) moves the bias
by the same ±γ. torchtitan does the same (its ``load_balance_coeff``
all-reduces ``tokens_per_expert`` over dp × cp); it also subtracts the
update's mean, which the paper's rule does not, and neither does this.

Not run yet, refused by :mod:`autopar.admission` before any collective:
pipelines (a stage's routers and the schedule's shape inference are not
proved), sequence parallelism on an MoE layer (the router would see a tp
rank's share of the sequence), ``torch.compile`` of the blocks (the hook runs
inside compiled code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import LoweringError
from autopar.experts.layouts import ROUTER_BIAS
from autopar.plan import Plan

BIAS = ROUTER_BIAS  # Hugging Face's name for DeepSeek-V3's per-expert routing bias (autopar.experts.layouts)


@dataclass
class BiasedRouter:
    """One router with an expert bias, the experts module whose calls it counts, the experts' number."""

    path: str
    router: nn.Module
    experts: nn.Module
    num_experts: int

    @property
    def bias(self) -> torch.Tensor:
        """Read at each use: a meta-device model's buffers are replaced when it is materialised."""
        return getattr(self.router, BIAS)


def biased_routers(model: nn.Module) -> list[BiasedRouter]:
    """Every MoE block's router holding a balance bias (``capturing.moe.find_blocks``);
    raises :class:`LoweringError` when such a block's experts are not a module called with the top-k
    indices."""
    from autopar.capturing.moe import find_blocks
    from autopar.experts import Call

    found = []
    for block in find_blocks(model):
        router = model.get_submodule(block.router_path)
        if not block.router_bias or not isinstance(getattr(router, block.router_bias, None), torch.Tensor):
            continue
        if block.call is not Call.INDEXED:
            raise LoweringError(f"moe_bias_update: {block.router_path} has an {BIAS}, but its experts are "
                                f"a {block.layout} not called with the top-k indices ({block.call}), so its "
                                "token counts cannot be read")
        found.append(BiasedRouter(block.router_path, router, model.get_submodule(block.experts_path),
                                  block.num_experts))
    return found


def _in_backward() -> bool:
    """True while autograd runs a backward (a checkpointed forward being replayed)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class BiasBalancer:
    """Counts each biased router's tokens per expert over a step and moves its bias after the step
    (module docstring). ``group``: the dp × cp process group (None on one rank)."""

    routers: list[BiasedRouter]
    gamma: float
    group: Any = None
    counting: bool = False
    counts: list[torch.Tensor] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for i, r in enumerate(self.routers):
            self._handles.append(r.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        self.counts = [torch.zeros(r.num_experts, dtype=torch.int64) for r in self.routers]

    def _hook(self, i: int) -> Any:
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.counting or _in_backward():
                return
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if not isinstance(index, torch.Tensor) or index.is_meta:
                return
            n = self.routers[i].num_experts
            if self.counts[i].device != index.device:
                self.counts[i] = self.counts[i].to(index.device)
            self.counts[i] += torch.bincount(index.reshape(-1).long(), minlength=n)[:n]
        return count

    def update(self) -> None:
        """After the optimizer step: the step's counts summed over ``group``, each bias moved by
        γ · sign(mean − count), the counts cleared (a collective when ``group`` is set)."""
        if not self.routers:
            return
        total = torch.cat([c.to(self.counts[0].device) for c in self.counts])
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        with torch.no_grad():
            for r, load in zip(self.routers, total.split([r.num_experts for r in self.routers])):
                load = load.double()
                bias = r.bias
                local = bias.to_local() if hasattr(bias, "to_local") else bias
                step = self.gamma * torch.sign(load.mean() - load)
                local.add_(step.to(device=local.device, dtype=local.dtype))
        for c in self.counts:
            c.zero_()

    def loads(self) -> dict[str, torch.Tensor]:
        """This rank's counts so far this step, by router path (before :meth:`update` sums them)."""
        return {r.path: c.clone() for r, c in zip(self.routers, self.counts)}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def bias_group(mesh: Any, plan: Plan) -> Any:
    """The process group whose ranks route different tokens: dp × cp (ep folded into dp; not tp);
    None on one rank or where dp × cp is 1."""
    if mesh is None or plan.mesh.dp * plan.mesh.cp <= 1:
        return None
    from autopar.passes.context_parallel import data_mesh

    return data_mesh(mesh, plan.mesh.cp).get_group()


__all__ = ["BIAS", "BiasBalancer", "BiasedRouter", "biased_routers", "bias_group"]
