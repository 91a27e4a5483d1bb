"""What crosses a pipeline cut: any pytree of tensors, sent as its tensor leaves and rebuilt.

A layer may hand the next one a tuple (Hugging Face's rotary ``(cos, sin)``),
a list, a dict, a dataclass or a ``ModelOutput``, with ``None`` s and Python
scalars among the tensors. ``torch.distributed.pipelining`` sends tensors
only, so the sending stage returns the value's tensor leaves, each made
contiguous (point-to-point sends need it; a layer may return a view), and
the receiving stage takes one input per tensor leaf and rebuilds the value
with its non-tensor leaves as they were when the split was made. Those are
the same for every microbatch: the split traces the model on a microbatch.

:func:`crossing_values` finds what each crossing node holds by running the
traced graph under a fake-tensor mode (no real memory, meta models too);
:func:`check_sendable` refuses, naming the value and its type, what has no
tensor-leaf form (an object of a class autopar does not know, a cache).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from autopar.errors import LoweringError

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum,
              torch.memory_format, torch.layout, type(Ellipsis), slice)
Path = tuple[tuple[str, Any], ...]


class Unsendable(Exception):
    """A value with a leaf that is neither a tensor nor a constant; ``args[0]`` names the leaf's type."""


def _is_model_output(v: Any) -> bool:
    return type(v).__name__ != "dict" and isinstance(v, dict) and dataclasses.is_dataclass(v)


def flatten(v: Any, path: Path = ()) -> tuple[list[Path], Callable[[Iterator[Any]], Any]]:
    """The paths of ``v``'s tensor leaves and a function rebuilding ``v`` from those tensors in order.

    Raises :class:`Unsendable` for a leaf that is neither a tensor nor a constant.
    """
    if isinstance(v, torch.Tensor):
        return [path], lambda it: next(it)
    if isinstance(v, _CONSTANTS):
        return [], lambda it: v
    if isinstance(v, dict):
        keys = list(v.keys())
        parts = [flatten(v[k], (*path, ("k", k))) for k in keys]
        cls = type(v)

        def build_dict(it: Iterator[Any]) -> Any:
            items = {k: b(it) for k, (_, b) in zip(keys, parts)}
            return cls(**items) if _is_model_output(v) else cls(items) if cls is not dict else items

        return [p for ps, _ in parts for p in ps], build_dict
    if isinstance(v, (tuple, list)):
        parts = [flatten(x, (*path, ("i", i))) for i, x in enumerate(v)]
        cls = type(v)

        def build_seq(it: Iterator[Any]) -> Any:
            items = [b(it) for _, b in parts]
            return cls(*items) if hasattr(v, "_fields") else cls(items)

        return [p for ps, _ in parts for p in ps], build_seq
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        names = [f.name for f in dataclasses.fields(v)]
        parts = [flatten(getattr(v, n), (*path, ("a", n))) for n in names]

        def build_dataclass(it: Iterator[Any]) -> Any:
            out = copy.copy(v)
            for n, (_, b) in zip(names, parts):
                object.__setattr__(out, n, b(it))
            return out

        return [p for ps, _ in parts for p in ps], build_dataclass
    raise Unsendable(type(v).__qualname__)


def leaf(value: Any, path: Path) -> torch.Tensor:
    """The tensor at ``path`` in ``value``, contiguous (what a stage sends for one tensor leaf)."""
    for kind, key in path:
        value = getattr(value, key) if kind == "a" else value[key]
    return value.contiguous()


def send(g: fx.Graph, node: fx.Node, value: Any) -> list[fx.Node]:
    """Nodes of ``g`` computing what is sent for ``node`` (holding ``value``): its tensor leaves."""
    if isinstance(value, torch.Tensor):
        return [g.call_method("contiguous", (node,))]
    paths, _ = flatten(value)
    return [g.call_function(leaf, (node, path)) for path in paths]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: it is sent back to the previous
    stage, and ``torch.autograd.grad`` may return a strided one (an LSTM's input gradient).
    Forward returns a copy, not a view: a stage may begin with an in-place op on what it
    received (ResNet's ``ReLU(inplace=True)`` right after a cut), which autograd forbids on a
    custom Function's view output and on the received leaf itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, with the gradient that flows back through it made contiguous."""
    return _ContiguousGrad.apply(x) if x.requires_grad else x


def receive(g: fx.Graph, name: str, value: Any) -> fx.Node:
    """Placeholders of ``g`` for what crosses as ``name`` (holding ``value``), rebuilt into its value."""
    if isinstance(value, torch.Tensor):
        return g.call_function(contiguous_grad, (g.placeholder(name),))
    paths, build = flatten(value)
    inputs = tuple(g.call_function(contiguous_grad, (g.placeholder(f"{name}_{i}"),)) for i in range(len(paths)))

    def rebuild(*tensors: torch.Tensor) -> Any:
        return build(iter(tensors))

    rebuild.__name__ = f"rebuild_{name}"
    return g.call_function(rebuild, inputs)


def describe(value: Any) -> str:
    """Why ``value`` cannot be sent (its type, or the type of its leaf that is not a tensor), or ''."""
    if isinstance(value, torch.Tensor):
        return ""
    try:
        flatten(value)
    except Unsendable as exc:
        outer = type(value).__qualname__
        return outer if exc.args[0] == outer else f"{outer} holding a {exc.args[0]}"
    return ""


def check_sendable(cut: list[fx.Node], values: dict[fx.Node, Any], k: int) -> None:
    """A :class:`LoweringError` naming the first value crossing cut ``k`` that cannot be sent."""
    for n in cut:
        why = describe(values[n])
        if why:
            raise LoweringError(f"the cut after stage {k} carries {n.name}, a {why}, which cannot be sent "
                                "between pipeline stages: move the cut")


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node]):
        super().__init__(gm)
        self.wanted, self.values = wanted, {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.wanted:
            self.values[n] = out
        return out


def _placeholder_args(gm: fx.GraphModule, example_inputs: Any) -> list[Any]:
    from torch.utils import _pytree as pytree

    n = sum(1 for x in gm.graph.nodes if x.op == "placeholder")
    if isinstance(example_inputs, dict):
        return list(example_inputs.values())
    args = list(example_inputs) if isinstance(example_inputs, (tuple, list)) else [example_inputs]
    flat = pytree.tree_leaves(args)
    return args if len(args) == n or len(flat) != n else flat


def crossing_values(gm: fx.GraphModule, example_inputs: Any, nodes: set[fx.Node]) -> dict[fx.Node, Any]:
    """What each of ``nodes`` holds on ``example_inputs`` (tensors as fake tensors: no memory used).

    Falls back to the trace's own ``meta["val"]`` where the fake run fails (data-dependent Python in
    the graph), and to "a tensor" where the trace has none (FX symbolic traces record no values).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capturing.moe import batched_hf_experts

    if not nodes:
        return {}
    args = _placeholder_args(gm, example_inputs)
    try:
        # Hugging Face experts through batched_mm: grouped_mm's meta kernel takes bf16 only, and an fp32
        # model's fake run failed, leaving a tuple crossing a cut (gpt-oss's rotary (cos, sin)) unknown
        with batched_hf_experts(gm), FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            rec = _Recorder(gm, nodes)
            rec.run(*fake)
        return rec.values
    except Exception:  # noqa: BLE001 - keep what the trace knows
        return {n: n.meta.get("val", torch.empty(0, device="meta")) for n in nodes}


__all__ = [
    "Unsendable", "check_sendable", "contiguous_grad", "crossing_values", "describe", "flatten", "leaf", "receive",
    "send",
]
