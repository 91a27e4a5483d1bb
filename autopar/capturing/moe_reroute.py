"""Rerouting a hand-written MoE block's own expert loop, and the proof that it is exact.

A block whose experts are an ``nn.ModuleList`` called from its own Python loop
(Mixtral's as transformers 4.x wrote it) routes tokens in code no tracer
follows. :func:`rerouted` runs that code as written, twice, with the experts
swapped for stand-ins (:class:`_Tape`): the first pass records the rows each
expert is called on (the stand-ins return zeros of the expert's output width),
a caller-supplied function computes every expert's output on its rows (in
place, or across ranks: ``passes/expert_list.py``), and the second pass, from
the same RNG state, returns those outputs to the block's own code, which
weights and combines them. The router's indices and weights are the model's
own.

:func:`prove` checks, on a copy of the block with small probe experts of its
own and random hidden states, that the rerouted forward (outputs computed in
place) gives the block's own outputs and gradients (input and every
parameter), and, on one real expert, that an expert maps rows to rows
independently of the other rows it is called with and runs on no rows.
Capture records the result on the block's facts (:attr:`autopar.experts.MoEFacts.
reroute_refusal`), so the planner offers ep only where the lowering runs; the
lowering proves it again on the model it is given.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopar.capturing.reasons import reason_of

_CHECK_TOKENS = (2, 5)  # (batch, sequence) of the random hidden states the proof runs on
_CHECK_RTOL = 1e-6  # same ops on the same rows: anything beyond rounding is a different function


class _Stub(nn.Module):
    def __init__(self, tape: _Tape, e: int):
        super().__init__()
        self.__dict__["_tape"], self.e = tape, e

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._tape.call(self.e, args, kwargs)


class _Tape:
    """The stand-ins of one block's experts: record the rows each is called on, then replay outputs."""

    def __init__(self, num_experts: int, out_features: int):
        self.out_features = out_features
        self.stubs = nn.ModuleList(_Stub(self, e) for e in range(num_experts))
        self.rows: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] | None = None

    def call(self, e: int, args: tuple, kwargs: dict) -> torch.Tensor:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
            raise RuntimeError(f"expert {e} called with {len(args)} arguments and {sorted(kwargs)}: ep reroutes "
                               "calls on one [rows, hidden] tensor only")
        x = args[0]
        if self.outputs is None:
            if e in self.rows:
                raise RuntimeError(f"expert {e} called twice in one forward of its block")
            self.rows[e] = x
            return x.new_zeros(x.shape[0], self.out_features)
        want = self.rows.get(e)
        if want is None or want.shape[0] != x.shape[0]:
            raise RuntimeError(f"expert {e}: the block routed {x.shape[0]} rows to it on its second pass, "
                               f"{0 if want is None else want.shape[0]} on its first (its routing is not "
                               "reproducible)")
        return self.outputs.pop(e)


def _rng_state() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_rng_state(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def rerouted(block: nn.Module, name: str, num_experts: int, out_features: int,
             run: Callable[[list[torch.Tensor]], list[torch.Tensor]], args: tuple, kwargs: dict) -> Any:
    """The block's own forward on ``args``, its experts' calls answered by ``run(rows per expert)``
    (record, run, replay: the module docstring)."""
    forward = type(block).forward
    tape = _Tape(num_experts, out_features)
    experts = block._modules[name]
    start = _rng_state()
    block._modules[name] = tape.stubs
    try:
        forward(block, *args, **kwargs)
        rows = [tape.rows.get(e) for e in range(num_experts)]
        block._modules[name] = experts
        outs = run(rows)
        tape.outputs = {e: out for e, out in enumerate(outs) if rows[e] is not None}
        _set_rng_state(start)
        block._modules[name] = tape.stubs
        result = forward(block, *args, **kwargs)
    finally:
        block._modules[name] = experts
    if tape.outputs:
        raise RuntimeError(f"experts {sorted(tape.outputs)} were called on the block's first pass, not its second")
    return result


def run_in_place(experts: nn.ModuleList, rows: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """ep = 1's semantics: each expert on its own rows, here (the proof's reference)."""
    return [experts[e](x) if x is not None else None for e, x in enumerate(rows)]


# ----------------------------------------------------------------------------- the proof


def router_width(block: nn.Module, name: str, num_experts: int) -> int | None:
    for child_name, child in block.named_children():
        if child_name != name:
            for p in child.parameters():
                if p.dim() == 2 and p.shape[0] == num_experts:
                    return int(p.shape[1])
    return None


def _materialised(module: nn.Module) -> nn.Module:
    """``module`` itself, or a copy with random weights where it is on the meta device."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return module
    twin = copy.deepcopy(module).to_empty(device="cpu")
    with torch.no_grad():
        for t in [*twin.parameters(), *twin.buffers()]:
            if t.is_floating_point():
                t.normal_(0.0, 0.2)
    return twin


class _Probe(nn.Module):
    """A small expert of its own for the proof, one per slot (the block's code is what is proved, not
    its experts': those are checked row by row on their own)."""

    def __init__(self, hidden: int, width: int, g: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, width, generator=g) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


def _outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    raise TypeError(f"returns {type(out).__name__}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().double(), b.detach().double()
    return a.shape == b.shape and float((a - b).norm()) <= _CHECK_RTOL * max(float(b.norm()), 1e-30)


def _compare(block: nn.Module, forward: Callable[[torch.Tensor], Any], x: torch.Tensor) -> tuple[list, list]:
    x = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    outs = _outputs(forward(x))
    loss = sum((o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape)).sum()
               for o in outs if o.is_floating_point())
    loss.backward()
    grads = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in block.parameters()]
    return outs, grads


def _rowwise(expert: nn.Module, x: torch.Tensor) -> str:
    try:
        whole = expert(x)
    except Exception as exc:
        return f"an expert cannot be called on one [rows, hidden] tensor ({type(exc).__name__}: {exc})"
    if not isinstance(whole, torch.Tensor) or whole.dim() != 2 or whole.shape[0] != x.shape[0]:
        return f"an expert maps [rows, {x.shape[1]}] to {getattr(whole, 'shape', type(whole).__name__)}"
    halves = torch.cat([expert(x[:2]), expert(x[2:])])
    if not _close(halves, whole):
        return "an expert's output on some rows depends on the other rows it is called with"
    if expert(x[:0]).shape[0] != 0:
        return "an expert called on no rows returns rows"
    return ""


def out_width(expert: nn.Module, hidden: int) -> int:
    """The expert's output features (run on no rows: on the meta device too)."""
    p = next(expert.parameters())
    with torch.no_grad():
        return int(expert(torch.zeros(0, hidden, dtype=p.dtype, device=p.device)).shape[-1])


def prove(block: nn.Module, name: str, e: int) -> str:
    hidden = router_width(block, name, e)
    if hidden is None:
        return "no router weight of one row per expert beside the experts"
    g = torch.Generator().manual_seed(0)
    experts = block._modules[name]
    if why := _rowwise(_materialised(experts[0]), torch.randn(6, hidden, generator=g)):
        return why
    width = out_width(experts[0], hidden)
    block._modules[name] = nn.ModuleList()
    try:
        twin = _materialised(copy.deepcopy(block))
    finally:
        block._modules[name] = experts
    probes = nn.ModuleList(_Probe(hidden, width, g) for _ in range(e))
    twin._modules[name] = probes
    x = torch.randn(*_CHECK_TOKENS, hidden, generator=g)
    start = _rng_state()
    own = _compare(twin, lambda t: type(twin).forward(twin, t), x)
    _set_rng_state(start)
    ours = _compare(twin, lambda t: rerouted(twin, name, e, width, lambda rows: run_in_place(probes, rows),
                                             (t,), {}), x)
    if len(own[0]) != len(ours[0]) or not all(_close(a, b) for a, b in zip(ours[0], own[0])):
        return "its output rerouted differs from its own forward's"
    if not all(_close(a, b) for a, b in zip(ours[1], own[1])):
        return "its gradients rerouted differ from its own forward's"
    return ""




def proof(block: nn.Module, name: str, num_experts: int) -> str:
    """Why the block's loop cannot be rerouted ("" when :func:`prove` passes), without touching the
    global RNG; an exception of the block's own code on the stand-ins is such a reason."""
    return reason_of(prove, block, name, num_experts)


__all__ = ["out_width", "proof", "prove", "rerouted", "router_width", "run_in_place"]
