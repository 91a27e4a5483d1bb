"""What context parallelism (cp) needs to know of a model, found by running it once.

Under cp every rank holds S/cp tokens of each sequence (head-tail chunks) and
the runtime (``passes/context_parallel.py``) makes two things exact: every
``F.scaled_dot_product_attention`` call sees all keys and values (gathered
over the cp group) with the causal mask of the rank's global positions, and
every module that receives positions computed in the model from
``torch.arange(S)`` (the project's GPT's ``pos_emb``, a Hugging Face model's
``rotary_emb``) receives the global positions of the rank's tokens instead.
Everything else must be token-wise. :func:`context_facts` runs the model's
forward once on fake tensors (shapes only: no compute, whatever device the
weights are on) under a ``TorchFunctionMode`` and proves what it can:

* each SDPA call is causal self-attention over the whole sequence with no
  mask (query, key and value all S long, ``is_causal`` true, ``attn_mask``
  None; a mask built in the model is refused: it would be the local one);
* positions (values derived from ``arange(S)``) reach only modules
  (:attr:`ContextFacts.positions`) or SDPA-free token-wise arithmetic, never
  an attention argument;
* attention written by hand (q · kᵀ, a scale, ``masked_fill`` with −inf, softmax,
  dropout, · v: nanoGPT's) is followed op by op
  (:mod:`autopar.capturing.manual_attention`) and recorded
  (:attr:`ContextFacts.manual`, with its inputs' shapes, on which the lowering
  proves its rewrite); any other op on its scores is refused;
* no call mixes tokens otherwise: a product of two activations that is S × S
  outside such a chain (an ``einsum`` q · kᵀ among them), a reduction or
  normalisation over a dimension of size S, a scan, recurrence, convolution,
  pooling, pad, roll or flip (:data:`SEQUENCE_MIXING`), or a slice that cuts
  dim 1 of a (b, S, …) tensor (a token shift or window).

Whatever fails is :attr:`ContextFacts.refusal`, one line naming the op and
the module; the planner then refuses cp with it (``AxisLimits.context_refusal``).

These checks know the sequence dimension by its size S, and S often equals
another dimension (Llama 3 8B and Mixtral 8x7B: hidden 4096 at 4096 tokens,
where RMSNorm's mean over the hidden dim looks like a mean over tokens). So the
forward runs twice (shapes only, about 0.05 s for a 70B): at S, whose run gives
the facts, and at a shorter S' (the inputs' dim 1 cut to S', which any model
taking S tokens takes, a position cache or nanoGPT's ``block_size`` among them)
chosen as a size no tensor of the first run has, so at S' a dimension of size S'
is the sequence. A refusal at S stands unless S' runs the same calls in the same
modules with no refusal and the same attention and positions: then the call
refused at S did not touch the sequence (at S' it would have been refused too),
and a real mixer (a mean or cumsum over tokens, a token shift) is refused at both.
A run at S' that refuses, or finds other attention or positions, withdraws what
S allowed (a cross-attention whose memory happens to be S long). Where S' cannot
be chosen or its run fails, the verdict at S stands. (Following the sequence
dimension through every op, as positions are followed, would need a rule per op
for how dims move; two runs need none.)
The per-layer K/V bytes of the attention calls (:attr:`ContextFacts.kv_bytes`)
are what pricing all-gathers; their Q and output bytes and key/value head counts
(:attr:`ContextFacts.qo_bytes`, :attr:`ContextFacts.kv_heads`) what the head
all-to-all (Ulysses) moves and what its degree must divide.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from autopar.capturing.manual_attention import ManualChains
from autopar.capturing.moe import batched_hf_experts
from autopar.graph import Layer

# calls that mix tokens along any dimension they touch (named by their __name__)
SEQUENCE_MIXING = frozenset({
    "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "avg_pool1d", "max_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d",
    "roll", "flip", "fft_fft", "fft_rfft", "batch_norm", "instance_norm", "group_norm", "pad",
    "lstm", "gru", "rnn_tanh", "rnn_relu",
})
_SLICING = frozenset({"__getitem__", "narrow", "split", "chunk", "unfold"})  # a shift or window over tokens
# products of two tensors: q · kᵀ written by hand is one of them
_PRODUCTS = frozenset({"matmul", "__matmul__", "bmm", "mm", "baddbmm", "einsum"})
# reductions and normalisations that mix tokens when the dimension they run over is the sequence
_REDUCING = frozenset({
    "sum", "mean", "max", "min", "amax", "amin", "logsumexp", "softmax", "log_softmax", "norm", "var",
    "std", "prod", "argmax", "argmin", "sort", "topk", "median", "var_mean", "std_mean",
})


@dataclass(frozen=True)
class ContextFacts:
    """What the probe found: why cp cannot run ("" when it can), the modules given positions, and
    per module path (the innermost module running each SDPA call) the K and V bytes per sample."""

    refusal: str = ""
    positions: tuple[str, ...] = ()
    kv_bytes: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # SDPA calls per module path
    qo_bytes: dict[str, float] = field(default_factory=dict)  # Q and output bytes per sample, per path
    kv_heads: dict[str, tuple[int, ...]] = field(default_factory=dict)  # key/value head counts (0: not 4-D)
    # the modules running attention by hand (manual_attention), each with its positional inputs' (shape, dtype)
    manual: dict[str, tuple[tuple[tuple[int, ...], str] | None, ...]] = field(default_factory=dict)

    def graph_fields(self) -> dict[str, Any]:
        """The LayerGraph's cp fields."""
        return {"cp_refusal": self.refusal, "cp_positions": self.positions, "cp_attention": tuple(self.kv_bytes),
                "cp_manual": dict(self.manual)}


def with_attention(layers: list[Layer], facts: ContextFacts) -> list[Layer]:
    """``layers`` with the K/V bytes and SDPA calls of the attention modules inside each."""

    def inside(path: str, layer: Layer) -> bool:
        return bool(layer.module_path) and (path + ".").startswith(f"{layer.module_path}.")

    return [replace(l, kv_bytes_per_sample=sum(b for p, b in facts.kv_bytes.items() if inside(p, l)),
                    attention_calls=sum(n for p, n in facts.calls.items() if inside(p, l)),
                    qo_bytes_per_sample=sum(b for p, b in facts.qo_bytes.items() if inside(p, l)),
                    kv_heads=tuple(sorted({h for p, hs in facts.kv_heads.items() if inside(p, l) for h in hs})))
            for l in layers]


class _Probe(TorchFunctionMode):
    """Watches one forward: SDPA calls, values derived from ``arange(S)``, token-mixing calls."""

    def __init__(self, seq_len: int, batch: int, stack: list[str]):
        super().__init__()
        self.seq_len, self.batch, self.stack = seq_len, batch, stack
        self.tainted: dict[int, torch.Tensor] = {}  # id → tensor derived from arange(S) (kept alive)
        self.problems: list[str] = []
        self.kv_bytes: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.qo_bytes: dict[str, float] = {}
        self.kv_heads: dict[str, tuple[int, ...]] = {}
        self.manual = ManualChains(seq_len, batch)  # attention written by hand, followed op by op
        self.trace: list[tuple[str, str]] = []  # (call, module) of every call: the runs at S and S' compared
        self.sizes: set[int] = set()  # every dimension's size seen: S' is none of them

    def _where(self) -> str:
        return self.stack[-1] if self.stack and self.stack[-1] else "the model's forward"

    def _refuse(self, what: str) -> None:
        if not self.problems:
            self.problems.append(f"{what} in {self._where()}")

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tainted = any(id(t) in self.tainted for t in tensors)
        self.trace.append((name, self._where()))
        self.sizes.update(d for t in tensors for d in t.shape)
        chain = self.manual.on_chain(tensors)
        if chain is not None:  # a step of attention written by hand (its softmax is over S, rightly)
            out = func(*args, **kwargs)
            self.manual.advance(name, args, kwargs, out, chain[0], self._where())
            self._taint(tainted, out)
            self._seen(out)
            return out
        if func is F.scaled_dot_product_attention:
            self._attention(args, kwargs, tainted)
        elif name in SEQUENCE_MIXING:
            self._refuse(f"{name} (it mixes tokens along the sequence)")
        elif name in _REDUCING and self._over_sequence(args, kwargs):
            self._refuse(f"{name} over the sequence dimension")
        out = func(*args, **kwargs)
        if name in _SLICING and self._cuts_sequence(args, out):
            self._refuse(f"{name} cutting the sequence dimension (tokens shifted or windowed)")
        if name == "arange" and isinstance(out, torch.Tensor) and out.numel() == self.seq_len > 1:
            self.tainted[id(out)] = out
        else:
            self._taint(tainted, out)
        if name in _PRODUCTS and self._scores(tensors, out) and not self.manual.starts(name, tensors, out,
                                                                                        self._where()):
            self._refuse(f"{name} makes an S × S score matrix (attention written by hand)")
        self._seen(out)
        return out

    def _seen(self, out: Any) -> None:
        self.sizes.update(d for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) for d in t.shape)

    def _taint(self, tainted: bool, out: Any) -> None:
        if tainted:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.tainted[id(t)] = t

    def _scores(self, tensors: list[torch.Tensor], out: Any) -> bool:
        """Whether a product of two activations (no weight among them) is S × S: q·kᵀ by hand."""
        acts = [t for t in tensors if not isinstance(t, nn.Parameter) and t.dim() >= 2]
        return (len(acts) >= 2 and isinstance(out, torch.Tensor) and out.dim() >= 2
                and list(out.shape[-2:]) == [self.seq_len] * 2)

    def _cuts_sequence(self, args: tuple, out: Any) -> bool:
        """Whether a (b, S, …) tensor came out with another length on dim 1 (rank kept)."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return (x is not None and x.dim() >= 2 and x.shape[1] == self.seq_len
                and any(t.dim() == x.dim() and t.shape[1] != self.seq_len for t in outs))

    def _over_sequence(self, args: tuple, kwargs: dict) -> bool:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        if x is None or x.dim() == 0:
            return False
        dims = range(x.dim()) if dim is None else (dim if isinstance(dim, (tuple, list)) else (dim,))
        return any(x.shape[d] == self.seq_len for d in dims if isinstance(d, int))

    def _attention(self, args: tuple, kwargs: dict, tainted: bool) -> None:
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        lengths = {q.shape[-2], k.shape[-2], v.shape[-2]}
        if mask is not None:
            self._refuse("scaled_dot_product_attention with an attn_mask (a mask built in the model "
                         "would be the rank's local one)")
        elif not causal:
            self._refuse("scaled_dot_product_attention without is_causal")
        elif lengths != {self.seq_len}:
            self._refuse(f"scaled_dot_product_attention over lengths {sorted(lengths)}, not the sequence "
                         f"{self.seq_len} (cross-attention)")
        elif tainted:
            self._refuse("scaled_dot_product_attention reading positions")
        where = self.stack[-1] if self.stack else ""
        nbytes = (k.numel() * k.element_size() + v.numel() * v.element_size()) / self.batch
        self.kv_bytes[where] = self.kv_bytes.get(where, 0.0) + nbytes
        self.calls[where] = self.calls.get(where, 0) + 1
        # the output is shaped like the query with the value's head size
        out = q.numel() // q.shape[-1] * v.shape[-1] * q.element_size()
        self.qo_bytes[where] = self.qo_bytes.get(where, 0.0) + (q.numel() * q.element_size() + out) / self.batch
        heads = k.shape[1] if k.dim() == 4 and v.dim() == 4 and k.shape[1] == v.shape[1] else 0
        self.kv_heads[where] = tuple(sorted({*self.kv_heads.get(where, ()), heads}))


def _state(model: nn.Module) -> dict[tuple[int, str, str], tuple[nn.Module, Any]]:
    """Every module's attributes and buffers, so that a forward that caches tensors on its modules
    (rotary caches, masks) leaves no fake tensor behind."""
    out: dict[tuple[int, str, str], tuple[nn.Module, Any]] = {}
    for m in model.modules():
        for name, value in list(vars(m).items()):
            if not name.startswith("_"):
                out[(id(m), "attr", name)] = (m, value)
        for name, value in m._buffers.items():
            out[(id(m), "buffer", name)] = (m, value)
    return out


def _restore(model: nn.Module, before: dict[tuple[int, str, str], tuple[nn.Module, Any]]) -> None:
    after = _state(model)
    for key, (m, value) in after.items():
        old = before.get(key)
        if old is not None and old[1] is value:
            continue
        kind, name = key[1], key[2]
        if kind == "buffer":
            if old is None:
                del m._buffers[name]
            else:
                m._buffers[name] = old[1]
        elif old is None:
            delattr(m, name)
        else:
            object.__setattr__(m, name, old[1])


def probe_layers(model: nn.Module, args: tuple, kwargs: dict, seq_len: int | None, batch: int,
                 layers: list[Layer]) -> tuple[list[Layer], ContextFacts]:
    """:func:`context_facts` for capture's ``layers``, and the layers with their attention's K/V bytes."""
    with batched_hf_experts(model):  # grouped_mm's meta kernel takes bf16 only
        facts = context_facts(model, args, kwargs, seq_len, batch, twin_paths(model, layers))
    return with_attention(layers, facts), facts


def twin_paths(model: nn.Module, layers: list[Layer]) -> dict[str, str]:
    """Each layer module that repeats an earlier one (same class, same captured costs) → that first one."""
    first: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for layer in layers:
        if layer.module_path:
            key = (type(model.get_submodule(layer.module_path)), layer.cost_signature())
            if key in first and first[key] != layer.module_path:
                out[layer.module_path] = first[key]
            first.setdefault(key, layer.module_path)
    return {path: one for path, one in out.items() if path not in first.values()}


def _skipping(model: nn.Module, twins: dict[str, str], shaped: dict[str, bool]) -> list[Any]:
    """Twins pass their input through once the first of their kind returned a tensor shaped like its
    input: the probe checks one block of each kind (meta forwards of 96 blocks take seconds)."""
    handles = []
    for first in set(twins.values()):
        def seen(module: nn.Module, a: tuple, kw: dict, out: Any, first: str = first) -> None:
            x = a[0] if a else next(iter(kw.values()), None)
            shaped[first] = (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)
                             and out.shape == x.shape and out.dtype == x.dtype)
        handles.append(model.get_submodule(first).register_forward_hook(seen, with_kwargs=True))
    for path, first in twins.items():
        module = model.get_submodule(path)

        def run(*a: Any, _real: Any = module.forward, _first: str = first, **kw: Any) -> Any:
            x = a[0] if a else next(iter(kw.values()), None)
            return x if shaped.get(_first) else _real(*a, **kw)
        module.forward = run  # removed by _restore
    return handles


def _copy_twins(found: dict[str, Any], twins: dict[str, str], shaped: dict[str, bool]) -> dict[str, Any]:
    """What the first of each kind recorded, for every twin that passed its input through."""
    out = dict(found)
    for path, first in twins.items():
        if shaped.get(first):
            out.update({path + p[len(first):]: v for p, v in found.items() if (p + ".").startswith(first + ".")})
    return out


@dataclass(frozen=True)
class _Run:
    """One forward of the probe: its facts (``refusal`` set where it refused, the fields filled all the same),
    whether it ran at all, its calls in order and every dimension size it saw."""

    facts: ContextFacts
    ran: bool
    trace: tuple[tuple[str, str], ...] = ()
    sizes: frozenset[int] = frozenset()

    def shape(self) -> tuple:
        """What cp is built from, beside the byte counts (which scale with S): compared across lengths."""
        f = self.facts
        return f.positions, tuple(sorted(f.kv_bytes)), f.calls, f.kv_heads, tuple(sorted(f.manual))


def context_facts(model: nn.Module, args: tuple, kwargs: dict, seq_len: int | None, batch: int,
                  twins: dict[str, str] | None = None) -> ContextFacts:
    """Run ``model`` on the example inputs, then at a second sequence length, and say what cp needs (see
    the module docstring); ``twins`` (:func:`twin_paths`) run as the first of their kind did."""
    if not seq_len or seq_len < 2:
        return ContextFacts("the inputs have no sequence dimension")
    first = _probe_once(model, args, kwargs, seq_len, batch, twins or {})
    other = _other_length(seq_len, first.sizes) if first.ran else None
    resized = _resized(args, kwargs, seq_len, other) if other else None
    if resized is None:  # no second length to check at: the verdict at S stands
        return first.facts if not first.facts.refusal else ContextFacts(first.facts.refusal)
    second = _probe_once(model, *resized, other, batch, twins or {})
    return _verdict(first, second, seq_len, other)


def _verdict(first: _Run, second: _Run, seq_len: int, other: int) -> ContextFacts:
    """The facts at S where the run at S' (whose size no other dimension has) agrees; see the module docstring."""
    agree = second.ran and not second.facts.refusal and second.shape() == first.shape()
    at = f" (checked again at sequence length {other}, a size no other dimension has"
    if first.facts.refusal:  # cleared only where S' ran the very same calls, none of them refused
        if agree and second.trace == first.trace:
            return replace(first.facts, refusal="")
        if second.ran and second.facts.refusal and second.facts.refusal != first.facts.refusal:
            return ContextFacts(f"{second.facts.refusal}{at})")  # the op that is no size coincidence
        return ContextFacts(first.facts.refusal)
    if not second.ran or agree:
        return first.facts
    if second.facts.refusal:
        return ContextFacts(f"{second.facts.refusal}{at}; at {seq_len} a dimension of that size passed for the "
                            "sequence)")
    return ContextFacts(f"its attention modules, heads or positions differ between sequence lengths {seq_len} and "
                        f"{other} (a dimension of size {seq_len} passed for the sequence)")


def _other_length(seq_len: int, seen: frozenset[int]) -> int | None:
    """A length below S (so that position caches and limits such as nanoGPT's ``block_size`` hold) that no
    dimension of the run at S has, divisible by as large a power of two as S allows (as models may need)."""
    step = seq_len & -seq_len
    while step >= 1:
        for length in range(seq_len - step, 1, -step):
            if length not in seen:
                return length
        step //= 2
    return None


def _resized(args: tuple, kwargs: dict, seq_len: int, other: int) -> tuple[tuple, dict] | None:
    """The inputs with their sequence dimension (dim 1 where it is S long, as capture found S) cut to
    ``other``; None where no input has one."""
    cut = []

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq_len:
            cut.append(t)
            return t.narrow(1, 0, other)
        return t
    out = pytree.tree_map(one, (args, kwargs))
    return (tuple(out[0]), dict(out[1])) if cut else None


def _probe_once(model: nn.Module, args: tuple, kwargs: dict, seq_len: int, batch: int,
                twins: dict[str, str]) -> _Run:
    """One forward under the probe at ``seq_len``."""
    shaped: dict[str, bool] = {}
    stack: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    probe = _Probe(seq_len, batch, stack)
    positions: list[str] = []
    inputs: dict[str, tuple] = {}

    def pre(module: nn.Module, a: tuple, kw: dict) -> None:
        name = names.get(id(module), "")
        inputs.setdefault(name, tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else None
                                      for t in a) + ((None,) if kw else ()))
        leaves = [t for t in pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)]
        given = any(id(t) in probe.tainted for t in leaves)
        if given and name and not any(name.startswith(p + ".") or name == p for p in positions):
            positions.append(name)
        stack.append(name)

    def post(module: nn.Module, a: tuple, out: Any) -> None:
        if stack.pop() in positions:  # what a positions module makes is right once its input is global
            for t in pytree.tree_leaves(out):
                probe.tainted.pop(id(t), None)

    before = _state(model)
    handles = _skipping(model, twins, shaped)
    handles += [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    on_meta = all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    # on meta as it is; else fake tensors: the probe reads shapes and calls only, so weights cost no compute
    fake = contextlib.nullcontext() if on_meta else FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with torch.no_grad(), fake, probe:
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 — a model the probe cannot run gets no cp, with the reason
        return _Run(ContextFacts(f"its forward could not be run to check it ({type(exc).__name__}: "
                                 f"{str(exc)[:120]})"), False)
    finally:
        for h in handles:
            h.remove()
        _restore(model, before)
    for where, nbytes in probe.manual.kv_bytes.items():  # hand-written attention's kᵀ and v: gathered alike
        probe.kv_bytes[where] = probe.kv_bytes.get(where, 0.0) + nbytes
    for where, nbytes in probe.manual.qo_bytes.items():  # and its q and output, heads: what Ulysses moves
        probe.qo_bytes[where] = probe.qo_bytes.get(where, 0.0) + nbytes
    for where, heads in probe.manual.heads.items():
        probe.kv_heads[where] = tuple(sorted({*probe.kv_heads.get(where, ()), *heads}))
    refusal = probe.problems[0] if probe.problems else probe.manual.unfinished()
    if not refusal and not probe.kv_bytes:
        refusal = "it calls no scaled_dot_product_attention (nothing to split attention across)"
    elif not refusal and "" in probe.kv_bytes:
        refusal = ("scaled_dot_product_attention is called outside any submodule (the runtime wraps the modules "
                   "that call it)")
    manual = {where: inputs.get(where, (None,)) for where in probe.manual.calls}
    facts = ContextFacts(refusal, tuple(positions), _copy_twins(probe.kv_bytes, twins, shaped),
                         _copy_twins(probe.calls, twins, shaped), _copy_twins(probe.qo_bytes, twins, shaped),
                         _copy_twins(probe.kv_heads, twins, shaped), _copy_twins(manual, twins, shaped))
    return _Run(facts, True, tuple(probe.trace), frozenset(probe.sizes))


__all__ = ["SEQUENCE_MIXING", "ContextFacts", "context_facts", "probe_layers", "twin_paths", "with_attention"]
