"""Attention written by hand (nanoGPT's) under cp: kᵀ and v gathered, the rank's rows of the causal mask.

Capture followed each such module's chain (``autopar.capturing.manual_attention``):
``scores = q @ kᵀ`` (S × S), a scale by a number, ``masked_fill(mask, −inf)``,
softmax over the last dim, dropout, ``probs @ v``. Under cp a rank holds S/cp
= T tokens, so the module's own code computes q, kᵀ and v for those T and
slices its mask to T × T (``self.bias[:, :, :T, :T]``) — the causal mask of
a sequence of T tokens, not of the rank's rows of S. :class:`ManualContextAttention`,
a ``TorchFunctionMode`` held over the module's forward, reroutes three ops:

* ``q @ kᵀ``: kᵀ gathered over the cp group along its last dim (autograd: the
  backward reduce-scatters, summing every rank's queries' contributions) and
  put in global order, so the scores are T × S;
* ``masked_fill(scores, mask, −inf)``: ``mask`` must be the top-left causal
  mask of T tokens (else a :class:`LoweringError`: the model is not what was
  proved); it becomes "key position > query position" for the rank's global
  query positions against all S keys;
* ``probs @ v``: v gathered likewise along its sequence dim.

The scale, softmax and dropout run as written, on T × S. So the module holds
T × S = S/cp × S scores per rank: a hand-written softmax really holds its
score matrix, and is priced so (its ops' activations ÷ cp), never as a fused
kernel.

Under Ulysses (``plan.cp_attention`` ``ulysses``: a ``move`` given) the same three ops instead
move heads, by the head all-to-all of ``passes/context_chunks.py`` (:func:`to_heads`,
:func:`to_tokens`, autograd-aware): q [b, h, T, d] and kᵀ [b, h, d, T] go to [b, h/cp, S, d] and
[b, h/cp, d, S] (every token in global order, the rank's heads), so the scores are S × S for h/cp
heads; ``masked_fill``'s mask, proved the local causal one as above, becomes the causal mask over
all S; ``probs @ v`` takes v moved likewise, and its [b, h/cp, S, d] output goes back by the inverse
all-to-all to [b, h, T, d], the rank's tokens in its chunk order. The module holds S × S for h/cp
heads per rank: the same count as T × S for h heads. Beside tensor parallelism the tp rank's h/tp heads
are moved as plain tensors and split again over cp, and the scores are tagged with a head layout of
h/cp heads (:meth:`ManualContextAttention._ulysses_scores`), so the TP rules run the mask, softmax and
dropout on them; the output, moved back, carries v's layout (trained against one device at cp=2 × tp=2,
sp off and on, at cp=2 × pp=2 and at cp=2 × pp=2 × tp=2: ``tests/runtime/test_context_ulysses.py``).

Dropout on the probabilities runs as written under both (as on one device, a draw per element; the
ranks draw other numbers than one device, as any dropout under cp does).

:func:`prove_manual_attention` checks the rewrite before any process group
starts, on a float64 copy of each module with its own buffers (its mask) and
random weights where the model is on the meta device: cp ranks simulated in
one process (the gathers concatenate what each simulated rank made) must give
the module's own forward over the whole sequence and its input and weight
gradients, within 1e-9. A module whose copy does not agree (a mask that is not
causal over S, such as a sliding window cut to T × T, or chains that feed each
other) is refused with what differs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from autopar.capturing.manual_attention import PRODUCTS, SCALES
from autopar.errors import LoweringError
from autopar.passes.context_chunks import positions, to_heads, to_tokens

Gather = Callable[[torch.Tensor, int], torch.Tensor]  # (this rank's tensor, its sequence dim) → all S, in order
Move = Callable[[torch.Tensor, str], torch.Tensor]  # (tensor, HEADS or TOKENS) → moved by the head all-to-all
HEADS, TOKENS = "to heads", "to tokens"  # [b, h, T, d] → [b, h/cp, S, d] (global order), and back
RAW, MASKED, PROBS = "scores", "masked scores", "probabilities"
PROOF_TOLERANCE = 1e-9  # float64: rounding only
SETTLE_PASSES = 6  # simulated Ulysses: passes for the ranks' all-to-alls to settle (two per chain in a row)


class ManualContextAttention(TorchFunctionMode):
    """Hand-written causal attention over the whole sequence from this rank's T queries (module docstring)."""

    def __init__(self, gather: Gather, rows: torch.Tensor, seq_len: int, move: Move | None = None):
        super().__init__()
        self.gather, self.rows, self.seq_len, self.move = gather, rows, seq_len, move
        self.local = rows.numel()
        self.live: dict[int, tuple[torch.Tensor, str]] = {}  # id → (tensor, stage), kept alive for the call

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        hit = self.live.get(id(first)) if isinstance(first, torch.Tensor) else None
        if hit is None:
            if self._is_scores(name, args, kwargs):  # q @ kᵀ: kᵀ over all S keys (Ulysses: q too, h/cp heads)
                if self.move is not None:
                    return self._track(self._ulysses_scores(func, args[0], args[1]), RAW)
                return self._track(self._product(func, args[0], args[1], args[1].dim() - 1), RAW)
            return func(*args, **kwargs)
        out = self._step(func, name, args, kwargs, hit[1])
        return out

    def _product(self, func: Any, a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
        """``func(a, b gathered along dim)``. Beside tensor parallelism (the module inside its layer's TP
        ``ShardMode``, ``passes/tensor_parallel.py``) ``a`` and ``b`` reach here as plain tensors holding the
        tp rank's heads, tagged by the TP rules: the gather (over the cp group alone: the tp ranks of one cp
        position hold other heads of the same tokens) and the product run as plain ops on those shards, exact
        per head, and the output is tagged with ``a``'s head layout, as the TP rules' product would tag it
        (the same as ``passes/context_parallel.py`` does for SDPA). The scale, mask, softmax and dropout
        between the two products run through the TP rules as they do without cp."""
        tp = _tp_heads(a, b)
        if tp is None:
            return func(a, self.gather(b, dim))
        mode, la = tp
        with torch._C.DisableTorchFunction():
            out = func(a, self.gather(b, dim))
        return mode.tag(out, la)

    def _ulysses_scores(self, func: Any, q: torch.Tensor, kt: torch.Tensor) -> torch.Tensor:
        """``q @ kᵀ`` over all S for the rank's heads/cp (Ulysses). Beside tensor parallelism q and kᵀ hold
        the tp rank's heads (as in :meth:`_product`): they move as plain tensors, the tp rank's h/tp heads
        split again over cp, and the S × S scores are tagged with a head layout of h/cp heads (each segment
        ÷ cp), so the TP rules run the mask, softmax and dropout on them as on any head shard."""
        tp = _tp_heads(q, kt)
        if tp is None:
            return func(self._heads(q), self._heads(kt.transpose(-2, -1)).transpose(-2, -1))
        mode, layout = tp
        cp = self.seq_len // self.local
        if any(s % (cp * mode.tp) for i, s in enumerate(layout.segments) if i not in layout.whole) or layout.whole:
            raise LoweringError(f"Ulysses at cp={cp} beside tp={mode.tp} needs cp × tp to divide a hand-written "
                                f"attention's heads, got head segments {layout.segments}")
        with torch._C.DisableTorchFunction():
            out = func(self._heads(q), self._heads(kt.transpose(-2, -1)).transpose(-2, -1))
        return mode.tag(out, dataclasses.replace(layout, segments=tuple(s // cp for s in layout.segments)))

    def _ulysses_output(self, func: Any, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``probs @ v`` for the rank's heads over all S, moved back to all (the tp rank's) heads over its
        tokens; beside tp as plain tensors, tagged with v's head layout (:meth:`_ulysses_scores`)."""
        tp = _tp_heads(probs, v)
        if tp is None:
            return self.move(func(probs, self._heads(v)), TOKENS)
        mode = tp[0]
        with torch._C.DisableTorchFunction():
            out = self.move(func(probs, self._heads(v)), TOKENS)
        return mode.tag(out, mode.layout(v))

    def _is_scores(self, name: str, args: tuple, kwargs: dict) -> bool:
        if name not in PRODUCTS or len(args) != 2 or kwargs:
            return False
        a, b = args
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not isinstance(a, nn.Parameter)
                and not isinstance(b, nn.Parameter) and a.dim() >= 2 and b.dim() >= 2
                and a.shape[-2] == self.local and b.shape[-1] == self.local and a.shape[-1] == b.shape[-2])

    def _track(self, out: torch.Tensor, stage: str) -> torch.Tensor:
        self.live[id(out)] = (out, stage)
        return out

    def _step(self, func: Any, name: str, args: tuple, kwargs: dict, stage: str) -> Any:
        if name in SCALES and stage == RAW and len(args) == 2 and _number(args[1]):
            return self._track(func(*args, **kwargs), RAW)
        if name in ("masked_fill", "masked_fill_") and stage == RAW:
            scores, mask = args[0], args[1] if len(args) > 1 else kwargs.pop("mask")
            rest = args[2:]
            return self._track(func(scores, self._rows_mask(mask, scores), *rest, **kwargs), MASKED)
        if name == "softmax" and stage == MASKED:
            return self._track(func(*args, **kwargs), PROBS)
        if name == "dropout" and stage == PROBS:
            return self._track(func(*args, **kwargs), PROBS)
        if name in PRODUCTS and stage == PROBS and len(args) == 2 and not kwargs:
            v = args[1]
            if self.move is not None:  # the rank's heads over all S, back to all heads over its tokens
                return self._ulysses_output(func, args[0], v)
            return self._product(func, args[0], v, v.dim() - 2)
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):  # not metadata (shape, dtype)
            raise LoweringError(f"under cp a hand-written attention ran {name} on its {stage}, which capture did "
                                "not see there (the model changed since it was captured): capture it again")
        return out

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [b, h, T, d] moved to [b, h/cp, S, d] (Ulysses): 4-D tensors with cp dividing h only (beside
        tp: the tp rank's h/tp heads, as plain tensors)."""
        cp = self.seq_len // self.local
        if x.dim() != 4 or x.shape[1] % cp:
            raise LoweringError(f"Ulysses at cp={cp} needs a hand-written attention's q, k and v [batch, heads, "
                                f"sequence, dim] with heads divisible by {cp}, got {list(x.shape)} (capture "
                                "recorded them otherwise: the model changed since)")
        assert self.move is not None
        return self.move(x, HEADS)

    def _rows_mask(self, mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The rank's rows of the causal mask over all S keys (under Ulysses all S rows), once ``mask`` is
        proved the local causal one."""
        t = self.local
        causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).triu(1)
        if tuple(mask.shape[-2:]) != (t, t) or not torch.equal(mask.bool(), causal.expand_as(mask)):
            raise LoweringError(f"under cp a hand-written attention's mask is not the causal mask of its {t} "
                                "local tokens, the one cp's rewrite replaces by (the rank's rows of) the causal "
                                "mask over all S")
        keys = torch.arange(self.seq_len, device=mask.device)
        queries = keys if self.move is not None else self.rows.to(mask.device)
        rows = keys[None, :] > queries[:, None]  # True: masked (a key after the query)
        return rows.view(*([1] * (scores.dim() - 2)), queries.numel(), self.seq_len)


def _tp_heads(a: torch.Tensor, b: torch.Tensor) -> tuple[Any, Any] | None:
    """Beside tensor parallelism (the module inside its layer's TP ``ShardMode``), the mode and ``a``'s head
    layout, ``a`` and ``b`` each holding the tp rank's heads; None without TP."""
    from autopar.sharding.rules import current_mode

    mode = current_mode()
    layouts = (mode.layout(a), mode.layout(b)) if mode is not None else (None, None)
    if layouts == (None, None):
        return None
    la, lb = layouts
    if la is None or lb is None or la.dim != lb.dim or la.dim >= min(a.dim(), b.dim()) - 2:
        raise LoweringError("cp beside tp needs a hand-written attention's q, k and v each split on their heads "
                            f"(a batch dim before the last two), got layouts {la} and {lb}")
    return mode, la


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.dim() == 0)


def group_gather(group: Any, seq_len: int, cp: int) -> Gather:
    """All-gather over the cp ``group`` with autograd, rows put in global order (rank-major head-tail
    chunks → positions 0 … S − 1)."""
    order = torch.argsort(torch.cat([positions(seq_len, cp, r) for r in range(cp)]))

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        full = all_gather_single_autograd(t.contiguous(), gather_dim=dim, group=group)
        return full.index_select(dim, order.to(t.device))

    return gather


def group_move(group: Any, seq_len: int, cp: int) -> Move:
    """The head all-to-all over the cp ``group`` (``passes/context_chunks.py``'s :func:`to_heads` and
    :func:`to_tokens`), the gathered tokens in global order."""

    order = torch.argsort(torch.cat([positions(seq_len, cp, r) for r in range(cp)]))

    def move(t: torch.Tensor, kind: str) -> torch.Tensor:
        return (to_heads if kind == HEADS else to_tokens)(t, order.to(t.device), group, cp)

    return move


# ---------------------------------------------------------------- the proof


def _proof_copy(module: nn.Module, path: str) -> nn.Module:
    """A float64 CPU copy: the module's own buffers (its mask) and weights, random ones for meta weights."""
    if any(b.is_meta for b in module.buffers()):
        raise LoweringError(f"cp cannot prove the hand-written attention of {path}: its buffers (its mask) are on "
                            "the meta device; build the model on a device, or write it with "
                            "scaled_dot_product_attention(is_causal=True)")
    twin = copy.deepcopy(module)
    if any(p.is_meta for p in twin.parameters()):
        metas = {n for n, p in twin.named_parameters() if p.is_meta}
        twin.to_empty(device="cpu")  # then the real buffers back
        for (_, b), (_, own) in zip(twin.named_buffers(), module.named_buffers()):
            b.data = own.detach().cpu().clone()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in twin.named_parameters():
                if n in metas:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape[-1], 1)))
    return twin.to(device="cpu", dtype=torch.float64).eval()


def _simulate(module: nn.Module, xs: list[torch.Tensor], seq_len: int, cp: int) -> list[torch.Tensor]:
    """Each simulated cp rank's output: a first pass records what every rank gathers, the second
    concatenates those with the rank's own live tensor (so gradients reach every rank's k and v)."""
    rows = [positions(seq_len, cp, r) for r in range(cp)]
    order = torch.argsort(torch.cat(rows))
    local = [[x.index_select(1, rows[r]) for x in xs] for r in range(cp)]
    recorded: list[list[torch.Tensor]] = [[] for _ in range(cp)]
    for r in range(cp):
        def record(t: torch.Tensor, dim: int, r: int = r) -> torch.Tensor:
            recorded[r].append(t)
            return torch.cat([t] * cp, dim)
        with ManualContextAttention(record, rows[r], seq_len):
            module(*local[r])
    outs = []
    for r in range(cp):
        calls = iter(range(len(recorded[r])))

        def gather(t: torch.Tensor, dim: int, r: int = r) -> torch.Tensor:
            i = next(calls, None)
            if i is None or not torch.equal(t, recorded[r][i]):
                raise LoweringError("its chains feed each other (a later chain's k or v depends on an earlier "
                                    "chain's gathered keys)")
            parts = [t if q == r else recorded[q][i] for q in range(cp)]
            return torch.cat(parts, dim).index_select(dim, order)
        with ManualContextAttention(gather, rows[r], seq_len):
            outs.append(module(*local[r]))
    return outs


def _moved(parts: list[torch.Tensor], kind: str, r: int, seq_len: int, cp: int) -> torch.Tensor:
    """What simulated rank ``r`` gets from the head all-to-all, given every rank's tensor ``parts``: its head
    group of every rank's tokens in global order (HEADS), or its tokens of every rank's head group (TOKENS)."""
    if kind == HEADS:
        g = parts[0].shape[1] // cp
        order = torch.argsort(torch.cat([positions(seq_len, cp, q) for q in range(cp)]))
        return torch.cat([p[:, r * g:(r + 1) * g] for p in parts], 2).index_select(2, order)
    return torch.cat([p.index_select(2, positions(seq_len, cp, r)) for p in parts], 1)


def _simulate_ulysses(module: nn.Module, xs: list[torch.Tensor], seq_len: int, cp: int) -> list[torch.Tensor]:
    """Each simulated cp rank's output under Ulysses. A rank's all-to-all takes every rank's tensor of the
    same call; the ranks run one after another, so each pass takes the other ranks' tensors from the pass
    before (the first from stand-ins) and its own live, until a pass moves what the one before did (the
    chain's output move needs the moves before it right: two passes for one chain). Gradients reach every
    rank through the earlier pass's tensors, as in :func:`_simulate`."""
    rows = [positions(seq_len, cp, r) for r in range(cp)]
    local = [[x.index_select(1, rows[r]) for x in xs] for r in range(cp)]
    before: list[list[torch.Tensor]] | None = None
    for _ in range(SETTLE_PASSES):
        now: list[list[torch.Tensor]] = [[] for _ in range(cp)]
        outs = []
        for r in range(cp):
            def move(t: torch.Tensor, kind: str, r: int = r) -> torch.Tensor:
                i = len(now[r])
                now[r].append(t)
                if before is None or i >= len(before[r]):  # stand-ins for the others' tensors
                    return _moved([t] * cp, kind, r, seq_len, cp)
                return _moved([t if q == r else before[q][i] for q in range(cp)], kind, r, seq_len, cp)
            with ManualContextAttention(lambda t, dim: t, rows[r], seq_len, move):
                outs.append(module(*local[r]))
        if before is not None and all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                                      for a, b in zip(now, before)):
            return outs
        before = now
    raise LoweringError("its chains feed each other (the ranks' all-to-alls did not settle)")


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def prove_one(module: nn.Module, path: str, specs: tuple, seq_len: int, cp: int, ulysses: bool = False) -> None:
    """Raise :class:`LoweringError` unless the rewrite of ``module`` (the head all-to-all's with ``ulysses``)
    gives its own forward and gradients (module docstring); ``specs``: its positional inputs' (shape,
    dtype) from capture."""
    why = f"cp{' (Ulysses)' if ulysses else ''} cannot prove the hand-written attention of {path}: "
    if not specs or any(s is None or not torch.empty(0, dtype=getattr(torch, s[1].split(".")[-1])).is_floating_point()
                        for s in specs):
        raise LoweringError(why + "its inputs are not floating-point tensors only (given positionally)")
    twin = _proof_copy(module, path)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(s[0], generator=g, dtype=torch.float64).requires_grad_() for s in specs]
    weights = [p for p in twin.parameters() if p.requires_grad]
    ref = twin(*xs)
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2 or ref.shape[1] != seq_len:
        raise LoweringError(why + "its output is not one (b, S, …) tensor")
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, xs + weights, grad_out, allow_unused=True)
    try:
        outs = (_simulate_ulysses if ulysses else _simulate)(twin, xs, seq_len, cp)
    except LoweringError as exc:
        raise LoweringError(why + str(exc)) from None
    got = torch.empty_like(ref)
    total = ref.new_zeros(())
    for r, y in enumerate(outs):
        index = positions(seq_len, cp, r)
        got[:, index] = y.detach()
        total = total + (y * grad_out.index_select(1, index)).sum()
    grads = torch.autograd.grad(total, xs + weights, allow_unused=True)
    errors = {"output": _rel(got, ref.detach())}
    names = [f"input {i}" for i in range(len(xs))] + [n for n, p in twin.named_parameters() if p.requires_grad]
    errors.update({f"gradient of {n}": _rel(a, b) for n, a, b in zip(names, grads, ref_grads)})
    worst = max(errors, key=errors.get)  # type: ignore[arg-type]
    if errors[worst] > PROOF_TOLERANCE:
        raise LoweringError(why + f"its {worst} differs from the module's own by {errors[worst]:.2e} (relative) "
                            f"at cp={cp}; its mask is not the causal one over the whole sequence, or its "
                            "attention is not the pattern cp reroutes")


def prove_manual_attention(model: nn.Module, graph: Any, cp: int, ulysses: bool = False) -> None:
    """:func:`prove_one` for every hand-written attention module capture found (``graph.cp_manual``)."""
    for path, specs in graph.cp_manual.items():
        prove_one(model.get_submodule(path), path, specs, graph.seq_len, cp, ulysses)


__all__ = ["HEADS", "TOKENS", "ManualContextAttention", "group_gather", "group_move", "prove_manual_attention",
           "prove_one"]
