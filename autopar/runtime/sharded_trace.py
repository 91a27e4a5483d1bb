"""A tensor-parallel block under torch.compile: its forward traced once under the sharding rules.

Eagerly, a tensor-parallel layer's own forward runs under
:class:`~autopar.sharding.rules.ShardMode`, a ``TorchFunctionMode`` that rewrites each op in Python
per call (tags on tensors, ``id()``-keyed books, a thread-local mode stack). Dynamo cannot trace
that mode: with it active around a compiled forward, dynamo stopped at the mode's first
``@property`` ("cls_source must not be None for MRO walk": an attribute of a class it holds no
source for); past it lie ``setattr`` on intermediate tensors, ``id()``-keyed books and
``threading.local`` (not tried one by one). Rewriting the mode for dynamo would fork the rules
capture proved, and dynamo would re-run that Python on every retrace.

So the rules run where they always ran, in Python, once: ``make_fx`` traces the block's forward
under ``ShardMode`` on fake tensors of this rank's shapes (``tracing_mode="fake"``: nothing runs
while tracing, no collective, no RNG draw, no buffer written; the rules read shapes and tags only,
and the custom ops' fake kernels give their outputs' shapes) into an FX graph of the *rewritten*
ops: local ATen ops on the shards and the tp collectives as single custom ops with their own
autograd (:class:`~autopar.passes.tensor_parallel_ops.TracedMeshRank`).
That graph is what :class:`~autopar.runtime.compiled.CompiledBlock` compiles (``fullgraph=True``):
dynamo traces plain FX code, AOTAutograd derives the backward from each op's formula. The
parameters are the graph's inputs (DTensor shards passed as their local tensors through
``to_local``, which carries their gradient back), so blocks whose traces are the same code share
one graph, compiled once.

A trace holds the shapes, dtypes and non-tensor arguments it was made with (a view's sizes are
constants in it), so it is kept per *signature* of the call (those, plus grad mode and the
module's training flag) and a call with a new one is traced afresh (and dynamo compiles the new
graph): a trace never runs on inputs it was not made for.

A block ``make_fx`` cannot trace (Python control flow on a tensor's value, ``.item()``: fake
tensors hold no values; any error the trace raises) runs eagerly for that signature instead,
under the sharding rules as an eager plan runs it: tried once per block and signature, with one
warning and ``on_break(path, reason)`` told once (the compiled runtime's note on the plan: priced
compiled, it runs eager), never a crash for what an eager plan runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.passes.tensor_parallel import MeshRank, ShardedRun
from autopar.passes.tensor_parallel_ops import TracedMeshRank
from autopar.sharding.check import SEQ_DIM, hidden_input
from autopar.sharding.rules import ShardMode


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _plain(x: Any) -> Any:
    """A functional collective's output still in flight (DTensor's vocab-split embedding hands one on)
    as a plain tensor: an op waits on it and unwraps it (a view would stay wrapped), keeping its
    gradient; the graph's inputs are plain tensors, and so is the gradient it returns for this one."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
    try:
        hash(x)
        return ("C", type(x).__name__, x)
    except TypeError:
        return ("R", type(x).__name__, repr(x))


def _constants(gm: torch.fx.GraphModule) -> tuple:
    """The trace's tensor constants, by value (two traces of the same code share a graph only with them)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            c = getattr(gm, node.target)
            out.append((str(c.dtype), tuple(c.shape), c.detach().cpu().contiguous().view(-1).tolist())
                       if isinstance(c, torch.Tensor) else repr(c))
    return tuple(out)


class ShardedTrace:
    """A tensor-parallel block's forward (replacing ``module.forward``): the block traced under
    ``ShardMode`` once per call signature and run by ``compile(graph)``, a compiled runner of that
    graph (:class:`~autopar.runtime.compiled.CompiledBlock`), shared by the blocks whose traces match
    (``shared``: the trace's code and constants -> runner). ``wrap`` is put around what runs (the
    block's checkpoint, when it is recomputed); a signature ``make_fx`` cannot trace runs
    ``wrap(eager under the rules)`` (module docstring), ``on_break(path, reason)`` told once."""

    def __init__(self, module: nn.Module, eager: Callable[..., Any], run: ShardedRun,
                 compile: Callable[[torch.fx.GraphModule], Callable[..., Any]], shared: dict, *, path: str = "",
                 on_break: Callable[[str, str], None] | None = None,
                 wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn) -> None:
        self.module, self.eager, self.run, self.compile, self.shared = module, eager, run, compile, shared
        self.path, self.on_break = path, on_break
        self.comm = TracedMeshRank(run.tp_mesh)
        self.traces: dict[Any, tuple[Callable[..., Any], Any, list[int]] | None] = {}  # None: runs eagerly
        self.untraced: dict[Any, str] = {}  # the signatures make_fx could not trace -> why
        self.fallback = wrap(self._under_rules)
        self.eager_comm: MeshRank | None = None  # the eager runtime's collectives, made on the first fallback
        run.compiled = True  # the module's hooks stop entering the mode around this forward

    def _state(self) -> tuple[list[str], list[torch.Tensor], list[tuple[int, ...]]]:
        names, values, shapes = [], [], []
        for name, t in (*self.module.named_parameters(), *self.module.named_buffers()):
            names.append(name)
            values.append(_local(t))
            shapes.append(tuple(t.shape))  # a DTensor's global shape
        return names, values, shapes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names, state, shapes = self._state()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        leaves = [_plain(x) for x in leaves]
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        key = (tuple(names), tuple(_signature(t) for t in state), str(spec), tuple(_signature(x) for x in leaves),
               torch.is_grad_enabled(), self.module.training)
        if key not in self.traces:
            try:
                self.traces[key] = self._trace(names, state, shapes, leaves, spec, at)
            except Exception as exc:  # untraceable: eager for this signature, said once (module docstring)
                self.traces[key] = None
                self._untraced(key, exc)
        traced = self.traces[key]
        if traced is None:
            return self.fallback(*args, **kwargs)
        runner, out_spec, _ = traced
        flat = runner(*state, *(leaves[i] for i in at))
        return pytree.tree_unflatten(list(flat), out_spec)

    def _untraced(self, key: Any, exc: Exception) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = self.untraced[key] = (f"make_fx could not trace it under the sharding rules ({type(exc).__name__}"
                                    + (f": {first[:200]})" if first else ")"))
        warnings.warn(f"torch.compile: block {self.path!r} runs eagerly (the plan priced it compiled): {why}",
                      stacklevel=3)
        if self.on_break is not None:
            self.on_break(self.path, why)

    def _under_rules(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward under the sharding rules, as an eager plan runs it (the hooks, told the block
        is compiled, kept the sequence share only)."""
        if self.eager_comm is None:
            self.eager_comm = MeshRank(self.run.tp_mesh)
        comm = self.eager_comm
        with ShardMode(comm) as mode:
            if self.run.sequence is not None:
                found = hidden_input(args, kwargs)
                if found is not None:
                    mode.enter_sequence(found[1], SEQ_DIM, found[1].shape[SEQ_DIM] * comm.tp)
            return self.eager(*args, **kwargs)

    def _trace(self, names: list[str], state: list[torch.Tensor], shapes: list[tuple[int, ...]],
               leaves: list[Any], spec: Any, at: list[int]) -> tuple[Callable[..., Any], Any, list[int]]:
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.nn.utils.stateless import _reparametrize_module

        n = len(state)
        out_spec: list[Any] = []

        def block(*flat: torch.Tensor) -> list[Any]:
            values = list(leaves)
            for i, t in zip(at, flat[n:]):
                values[i] = t
            args, kwargs = pytree.tree_unflatten(values, spec)
            # the rules read a projection's unsharded width, which its local shard does not show
            self.comm.full_shapes = {id(t): shape for t, shape in zip(flat[:n], shapes)}
            with _reparametrize_module(self.module, dict(zip(names, flat[:n]))), ShardMode(self.comm) as mode:
                if self.run.sequence is not None:  # the hooks kept this rank's share: tag it as the mode did
                    found = hidden_input(args, kwargs)
                    if found is not None:
                        share = found[1]
                        mode.enter_sequence(share, SEQ_DIM, share.shape[SEQ_DIM] * self.comm.tp)
                out = self.eager(*args, **kwargs)
            outs, ospec = pytree.tree_flatten(out)
            out_spec.append(ospec)
            return outs

        try:
            gm = make_fx(block, tracing_mode="fake")(*state, *(leaves[i] for i in at))
        finally:
            self.comm.full_shapes = {}
        key = (gm.code, _constants(gm))
        runner = self.shared.get(key)
        if runner is None:
            runner = self.shared[key] = self.compile(gm)
        return runner, out_spec[0], at


__all__ = ["ShardedTrace"]
