"""How a block calls its 3-D experts (:class:`~autopar.experts.description.Call`), run whole or split by expert.

Expert parallelism does not rewrite an experts module's arithmetic: it runs the
module's **own forward** on this rank's slice of its ``[E, …]`` weights
(:func:`run_local`), on the rows routed to those experts, so any weight layout
(fused or apart, biased, transposed, interleaved, clamped, grouped GEMM or a
loop) lowers alike. What differs between libraries is only how the block
calls its experts, and for each convention the rows split by expert:

- ``INDEXED`` (Hugging Face 5.x, gpt-oss): ``experts(hidden [T, H],
  top_k_index [T, k], top_k_weights [T, k])``. The T·k routed rows are sorted by
  expert (:func:`indexed`); each expert's rows run through the module's own
  forward with local indices and weight 1 (a row is its own token), and are
  weighted by the router and summed per token as the module would.
- ``GROUPED`` (torchtitan's ``GroupedExperts``): ``experts(rows sorted by expert
  [R, H], rows per expert [E])``: the rows are already grouped; a slice of
  experts takes its rows and its counts.
- ``BLOCKED`` (Llama 4): ``experts(rows [E·T, H])``, expert ``e`` on rows
  ``[e·T, (e+1)·T)`` (every expert on every token, the router's scores already
  applied): a slice of experts takes its blocks.

:func:`split_forward` runs a call split into ``parts`` slices of experts in one
process, the way ep runs it across ranks (``passes/expert_parallel.py`` puts an
all-to-all where this concatenates): capture proves it equal to the module's
own forward, outputs and gradients, before ep is offered
(``autopar.capturing.moe_calls``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from autopar.experts.description import Call

RunSorted = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows sorted by expert, counts [E]) → outputs


def per_expert(experts: nn.Module, num_experts: int) -> tuple[str, ...]:
    """The experts module's own parameters stacked over its experts: ``[E, …]``, two or more dims."""
    return tuple(n for n, p in experts.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts)


def foreign(experts: nn.Module, num_experts: int) -> str:
    """Why the experts module holds weights ep cannot split by expert ("" when it holds none)."""
    own = set(per_expert(experts, num_experts))
    other = [n for n, _ in experts.named_parameters() if n not in own]
    return f"it holds parameters not stacked over its {num_experts} experts: {other[:3]}" if other else ""


def classify(args: tuple, kwargs: dict, num_experts: int) -> tuple[Call | None, str]:
    """The convention of one recorded call of an experts module (module docstring), or why it is none."""
    tensors = [*args, *kwargs.values()]
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None, f"called with {shapes}"
    floats = [t.is_floating_point() for t in tensors]
    if (len(tensors) == 3 and floats == [True, False, True] and tensors[0].dim() == 2
            and tensors[1].shape == tensors[2].shape and tensors[1].dim() == 2
            and tensors[1].shape[0] == tensors[0].shape[0]):
        return Call.INDEXED, ""
    if (len(tensors) == 2 and floats[0] and tensors[0].dim() == 2 and tuple(tensors[1].shape) == (num_experts,)):
        return Call.GROUPED, ""
    if len(tensors) == 1 and floats[0] and tensors[0].dim() == 2 and tensors[0].shape[0] % num_experts == 0:
        return Call.BLOCKED, ""
    return None, f"called with tensors {shapes}, none of the calls ep reroutes ({', '.join(map(str, Call))})"


@contextlib.contextmanager
def on_local(experts: nn.Module, weights: dict[str, torch.Tensor], count: int) -> Iterator[None]:
    """``experts`` holding ``weights`` (a slice of ``count`` experts) for one call of its own forward, its
    ``num_experts`` (where it keeps one) set to match."""
    before = experts.__dict__.get("num_experts")
    try:
        if isinstance(before, int):
            experts.__dict__["num_experts"] = count
        with _reparametrize_module(experts, weights):
            yield
    finally:
        if isinstance(before, int):
            experts.__dict__["num_experts"] = before


def run_local(experts: nn.Module, forward: Callable[..., Any], call: Call, weights: dict[str, torch.Tensor],
              rows: torch.Tensor, counts: list[int], counts_like: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` grouped by local expert (``counts[j]`` rows for expert ``j`` of ``weights``' slice) through
    the module's own ``forward`` on those weights: each row's expert output, in the rows' order."""
    local = len(counts)
    with on_local(experts, weights, local):
        if call is Call.INDEXED:
            ids = torch.repeat_interleave(torch.arange(local, device=rows.device),
                                          torch.tensor(counts, device=rows.device))[:, None]
            return forward(experts, rows, ids, torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device))
        if call is Call.GROUPED:
            like = counts_like if counts_like is not None else torch.empty(0, dtype=torch.int64)
            return forward(experts, rows, torch.tensor(counts, dtype=like.dtype, device=rows.device))
        if call is Call.BLOCKED:
            return forward(experts, rows)
    raise ValueError(f"no local run for experts called as {call}")


def indexed(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
            run_sorted: RunSorted) -> torch.Tensor:
    """An ``INDEXED`` call: the routed rows sorted by expert through ``run_sorted``, weighted by the router and
    summed per token (``index_add``), as the module's own forward combines them."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows sorted by expert: by destination rank, then expert
    token = order // k
    # rows per expert, by scatter-add rather than bincount: a static shape, so a compiled block traces it
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    back = run_sorted(hidden[token], counts)
    weighted = back * top_k_weights.reshape(-1)[order, None]
    final = torch.zeros_like(hidden)
    return final.index_add(0, token, weighted.to(final.dtype))


def slices(weights: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``weights`` [E, …] cut into ``parts`` slices of E/parts experts (views: gradients reach the whole)."""
    return [{n: w.chunk(parts, dim=0)[i] for n, w in weights.items()} for i in range(parts)]


def split_forward(experts: nn.Module, call: Call, num_experts: int, parts: int, args: tuple) -> torch.Tensor:
    """The call ``experts(*args)`` with its experts in ``parts`` slices, each run by :func:`run_local` on its
    rows, as ep runs it over ``parts`` ranks (module docstring)."""
    forward = type(experts).forward
    pieces = slices({n: getattr(experts, n) for n in per_expert(experts, num_experts)}, parts)
    per = num_experts // parts

    def run_sorted(rows: torch.Tensor, counts: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        by_part = counts.long().view(parts, per)
        chunks = rows.split(by_part.sum(1).tolist())
        return torch.cat([run_local(experts, forward, call, pieces[i], chunk, by_part[i].tolist(), like)
                          for i, chunk in enumerate(chunks)])

    if call is Call.INDEXED:
        return indexed(*args, num_experts, run_sorted)
    if call is Call.GROUPED:
        return run_sorted(args[0], args[1], args[1])
    rows = args[0]
    t = rows.shape[0] // num_experts
    blocks = rows.view(parts, per * t, rows.shape[-1])
    return torch.cat([run_local(experts, forward, call, pieces[i], blocks[i], [t] * per) for i in range(parts)])


__all__ = ["classify", "foreign", "indexed", "on_local", "per_expert", "run_local", "slices", "split_forward"]
