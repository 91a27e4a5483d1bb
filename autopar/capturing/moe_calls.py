"""The call a block makes of its 3-D experts, recorded from one forward, and the proof that ep can split it.

On a copy of the block (random weights where it is on the meta device) and
random hidden states, a forward pre-hook records the experts module's call;
:func:`autopar.experts.calls.classify` names its convention. The recorded call
is then run twice: by the module's own forward, and split into slices of
experts as ep runs it over ranks (:func:`autopar.experts.calls.split_forward`);
outputs and gradients (every float input and every expert weight) must agree
to rounding. A block whose call is none of the conventions, whose experts hold
weights not stacked over the experts, or whose split differs is not offered
ep, with the reason on its facts (:attr:`autopar.experts.MoEFacts.ep_refusal`);
data parallelism, ZeRO and pipelines run it as written either way.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from autopar.capturing.moe_reroute import _close, _materialised, router_width
from autopar.capturing.reasons import reason_of
from autopar.experts.calls import classify, foreign, split_forward
from autopar.experts.description import Call
from autopar.experts.layouts import identify

_TOKENS = (2, 6)  # (batch, sequence) of the random hidden states the proof runs the block on
# The largest block the proof copies and runs (its parameters' bytes): a block planned at full size on the
# meta device (Mixtral 8x7B's holds 5.6 GB of experts) is not materialised on the planning host; its call is
# then its library's (autopar.experts.layouts.LAYOUTS, proved on small configs by the test suite), and a
# layout of no known library that large is refused ep.
PROOF_BYTES = 64 * 2**20


def _record(block: nn.Module, name: str, hidden: int, g: torch.Generator) -> tuple[nn.Module, tuple]:
    twin = _materialised(copy.deepcopy(block))
    seen: list[tuple] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((*args, *kwargs.values()))

    handle = twin.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            twin(torch.randn(*_TOKENS, hidden, generator=g))
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"its block calls the experts module {len(seen)} times in one forward")
    return twin.get_submodule(name), seen[0]


def _grads(experts: nn.Module, run: Any, args: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in args)
    experts.zero_grad(set_to_none=True)
    out = run(leaves)
    (out.double() * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)).sum().backward()
    grads = [a.grad for a in leaves if a.is_floating_point()]
    grads += [p.grad if p.grad is not None else torch.zeros_like(p) for p in experts.parameters()]
    return out.detach(), grads


def prove(block: nn.Module, name: str, num_experts: int, seen: list[Call] | None = None) -> Call:
    """The convention of the block's call of its experts ``name``, proved splittable (raises with the reason
    where it is not: :func:`call_of` turns that into the refusal); ``seen`` gets the convention once it is
    named, proved or not."""
    hidden = router_width(block, name, num_experts)
    if hidden is None:
        raise RuntimeError("no router weight of one row per expert beside the experts")
    experts = block.get_submodule(name)
    if why := foreign(experts, num_experts):
        raise RuntimeError(why)
    size = sum(p.numel() * p.element_size() for p in block.parameters())
    if size > PROOF_BYTES:
        layout = identify(experts)
        if layout is None:
            raise RuntimeError(f"its experts hold a layout of no known library, and its block ({size / 2**20:,.0f} "
                               f"MiB) is larger than the {PROOF_BYTES / 2**20:.0f} MiB capture proves a call on")
        if seen is not None:
            seen.append(layout.call)
        return layout.call
    g = torch.Generator().manual_seed(0)
    experts, args = _record(block, name, hidden, g)
    call, why = classify(args, {}, num_experts)
    if call is None:
        raise RuntimeError(why)
    if seen is not None:
        seen.append(call)
    parts = next(p for p in range(2, num_experts + 1) if num_experts % p == 0)
    own = _grads(experts, lambda a: experts(*a), args)
    split = _grads(experts, lambda a: split_forward(experts, call, num_experts, parts, a), args)
    if not _close(split[0], own[0]):
        raise RuntimeError(f"its call split over {parts} slices of experts gives other outputs than its own forward")
    if not all(_close(a, b) for a, b in zip(split[1], own[1])):
        raise RuntimeError(f"its call split over {parts} slices of experts gives other gradients than its own")
    return call


def call_of(block: nn.Module, name: str, num_experts: int) -> tuple[Call, str]:
    """(the convention, "") or (the convention as far as it was named, why ep cannot split the call), without
    touching the global RNG."""
    seen: list[Call] = []
    why = reason_of(lambda: prove(block, name, num_experts, seen) and "")
    return (seen[0] if seen else Call.NONE), why


__all__ = ["call_of", "prove"]
