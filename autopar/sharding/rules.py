"""Run a layer's own forward on one tensor-parallel rank's shards: the sharding rules.

A Megatron-style tensor-parallel layer splits its column projections on their
output features and its row projections on their input features. Between
them, the layer's code (attention, masking, rotary, GQA, a GLU) runs on
activations that hold only this rank's share of some dimension, but it was
written for the whole tensor: it reads widths from ``x.size()``, splits by
``n_embd``, views with ``n_head``. :class:`ShardMode`, a ``TorchFunctionMode``
active while the layer's module runs, makes that code right on shards:

* every activation that holds a share is tagged with a :class:`Sharded`
  layout (which dimension, and the *segments* it is cut into: a fused
  ``[q; k; v]`` projection is three segments, each split across ranks);
* shape queries (``size()``, ``.shape``, ``numel()``) answer with the
  *global* sizes, so the layer's arithmetic stays what its author wrote;
* every op that takes a shape or a split (view/reshape, split/chunk,
  expand, indexing, cat) is given the local equivalent, and every op is
  checked to be exact on shards: an op with no rule, or a rule whose
  condition fails (a softmax over the sharded dimension, a view that would
  interleave ranks), raises :class:`NoShardRule` naming the op.

The projections themselves go through a :class:`Collectives` backend: in one
process (:mod:`autopar.sharding.check`) each simulated rank slices its
weights and sums partial results with the other ranks; on a device mesh
(:mod:`autopar.passes.tensor_parallel`) the weights are DTensor shards and the
sums are all-reduces. The rules are the same object in both, so what runs is
what was checked.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from autopar.sharding import whole
from autopar.sharding.layout import (
    SEQUENCE,
    TAG,
    NoShardRule,
    Sharded,
    is_conv1d,
    projection_dims,
    segment_indices,
    segment_permutation,
)
from autopar.sharding.ops import ELEMENTWISE, NO_GRADIENT_OPS, RULES, any_tagged, elementwise

# ------------------------------------------------------------------ collectives


class Collectives(abc.ABC):
    """How a rank gets its weight shards and combines partial results: :class:`SimulatedRank` in one
    process, ``passes.tensor_parallel.MeshRank`` on a device mesh."""

    tp: int
    rank: int

    @abc.abstractmethod
    def column_weight(self, weight: torch.Tensor, dim: int, segments: tuple[int, ...]) -> torch.Tensor:
        """This rank's share of a column projection's ``weight`` (or bias) along ``dim``."""

    @abc.abstractmethod
    def row_weight(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of a row projection's weight along its input ``dim``."""

    def replicated(self, param: torch.Tensor | None) -> torch.Tensor | None:
        """A parameter every rank holds whole (a row projection's bias)."""
        return param

    def full_size(self, weight: torch.Tensor, dim: int) -> int:
        """The unsharded size of a projection's ``weight`` along ``dim`` (a DTensor shard's shape is
        already the global one; a compiled block's trace passes local shards: its backend overrides)."""
        return int(weight.shape[dim])

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        """The replicated input of a column projection (its gradient is summed over ranks)."""
        return x

    @abc.abstractmethod
    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial result of a row projection."""

    @abc.abstractmethod
    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sequence parallelism: every rank's share of ``x`` along ``dim``, concatenated (its
        gradient is summed and scattered back: a reduce-scatter)."""

    @abc.abstractmethod
    def reduce_scatter_sequence(self, partial: torch.Tensor, dim: int) -> torch.Tensor:
        """Sequence parallelism: the sum of every rank's partial result, of which this rank keeps its
        share along ``dim`` (its gradient is gathered: an all-gather)."""

    def grad_sum(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated tensor used with this rank's share of an activation: identity forward, its
        gradient (this rank's part) summed over the tp group backward. In one process the ranks'
        threads share the tensor and autograd sums their parts already."""
        return x


class SimulatedRank(Collectives):
    """One rank simulated in one process: full weights sliced, partials summed with the
    other ranks' threads (:class:`Reducer`)."""

    def __init__(self, tp: int, rank: int, reducer: Reducer):
        self.tp, self.rank, self.reducer = tp, rank, reducer

    def column_weight(self, weight: torch.Tensor, dim: int, segments: tuple[int, ...]) -> torch.Tensor:
        idx = segment_permutation(segments, self.tp).chunk(self.tp)[self.rank].to(weight.device)
        return weight.index_select(dim, idx)

    def row_weight(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        return weight.chunk(self.tp, dim=dim)[self.rank]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.reducer.sum(self.rank, partial)

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.reducer.exchange(self.rank, x), dim=dim)

    def reduce_scatter_sequence(self, partial: torch.Tensor, dim: int) -> torch.Tensor:
        return self.reducer.sum(self.rank, partial).chunk(self.tp, dim=dim)[self.rank]


class Reducer:
    """A sum across the threads that simulate the ranks of one tp group."""

    def __init__(self, tp: int, timeout: float = 60.0):
        self.barrier = threading.Barrier(tp, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * tp

    def exchange(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``value``, in rank order (differentiable: the threads share one graph)."""
        self.slots[rank] = value
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        if any(p is None or p.shape != value.shape for p in parts):
            raise NoShardRule("all-gather", "the ranks' shares differ in shape")
        return parts  # type: ignore[return-value]

    def sum(self, rank: int, partial: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = partial
        self.barrier.wait()
        parts = list(self.slots)
        total = parts[0]
        for p in parts[1:]:
            if p is None or p.shape != total.shape:  # type: ignore[union-attr]
                raise NoShardRule("all-reduce", "the ranks' partial results differ in shape")
            total = total + p
        self.barrier.wait()
        return total  # type: ignore[return-value]

    def abort(self) -> None:
        self.barrier.abort()


# ------------------------------------------------------------------ the mode

_STATE = threading.local()


def current_mode() -> ShardMode | None:
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


@dataclass
class Projection:
    """A column or row projection module the mode is inside of."""

    module: nn.Module
    path: str
    role: str  # "column" or "row"
    segments: tuple[int, ...] = ()
    whole: tuple[int, ...] = ()  # segments every rank computes in full (:mod:`autopar.sharding.whole`)


class ShardMode(TorchFunctionMode):
    """Runs a module's forward on one rank's shards (see the module docstring).

    ``dropout=False`` turns dropout into the identity (the numerical check:
    no parallel plan reproduces one device's masks).

    Sequence parallelism (Megatron-SP): the layer's hidden-state input arrives
    as this rank's share of the sequence (:meth:`enter_sequence`), so the code
    before the first column projection (norms, residuals, dropout) runs on a
    1/tp share; a column projection's input is gathered (an all-gather, once
    per input however many projections read it) and a row projection's
    partial sums are reduce-scattered back onto the sequence, where the
    layer's output stays.

    Wherever a replicated tensor that needs a gradient meets a share (a norm's
    weight on a sequence share, a row bias, a per-head norm's weight on head
    shares), its gradient on this rank is only this rank's part: it is summed
    over the tp group (:meth:`Collectives.grad_sum`), once per tensor.
    """

    def __init__(self, comm: Collectives, dropout: bool = True):
        super().__init__()
        self.comm = comm
        self.tp = comm.tp
        self.key = object()
        self.dropout = dropout
        self.projections: list[Projection] = []
        self.divisors: set[int] = set()
        self.sequence: Sharded | None = None  # the hidden state's layout under sequence parallelism
        self.gathers: list[list[str]] = []  # sequence parallelism: the column projections each gather fed
        self._gathered: dict[int, tuple[torch.Tensor, torch.Tensor, list[str]]] = {}
        self._summed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.grad_sums: list[int] = []  # elements of each replicated tensor whose gradient is summed
        self._row_bias: dict[int, torch.Tensor | None] = {}
        self._transposed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight.T) -> (it, weight)
        self._pending_bias: dict[int, torch.Tensor] = {}  # id(module) -> its output awaiting ``+ bias``
        self.stat_reduces: list[int] = []  # elements of each sum over the sharded dim (all-reduced)
        self.consumed: set[int] = set()  # id() of the projection modules whose weight the rules sharded
        # per-channel parameters the layer's code reads directly (a Mamba mixer's conv1d, dt_proj, A_log, D:
        # :mod:`autopar.sharding.channel_ops`): id -> (parameter, path); handed over as this rank's share
        self.channels: dict[int, tuple[torch.Tensor, str]] = {}
        self._channel_shares: dict[int, torch.Tensor] = {}

    def enter_sequence(self, x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        """Tag ``x``, this rank's share of a hidden state of ``length`` positions along ``dim``."""
        if length % self.tp:
            raise NoShardRule("sequence parallel", f"tp={self.tp} does not divide the sequence length ({length})")
        self.sequence = Sharded(dim, (length,), SEQUENCE)
        return self.tag(x, self.sequence)

    @property
    def projection(self) -> Projection | None:
        """The column or row projection module running now, if any."""
        return self.projections[-1] if self.projections else None

    # ---------------------------------------------------------------- entering
    def __enter__(self):
        stack = getattr(_STATE, "stack", None)
        if stack is None:
            stack = _STATE.stack = []
        stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _STATE.stack.pop()
        return super().__exit__(*exc)

    # ---------------------------------------------------------------- tags
    def layout(self, x: Any) -> Sharded | None:
        tag = getattr(x, TAG, None) if isinstance(x, torch.Tensor) else None
        return tag[1] if tag is not None and tag[0] is self.key else None

    def tag(self, x: Any, layout: Sharded) -> Any:
        if isinstance(x, torch.Tensor):
            local = layout.local(self.tp)
            if x.dim() <= layout.dim or x.shape[layout.dim] != local:
                raise NoShardRule("shard bookkeeping", f"expected dim {layout.dim} of size {local}, got "
                                  f"{tuple(x.shape)}")
            setattr(x, TAG, (self.key, layout))
        elif isinstance(x, (tuple, list)):
            for t in x:
                self.tag(t, layout)
        return x

    def global_shape(self, x: torch.Tensor) -> list[int]:
        shape = list(x.shape)
        lay = self.layout(x)
        if lay is not None:
            shape[lay.dim] = lay.size
        return shape

    def need(self, size: int, what: str, op: str) -> None:
        if size % self.tp:
            raise NoShardRule(op, f"tp={self.tp} does not divide {what} ({size})")
        self.divisors.add(size)

    # ---------------------------------------------------------------- dispatch
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        try:
            return self._dispatch(name, func, args, kwargs)
        except NoShardRule:
            raise
        except Exception as exc:
            if not hasattr(exc, OP_ATTR):  # the innermost op names the failure (a refusal names its op)
                setattr(exc, OP_ATTR, name)
            raise

    def add_channels(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """From now on, ``params`` (split on their first dim, the channels) reach ops as this rank's share."""
        for path, p in params:
            self.channels[id(p)] = (p, path)

    def _channel_share(self, a: Any) -> Any:
        if isinstance(a, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in a):
            return type(a)(self._channel_share(t) for t in a)
        found = self.channels.get(id(a)) if isinstance(a, torch.Tensor) else None
        if found is None or found[0] is not a:
            return a
        share = self._channel_shares.get(id(a))
        if share is None:
            size = self.comm.full_size(a, 0)  # a compiled block's trace hands over the local share
            self.need(size, f"{found[1]}'s channels", found[1])
            with torch._C.DisableTorchFunction():
                share = self.comm.column_weight(a, 0, (size,))
            share = self._channel_shares[id(a)] = self.tag(share, Sharded(0, (size,), found[1]))
        return share

    def _dispatch(self, name: str, func, args, kwargs):
        if self.channels:
            args = tuple(self._channel_share(a) for a in args)
            kwargs = {k: self._channel_share(v) for k, v in kwargs.items()}
        if self.projection is not None:
            done = self._projection_op(name, func, args, kwargs)
            if done is not _NOT_MINE:
                return done
        if not self.dropout and name in _DROPOUTS:
            if name != "scaled_dot_product_attention":
                return args[0]
            args, kwargs = _no_attention_dropout(args, kwargs)
        if not (any_tagged(self, args) or any_tagged(self, kwargs.values())):
            if name in _GROUPED_MM and _float64_grouped(args, kwargs):
                return _grouped_mm_by_group(*args, **kwargs)
            return func(*args, **kwargs)
        if name not in NO_GRADIENT_OPS:
            args, kwargs = self._sum_replicated_grads(args, kwargs)
        rule = RULES.get(name)
        if _holds_whole(self, args):
            rule = whole.rule
        if rule is None:
            if name in ELEMENTWISE:
                rule = elementwise
            else:
                raise NoShardRule(name, "no sharding rule for this op on a sharded activation")
        return rule(self, name, func, args, kwargs)

    def _sum_replicated_grads(self, args, kwargs):
        """Route every replicated tensor needing a gradient that meets a share through
        :meth:`Collectives.grad_sum` (see the class docstring)."""
        def fix(a):
            if isinstance(a, torch.Tensor) and a.requires_grad and self.layout(a) is None:
                base = a._base
                if self.channels and base is not None and base.requires_grad and self.layout(base) is None:
                    # a Mamba scan reads one step of C at a time: its whole tensor's gradient is summed
                    # once, not once a step (channel_ops.py); the step is the same view of the sum
                    return fix(base).as_strided(a.size(), a.stride(), a.storage_offset())
                done = self._summed.get(id(a))
                if done is None:
                    done = self._summed[id(a)] = (a, self.comm.grad_sum(a))
                    self.grad_sums.append(a.numel())
                return done[1]
            if isinstance(a, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in a):
                return type(a)(fix(t) for t in a)
            return a
        return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}

    def gather_input(self, proj: Projection, args: tuple) -> tuple | None:
        """Sequence parallelism, as a column projection module is entered: its input, a share of the
        sequence, gathered whole (once however many projections read it), so the module's own code
        (a Conv1D flattens batch and sequence) sees the whole tensor. None: nothing to gather."""
        x = args[0] if args else None
        lay = self.layout(x)
        if proj.role != "column" or lay is None or not lay.sequence:
            return None
        if len(lay.segments) != 1:
            raise NoShardRule(proj.path, "sequence parallel: its input is not one contiguous share of the sequence")
        done = self._gathered.get(id(x))
        if done is None:
            with torch._C.DisableTorchFunction():  # the collective's own ops are not the layer's
                whole = self.comm.gather_sequence(x, lay.dim)  # type: ignore[arg-type]
            done = self._gathered[id(x)] = (x, whole, [])  # type: ignore[assignment]
            self.gathers.append(done[2])
        done[2].append(proj.path)
        return (done[1], *args[1:])

    def _was_gathered(self, x: torch.Tensor) -> bool:
        base = x if x._base is None else x._base
        return any(whole is x or whole is base for _, whole, _ in self._gathered.values())

    # ---------------------------------------------------------------- projections
    def _projection_op(self, name: str, func, args, kwargs):
        """A projection's own op: ``F.linear(x, W, b)``, Conv1D's ``addmm(b, x, W)``, or
        ``x @ W.T`` then ``+ b`` (Falcon's linear). Any other op touching the projection's weight or
        bias is refused here, in the simulation and on the mesh alike: the runtime holds those as
        shards, so code that reads them outside these forms cannot run what was proved."""
        proj = self.projection
        mod = proj.module  # type: ignore[union-attr]
        weight = mod.weight
        conv = is_conv1d(mod)
        if name == "linear" and not conv and len(args) > 1 and args[1] is weight:
            x, bias = args[0], (args[2] if len(args) > 2 else kwargs.get("bias"))
        elif name == "addmm" and conv and len(args) > 2 and args[2] is weight:
            bias, x = args[0], args[1]
        elif name in ("get_T", "t") and not conv and args and args[0] is weight:
            out = func(*args, **kwargs)
            self._transposed[id(out)] = (out, weight)
            return out
        elif name in ("matmul", "__matmul__") and len(args) > 1 and id(args[1]) in self._transposed \
                and self._transposed[id(args[1])][0] is args[1]:
            x, bias = args[0], None
            if proj.whole:  # type: ignore[union-attr]
                raise NoShardRule(proj.path, "x @ weight.T + bias beside key/value rows run whole is not ruled")  # type: ignore[union-attr]
            y = self._project(proj, mod, x, None, conv=False)
            self._pending_bias[id(mod)] = y
            return y
        elif name in ("add", "__add__", "__radd__") and len(args) == 2 and mod.bias is not None \
                and any(a is mod.bias for a in args) and any(a is self._pending_bias.get(id(mod)) for a in args):
            return self._add_bias(proj, mod, self._pending_bias.pop(id(mod)))
        else:
            if name not in NO_GRADIENT_OPS and _touches(args, kwargs, (weight, getattr(mod, "bias", None),
                                                                        *(t for t, _ in self._transposed.values()))):
                raise NoShardRule(proj.path, f"{name}: its forward uses its weight or bias outside the projection "
                                  "forms the rules shard (F.linear, addmm, x @ weight.T + bias)")
            return _NOT_MINE
        return self._project(proj, mod, x, bias, conv)

    def _add_bias(self, proj: Projection, mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """``y + bias`` after ``x @ W.T``, with the bias a rank holds (see :meth:`_project`)."""
        bias = mod.bias
        if proj.role == "column":
            lay = self.layout(y)
            b = self.comm.column_weight(bias, 0, lay.segments)  # type: ignore[union-attr]
            return self.tag(y + b, lay)  # type: ignore[arg-type]
        b = self.comm.replicated(bias)
        if self.sequence is None:
            return y + b
        self._row_bias[id(mod)] = b  # added once the partial sums are reduce-scattered
        return y

    def _project(self, proj: Projection, mod: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                 conv: bool) -> torch.Tensor:
        """``x`` through this rank's share of the projection ``mod`` (column or row)."""
        weight = mod.weight
        self.consumed.add(id(mod))
        wdim_out, wdim_in = (1, 0) if conv else (0, 1)
        if proj.role == "column" and proj.whole:
            return whole.project(self, proj.path, mod, x, bias, conv, proj.segments, proj.whole)
        if proj.role == "column":  # type: ignore[union-attr]
            if self.layout(x) is not None:
                raise NoShardRule(proj.path, "a column projection reads an activation that is already sharded")
            segs = proj.segments or (self.comm.full_size(weight, wdim_out),)  # type: ignore[union-attr]
            for s in segs:
                self.need(s, f"a segment of {proj.path}'s output", proj.path)  # type: ignore[union-attr]
            w = self.comm.column_weight(weight, wdim_out, segs)
            b = self.comm.column_weight(bias, 0, segs) if bias is not None else None
            # a gathered input's gradient is reduce-scattered by the gather: no second sum
            xin = x if self._was_gathered(x) else self.comm.copy_to(x)
            y = torch.nn.functional.linear(xin, w, b) if not conv else torch.addmm(b, xin, w)
            return self.tag(y, Sharded(y.dim() - 1, segs, proj.path))  # type: ignore[union-attr]
        lay = self.layout(x)
        width = self.comm.full_size(weight, wdim_in)
        if lay is None or lay.dim != x.dim() - 1 or len(lay.segments) != 1 or lay.size != width:
            raise NoShardRule(proj.path, "a row projection's input is not sharded on its last dim "  # type: ignore[union-attr]
                              f"as one block of {width} features")
        w = self.comm.row_weight(weight, wdim_in)
        partial = torch.nn.functional.linear(x, w) if not conv else torch.mm(x, w)
        b = self.comm.replicated(bias)
        if self.sequence is None:
            y = self.comm.reduce(partial)
            return y + b if b is not None else y
        # sequence parallelism: the module's output (a Conv1D views its flat result back to
        # [batch, sequence, features]) is reduce-scattered as the module returns (scatter_output)
        self._row_bias[id(mod)] = b
        return partial

    def scatter_output(self, proj: Projection, output: Any) -> Any:
        """Sequence parallelism, as a row projection module returns: its partial sums reduce-scattered
        onto this rank's share of the sequence, then its bias added. None: nothing to scatter."""
        seq = self.sequence
        if proj.role != "row" or seq is None or not isinstance(output, torch.Tensor):
            return None
        if output.dim() <= seq.dim or output.shape[seq.dim] != seq.size:
            raise NoShardRule(proj.path, f"sequence parallel: its output {tuple(output.shape)} has no sequence "
                              f"of {seq.size} on dim {seq.dim} to scatter")
        b = self._row_bias.pop(id(proj.module), None)
        with torch._C.DisableTorchFunction():  # the collective's own ops are not the layer's
            y = self.comm.reduce_scatter_sequence(output, seq.dim)
            if b is not None:
                if b.requires_grad:
                    self.grad_sums.append(b.numel())
                    b = self.comm.grad_sum(b)
                y = y + b
        return self.tag(y, seq)


_NOT_MINE = object()
OP_ATTR = "_autopar_failed_op"  # set on an exception an op raised under the mode: the op's name


def _holds_whole(mode: ShardMode, args) -> bool:
    return any(isinstance(a, torch.Tensor) and (lay := mode.layout(a)) is not None and lay.whole for a in args)


def _touches(args, kwargs, tensors: tuple) -> bool:
    """Whether any argument (nested in lists/tuples) is one of ``tensors`` (by identity)."""
    ids = {id(t) for t in tensors if t is not None}

    def hit(a) -> bool:
        if isinstance(a, (tuple, list)):
            return any(hit(t) for t in a)
        return isinstance(a, torch.Tensor) and id(a) in ids
    return any(hit(a) for a in args) or any(hit(v) for v in kwargs.values())


_DROPOUTS = frozenset({"dropout", "dropout_", "feature_dropout", "alpha_dropout", "scaled_dot_product_attention"})


def _no_attention_dropout(args, kwargs):
    if len(args) > 4:
        return (*args[:4], 0.0, *args[5:]), kwargs
    return args, {**kwargs, "dropout_p": 0.0}


_GROUPED_MM = ("grouped_mm", "_grouped_mm")


def _float64_grouped(args: tuple, kwargs: dict) -> bool:
    """A 2-D × 3-D grouped matmul with offsets (an MoE block's experts, as Hugging Face calls it) that the
    kernel would refuse here: in float64 (the numerical check), or on meta (the shape proof at the real
    size: the meta kernel takes bf16 only)."""
    a, b = (list(args) + [None, None])[:2]
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 3
            and (a.is_meta or a.dtype == b.dtype == torch.float64)
            and kwargs.get("offs", args[2] if len(args) > 2 else None) is not None and kwargs.get("bias") is None)


def _grouped_mm_by_group(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
    """``grouped_mm`` one matmul per group, where the check runs it and the kernel will not: the same sum
    of products (rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]``; rows past the last offset zeros, as
    the kernel leaves them), only unfused. On meta, where no offset can be read, ``a @ b[0]``: the
    output's shape and dtype. The experts it computes are replicated, never split by a tensor-parallel
    style (their tensors carry no shard tag, or this path is not taken)."""
    if a.is_meta:
        return a @ b[0]
    ends = [int(e) for e in offs.tolist()]
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends)]
    # split and unbind, not a slice and an index per group: each of those backwards writes a zero
    # tensor of the whole input (DeepSeek-V3's 16 narrowed experts: 3.9 of a 5 s simulation)
    parts = [rows @ weight for rows, weight in zip(a[:ends[-1]].split(sizes), b.unbind(0))]
    parts.append(a.new_zeros(a.shape[0] - ends[-1], b.shape[-1]))
    return torch.cat(parts)


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return "get_" + str(getattr(owner, "__name__", ""))
    return name


__all__ = ["OP_ATTR", "Collectives", "NoShardRule", "Projection", "Reducer", "ShardMode", "Sharded", "SimulatedRank",
           "current_mode", "is_conv1d", "projection_dims", "segment_indices", "segment_permutation"]
