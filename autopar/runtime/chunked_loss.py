"""The chunked loss: the output projection and cross-entropy run a chunk of tokens at a time.

A plan whose ``training.loss`` is ``chunked`` (:class:`~autopar.choice.LossKind`, decided by
:func:`autopar.contract.chunked_loss_refusal`) never holds the whole B × S × V logits. The head —
a plain ``nn.Linear`` whose output is the model's prediction (:class:`~autopar.loss_head.LossHead`,
found at capture) — returns its input while a train step or an evaluation runs
(:func:`returning_hidden`), so the model's prediction (``.logits``, or the returned tensor) is the
hidden state; :class:`ChunkedLoss` then takes the hidden state and the head's weight (and bias)
as the head's forward saw them, and computes, chunk by chunk of tokens::

    logits_c = (h_c @ Wᵀ + b) in the head's dtype, cast to fp32
    loss     = Σ_c Σ_{t ∈ c, y_t ≠ -100} (logsumexp(logits_c[t]) − logits_c[t, y_t])  /  #{t : y_t ≠ -100}

which is ``F.cross_entropy(logits, y)`` of the default loss (mean over the targets not ignored).
Backward recomputes each chunk's logits (:class:`_ChunkedCrossEntropy`): softmax − one-hot,
scaled, gives the chunk's gradient of h, and is added into the weight's and bias's gradients in
place, so one chunk's fp32 logits (and its softmax, computed in place) are what the loss adds at its
peak. The extra cost is one more head GEMM forward per chunk in backward.

The head's weight is read as its forward saw it: the module's own parameter, FSDP2's gathered one
(the head sits in the root unit, which FSDP2 does not reshard after forward), or — where tp splits the
head on its vocabulary (``training.loss`` ``vocab_parallel``) — its shard, a DTensor, on which
:func:`autopar.runtime.vocab_loss.vocab_parallel_cross_entropy` runs the same loss without gathering
the vocabulary. ``state_dict`` is unchanged: only the head module's ``forward`` is replaced, on the
instance.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.choice import LossKind
from autopar.contract import loss_chunk_tokens
from autopar.errors import LossError
from autopar.graph import LayerGraph
from autopar.inputs import prediction
from autopar.loss_head import LossHead
from autopar.plan import Plan
from autopar.runtime.loss import default_loss
from autopar.runtime.vocab_loss import vocab_parallel_cross_entropy

IGNORE_INDEX = -100  # F.cross_entropy's default, which the default loss uses

_HIDDEN: ContextVar[bool] = ContextVar("autopar_head_returns_hidden", default=False)


@contextmanager
def returning_hidden() -> Iterator[None]:
    """While it is open, a head :func:`install_head` replaced returns its input (the hidden state)."""
    token = _HIDDEN.set(True)
    try:
        yield
    finally:
        _HIDDEN.reset(token)


class _Seen:
    """The head's weight and bias as its last forward saw them, and the FSDP2 units that hold them."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    units: tuple[nn.Module, ...] = ()


HEAD_MARK = "_autopar_chunked_head"  # on the head module's instance (no state_dict entry): found after lowering


def install_head(model: nn.Module, head: LossHead) -> _Seen:
    """Replace the forward of ``model``'s head (on the instance): inside :func:`returning_hidden`
    it records its weight and bias and returns its input; outside, it is the head it was."""
    module = model.get_submodule(head.module_path)
    if type(module) is not nn.Linear:
        raise LossError(f"the plan runs a chunked loss on {head.module_path!r}, which is a "
                        f"{type(module).__name__}, not the nn.Linear captured: re-plan the model")
    seen = _Seen()
    linear_forward = nn.Linear.forward

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not _HIDDEN.get():
            return linear_forward(self, x)
        seen.weight, seen.bias = self.weight, self.bias
        return x

    # a bound method: a deep copy of the module (a pipeline stage's) rebinds it to the copy, sharing ``seen``
    module.forward = types.MethodType(forward, module)
    setattr(module, HEAD_MARK, True)
    return seen


class ChunkedLoss:
    """The default loss's cross-entropy on the hidden state the head returned, chunk by chunk
    (see the module docstring); ``vocab_parallel``: on the head's vocabulary shard over tp;
    ``chunk_tokens``: None for :func:`autopar.contract.loss_chunk_tokens` of the classes a rank holds."""

    def __init__(self, seen: _Seen, vocab_parallel: bool = False, chunk_tokens: int | None = None):
        self.seen, self.vocab_parallel, self.chunk_tokens = seen, vocab_parallel, chunk_tokens

    def attach(self, parts: list[nn.Module]) -> None:
        """Find, in the lowered ``parts``, the FSDP2 unit holding the head (the innermost ``FSDPModule``
        around it): a ZeRO-3 unit reshards after forward, so the loss gathers it again (:meth:`__call__`)."""
        from torch.distributed.fsdp import FSDPModule

        units = []
        for part in parts:
            named = dict(part.named_modules())
            for path in (p for p, m in named.items() if getattr(m, HEAD_MARK, False)):
                around = [q for q, m in named.items() if isinstance(m, FSDPModule)
                          and (q == "" or path == q or path.startswith(q + "."))]
                if around:
                    units.append(named[max(around, key=len)])
        self.seen.units = tuple(units)

    def __call__(self, output: Any, targets: torch.Tensor | None) -> torch.Tensor:
        for unit in self.seen.units:  # the weight the forward saw, gathered again (FSDP2 reuses its tensor)
            unit.unshard()  # type: ignore[operator]
        hidden = prediction(output)
        weight, bias = self.seen.weight, self.seen.bias
        if hidden is None or weight is None:
            raise LossError("the chunked loss found no hidden state from the head (did the head run?)")
        if targets is None or targets.is_floating_point() or tuple(targets.shape) != tuple(hidden.shape[:-1]):
            shape = None if targets is None else (tuple(targets.shape), str(targets.dtype))
            raise LossError(f"the plan chose the chunked cross-entropy loss, which takes integer targets shaped "
                            f"like the prediction less its last dim {tuple(hidden.shape[:-1])}, got {shape}: "
                            "re-plan with the pin loss=full")
        if self.vocab_parallel:
            local = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
            return vocab_parallel_cross_entropy(hidden, weight, bias, targets,
                                                self.chunk_tokens or loss_chunk_tokens(local))
        if hasattr(weight, "to_local"):
            raise LossError("the plan runs the chunked loss on a whole head, but tp split the head's weight "
                            f"({weight.placements}): re-plan the model")
        chunk = self.chunk_tokens or loss_chunk_tokens(weight.shape[0])
        return chunked_cross_entropy(hidden, weight, bias, targets, chunk)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2), targets.flatten())``
    computed ``chunk_tokens`` tokens at a time, never holding more than one chunk's logits."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.dtype != weight.dtype:  # a bf16 plan's loss is handed the output in fp32: the head ran in bf16
        h = h.to(weight.dtype)
    y = targets.reshape(-1)
    count = (y != IGNORE_INDEX).sum()
    total = _ChunkedCrossEntropy.apply(h, weight, bias, y, chunk_tokens)
    return total / count  # every target ignored: nan, as F.cross_entropy's mean


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Σ over the tokens not ignored of −log softmax(h Wᵀ + b)[y], in chunks; backward recomputes."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                y: torch.Tensor, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            logits = F.linear(h[start:start + chunk], weight, bias).float()
            total += F.cross_entropy(logits, y[start:start + chunk], reduction="sum", ignore_index=IGNORE_INDEX)
            del logits
        ctx.save_for_backward(h, weight, bias, y)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        h, weight, bias, y = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        # accumulated in fp32 over the chunks, whatever the weight's dtype
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for start in range(0, h.shape[0], ctx.chunk):
            h_c, y_c = h[start:start + ctx.chunk], y[start:start + ctx.chunk]
            g = F.linear(h_c, weight, bias).float()  # the chunk's logits again
            g.sub_(torch.logsumexp(g, dim=-1, keepdim=True)).exp_()  # softmax, in place
            kept = y_c != IGNORE_INDEX
            rows = torch.arange(g.shape[0], device=g.device)[kept]
            g[rows, y_c[kept]] -= 1.0
            g.mul_(kept.unsqueeze(1).to(g.dtype) * grad)  # d(sum)/d logits, scaled by the incoming gradient
            if need_h:
                grad_h[start:start + ctx.chunk] = g.to(h.dtype) @ weight
            if need_w:
                grad_w.addmm_(g.t(), h_c.float() if h_c.dtype != torch.float32 else h_c)
            if need_b:
                grad_b += g.sum(0)
            del g
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None




def plan_loss(model: nn.Module, graph: LayerGraph, plan: Plan, loss_fn: Any) -> tuple[Any, bool]:
    """The loss ``plan`` trains with, and whether it is the chunked one: ``loss_fn`` (default
    :func:`~autopar.runtime.loss.default_loss`) under a full loss; under a chunked one (vocabulary-parallel
    or not) the head of ``model`` is replaced (:func:`install_head`) and the loss is :class:`ChunkedLoss`.
    A chunked plan given a loss function is refused: only the default cross-entropy runs chunked."""
    if not plan.training.loss.chunked:
        return loss_fn or default_loss, False
    if loss_fn is not None and loss_fn is not default_loss:  # the default given by name is no loss of the user's
        raise LossError("the plan runs the chunked cross-entropy loss (training.loss 'chunked'), which is the "
                        "default loss's: drop the loss function, or re-plan with the pin loss=full")
    if graph.loss_head is None:
        raise LossError(f"the plan runs the chunked loss but the graph has no head for it ({graph.loss_refusal}): "
                        "re-plan the model")
    split = plan.layers[-1].choice.tp is not None and plan.mesh.tp > 1
    vocab_parallel = plan.training.loss is LossKind.VOCAB_PARALLEL
    if split != vocab_parallel:  # a hand-edited plan: refused before any rank starts
        how = "splits" if split else "does not split"
        raise LossError(f"the plan runs the {plan.training.loss.value} loss but tp {how} the head's layer "
                        f"{plan.layers[-1].name}: re-plan the model")
    return ChunkedLoss(install_head(model, graph.loss_head), vocab_parallel), True


def refuse_labels(inputs: Any) -> None:
    """A chunked plan's model must not compute its own loss: its head returns the hidden state, on which a
    Hugging Face model given ``labels`` would compute a loss over the wrong dim."""
    if isinstance(inputs, dict) and inputs.get("labels") is not None:
        raise LossError("the plan runs the chunked loss, so the model cannot compute its own loss from "
                        "'labels': pass the next-token targets to train_step, or re-plan with the pin loss=full")


def hidden_head(chunked: bool) -> AbstractContextManager[None]:
    """:func:`returning_hidden` for a chunked plan's train step or evaluation; nothing otherwise."""
    return returning_hidden() if chunked else nullcontext()


__all__ = ["ChunkedLoss", "chunked_cross_entropy", "hidden_head", "install_head", "plan_loss", "refuse_labels",
           "returning_hidden"]
