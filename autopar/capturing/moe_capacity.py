"""A GShard/Switch capacity block's expert region, found as its own code runs, and the proof it can be split.

A fixed-capacity MoE block (GShard, Switch Transformer) holds its experts as
3-D parameters ``[E, …]`` of its own and runs them between two one-hot
einsums: dispatch ``einsum("sec,sm->ecm", dispatch, x)`` builds an ``[E, C,
M]`` tensor (C capacity slots per expert), the experts run as batched
einsums or matmuls over ``e``, and combine ``einsum("sec,ecm->sm", combine,
y)`` brings their outputs back to the tokens. Nothing in that code names a
"region": :class:`ExpertRegion` (a ``TorchFunctionMode`` active during the
block's forward) finds it from the data. The first op that reads an expert
weight beside a tensor whose dim 0 is E *enters* the region: that tensor goes
through ``enter`` (under ep: an all-to-all split on E, giving ``[E/ep, ep·C,
…]``, ``passes/expert_capacity.py``) and the weights through their local
shard. Every op on region tensors must be one that maps each expert's slots
independently — an einsum keeping ``e`` first on every expert operand and
its output, a batched matmul, an elementwise op or activation — else it
raises naming the op. The first op that mixes a region tensor with any other
tensor *leaves* the region: the region tensor goes through ``leave`` (the
reverse all-to-all, back to ``[E, C, …]``) and the op runs as written.

:func:`proof` runs the block's forward through the region on the meta device
with ``enter`` and ``leave`` the identity: everything that can go wrong is
structural (an op outside the list, an einsum not keeping e first, a region
never combined); capture records why it fails on the block's facts
(:attr:`autopar.experts.MoEFacts.reroute_refusal`), so the planner offers ep only
where the region is of that shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from autopar.capturing.reasons import reason_of

_CHECK_TOKENS = (2, 8)  # (batch, sequence) of the proof's hidden states (on the meta device)
# ops that map each expert's slots on their own (dim 0 = e kept, no mixing across e or across slots
# beyond what an einsum over e states): the names torch's function dispatch reports
_BATCHED = frozenset({"einsum", "matmul", "__matmul__", "bmm", "baddbmm"})
_ELEMENTWISE = frozenset({
    "gelu", "relu", "silu", "tanh", "sigmoid", "softplus", "exp", "neg", "square", "pow", "__pow__",
    "mul", "__mul__", "__rmul__", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__",
    "div", "__truediv__", "__rtruediv__", "to", "float", "half", "bfloat16", "type_as", "contiguous", "clone",
})
_READS = frozenset({"dtype", "device", "requires_grad", "is_leaf", "grad_fn", "is_floating_point", "dim", "ndim"})


def _name(func: Any) -> str:
    if getattr(func, "__name__", "") == "__get__":  # a tensor property read
        return f"get:{getattr(getattr(func, '__self__', None), '__name__', '')}"
    return getattr(func, "__name__", str(func))


class ExpertRegion(TorchFunctionMode):
    """The block's forward with its expert region split (module docstring). ``weights`` the block's
    expert parameters; ``local(w)`` a weight's part this rank holds; ``enter``/``leave`` move a tensor
    into and out of the region."""

    def __init__(self, weights: list[torch.Tensor], num_experts: int, local: Callable[[torch.Tensor], torch.Tensor],
                 enter: Callable[[torch.Tensor], torch.Tensor], leave: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.weights, self.e = {id(w) for w in weights}, num_experts
        self.local, self.enter, self.leave = local, enter, leave
        self.inside: dict[int, torch.Tensor] = {}  # region tensors by id (held for the forward: ids stay valid)
        self.entered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a tensor entered once, reused
        self.left: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.held: list[torch.Tensor] = []  # tensors derived from the weights alone (their ids stay valid)

    def _kind(self, t: Any) -> str:
        if not isinstance(t, torch.Tensor):
            return ""
        if id(t) in self.weights:
            return "weight"
        return "region" if id(t) in self.inside else "other"

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        kinds = [self._kind(t) for t in flat]
        if "weight" not in kinds and "region" not in kinds:
            return func(*args, **kwargs)
        if "region" not in kinds and "other" not in kinds:  # a weight's own op (a cast, a read): still a weight
            out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.weights.add(id(t))
                    self.held.append(t)
            return out
        name = _name(func)
        if name.startswith("get:"):
            if name[4:] in _READS or "region" not in kinds:
                return func(*args, **kwargs)  # a weight's shape is its global one, as the block wrote it
            raise RuntimeError(f"the experts' region reads {name[4:]!r} of a tensor split over ep")
        entering = "weight" in kinds and any(k == "other" and t.dim() >= 2 and t.shape[0] == self.e
                                             for t, k in zip(flat, kinds))
        if "other" in kinds and not entering:
            if "weight" in kinds:
                raise RuntimeError(f"{name} reads an expert weight beside a tensor of no expert dim "
                                   f"{self.e} first: ep splits experts only between a dispatch and a combine")
            return func(*tree_map(self._out, args), **tree_map(self._out, kwargs))  # leaving: combine
        if name not in _BATCHED and name not in _ELEMENTWISE:
            raise RuntimeError(f"{name} on the experts' tensors: ep splits an expert region of einsums over e, "
                               "batched matmuls and elementwise ops only")
        dtype = next((t.dtype for t, k in zip(flat, kinds) if k in ("other", "region") and t.is_floating_point()), None)
        args, kwargs = tree_map(lambda t: self._in(t, dtype), (args, kwargs))
        if name == "einsum":
            _check_einsum(args)
        elif name in _BATCHED and any(isinstance(t, torch.Tensor) and t.dim() < 3 for t in tree_flatten(args)[0]):
            raise RuntimeError(f"{name} on a tensor of fewer than 3 dims in the experts' region (dim 0 must be e)")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.inside[id(t)] = t
        return out

    def _in(self, t: Any, dtype: torch.dtype | None) -> Any:
        kind = self._kind(t)
        if kind == "weight":
            w = self.local(t)
            return w.to(dtype) if dtype is not None and w.is_floating_point() and w.dtype != dtype else w
        if kind == "other" and t.dim() >= 2 and t.shape[0] == self.e:
            if id(t) not in self.entered:
                self.entered[id(t)] = (t, self.enter(t))
            return self.entered[id(t)][1]
        return t

    def _out(self, t: Any) -> Any:
        if self._kind(t) != "region":
            return t
        if id(t) not in self.left:
            self.left[id(t)] = (t, self.leave(t))
        return self.left[id(t)][1]

    def check_closed(self, out: Any) -> None:
        if any(self._kind(t) == "region" for t in tree_flatten(out)[0]):
            raise RuntimeError("the block returns the experts' outputs without combining them back to tokens")


def _check_einsum(args: tuple) -> None:
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if not isinstance(equation, str) or "->" not in equation or "..." in equation:
        raise RuntimeError(f"einsum {equation!r} in the experts' region: ep needs an explicit output and no ellipsis")
    ins, out = equation.replace(" ", "").split("->")
    terms = ins.split(",")
    firsts = {t[0] for t in terms if t} | {out[:1]}
    if len(firsts) != 1 or len(terms) != len(operands):
        raise RuntimeError(f"einsum {equation!r} in the experts' region does not keep the expert index first on "
                           "every operand and its output")


def run(block: nn.Module, forward: Callable[..., Any], region: ExpertRegion, args: tuple, kwargs: dict) -> Any:
    """``forward(block, *args, **kwargs)`` with ``region`` active; the output checked combined."""
    with region:
        out = forward(block, *args, **kwargs)
    region.check_closed(out)
    return out


def expert_weights(block: nn.Module, num_experts: int) -> list[nn.Parameter]:
    """The block's own parameters stacked on a leading expert dim (3-D weights and their [E, N] biases)."""
    return [p for p in block.parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts]


# ----------------------------------------------------------------------------- the proof


def prove(block: nn.Module, num_experts: int, hidden: int) -> str:
    """Run the block's forward on the meta device with its expert region split (``enter`` and ``leave``
    the identity): what can fail is structural — an op ep cannot split, an einsum that does not keep e
    first, a region never combined — and is found from shapes alone, so no weight is copied or
    allocated (a 3-D expert weight of a large model is tens of GB)."""
    state = {n: torch.empty_like(t, device="meta") for n, t in [*block.named_parameters(), *block.named_buffers()]}
    weights = [state[n] for n, p in block.named_parameters(recurse=False) if id(p) in
               {id(w) for w in expert_weights(block, num_experts)}]
    dtype = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
    x = torch.empty(*_CHECK_TOKENS, hidden, device="meta", dtype=dtype, requires_grad=True)
    region = ExpertRegion(weights, num_experts, lambda w: w, lambda a: a, lambda a: a)

    def forward(module: nn.Module, t: torch.Tensor) -> Any:
        return torch.func.functional_call(module, state, (t,))

    out = run(block, forward, region, (x,), {})
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not outs or outs[0].shape != x.shape:
        return f"it maps hidden states {tuple(x.shape)} to {[tuple(t.shape) for t in outs]}"
    return ""


def proof(block: nn.Module, num_experts: int, hidden: int) -> str:
    """Why ep cannot split the block's expert region ("" when :func:`prove` passes), without touching the
    global RNG; an exception of the block's code in the region is such a reason."""
    return reason_of(prove, block, num_experts, hidden)


__all__ = ["ExpertRegion", "expert_weights", "proof", "prove", "run"]
