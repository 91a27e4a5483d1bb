"""A narrower copy of a layer's own class, for proving a tensor-parallel style on a layer too big to simulate.

The shard simulation (:mod:`autopar.sharding.check`) runs a layer in float64
once per simulated rank: at GPT-3's width (113M parameters a block) that is
minutes and gigabytes. A Hugging Face layer can be rebuilt narrower from its
config (:func:`autopar.sharding.check.small_copy`); a user's own block has no
config. Rebuilding it by calling its constructor again would need its
arguments, which nothing records. So :func:`narrow_copy` narrows the module
itself instead:

1. trace the layer's forward once on meta at full width (:func:`trace`):
   every torch call with the integers it takes and returns (shapes, split
   sizes, view shapes), at a short probe batch and sequence;
2. find the head split (a ``view``/``reshape`` of a width ``W`` into ``(H, D)``
   with ``H·D = W``) and choose one factor ``f`` dividing every width and
   every head width, keeping the head count and each head ≥ 4 wide (where
   a head count equals a head width, both are narrowed by ``f`` and the
   other widths by ``f²``: see :func:`_size_maps`);
3. deep-copy the module on meta with each parameter and buffer narrowed
   (every dimension equal to a width ``W`` becomes ``W/f``) and every
   integer attribute in the module tree that equals a width rewritten the
   same way (``self.n_embd``, ``self.head_dim``, ``Linear.in_features``,
   ``LayerNorm.normalized_shape``): the size map full → narrow;
4. :func:`isomorphic`: trace the copy and require the very same torch calls
   with every integer mapped by the size map. This is what carries the
   numerical proof on the copy to the real size: the copy is the layer's
   own program with its widths renamed, op for op. Where the map is
   ambiguous (a narrowed size equals a size the layer uses in another role:
   a batch, a sequence, a head count) no factor is taken; where the programs
   differ (a width hard-coded in the layer, a branch on the width, an
   attribute the rewrite cannot reach) the copy is refused, naming the op.

Head counts are kept (not narrowed), or narrowed only to one with the same
divisors among the simulated degrees, so every divisibility the tp degree
meets in the copy is the real one's; what only the real sizes can show (the
real sequence, degrees beyond the simulated ones) is the shape proof's job
(:mod:`autopar.sharding.shapes`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

HARD_PARAMS = 64_000_000  # a copy above this is refused rather than simulated
MIN_HEAD = 4  # a narrowed head keeps at least this many features
MIN_WIDTH = 16  # without heads, the narrowest width kept
PROBE_BATCH = 2  # the traces' batch (meta: any size costs nothing)
SIMULATED = tuple(range(2, 9))  # the tp degrees the copy is simulated at (verify.DEGREES)
PROBE_SEQS = (16, 12, 24, 8, 20, 40, 10, 6)  # the traces' sequence: the first that is no width of the layer


class NarrowRefused(Exception):  # noqa: N818 - a reason carried to the style's refusal
    """Why no narrower copy proves the layer (an op, an ambiguity)."""


@dataclass(frozen=True)
class Op:
    """One torch call of a trace: its name, every integer it took (tensor shapes, sizes, split
    points, slice bounds) and every integer it returned."""

    name: str
    ints: tuple[int, ...]
    out: tuple[int, ...]
    in_shape: tuple[int, ...] = ()  # its first tensor argument's shape (to find head splits)
    out_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class NarrowCopy:
    """A meta module of the layer's class, ``factor`` times narrower, and its inputs (meta, at the
    probe batch and sequence); ``sizes`` maps each full width to its narrow one."""

    module: nn.Module
    inputs: tuple
    sizes: dict[int, int]
    factor: int
    heads: tuple[int, ...]


def _ints(value: Any, out: list[int]) -> None:
    if isinstance(value, torch.Tensor):
        out.extend(int(s) for s in value.shape)
    elif isinstance(value, bool):
        out.append(int(value))
    elif isinstance(value, int):
        out.append(value)
    elif isinstance(value, torch.SymInt):
        out.append(int(value))
    elif isinstance(value, slice):
        for v in (value.start, value.stop, value.step):
            if isinstance(v, int):
                out.append(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _ints(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _ints(v, out)


def _first_shape(value: Any) -> tuple[int, ...]:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return tuple(int(s) for s in leaf.shape)
    return ()


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins: list[int] = []
        outs: list[int] = []
        _ints((args, kwargs), ins)
        _ints(out, outs)
        name = getattr(func, "__name__", str(func))
        self.ops.append(Op(name, tuple(ins), tuple(outs), _first_shape(args), _first_shape(out)))
        return out


def meta_module(module: nn.Module, sizes: dict[int, int] | None = None) -> nn.Module:
    """A deep copy of ``module`` on meta (no weight is copied), every parameter and buffer
    dimension and every integer attribute equal to a key of ``sizes`` replaced by its value."""
    sizes = sizes or {}
    memo: dict[int, Any] = {}
    for p in module.parameters():
        shape = [sizes.get(int(s), int(s)) for s in p.shape]
        memo[id(p)] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty([sizes.get(int(s), int(s)) for s in b.shape], dtype=b.dtype, device="meta")
    clone = copy.deepcopy(module, memo)
    if sizes:
        for m in clone.modules():
            for key, value in list(vars(m).items()):
                if key.startswith("_"):
                    continue
                if isinstance(value, int) and not isinstance(value, bool) and value in sizes:
                    setattr(m, key, sizes[value])
                elif isinstance(value, tuple) and value and all(type(v) is int for v in value) \
                        and any(v in sizes for v in value):
                    setattr(m, key, tuple(sizes.get(v, v) for v in value))
    return clone


def probe_inputs(recorded: tuple, widths: dict[int, int], batch: int, seq: int | None,
                 probe_seq: int | None = None) -> tuple:
    """``recorded`` (args, kwargs) as meta tensors: the last dimension renamed by ``widths`` first
    (features), the others by batch → :data:`PROBE_BATCH` and sequence → ``probe_seq`` first;
    a key/value cache dropped as :func:`autopar.sharding.check.real_inputs` does."""
    lead = {batch: PROBE_BATCH}
    if seq is not None and probe_seq is not None:
        lead[seq] = probe_seq

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return None if type(t).__name__.endswith("Cache") else t
        shape = []
        for i, s in enumerate(int(d) for d in t.shape):
            first, second = (widths, lead) if i == t.dim() - 1 and t.dim() > 1 else (lead, widths)
            shape.append(first.get(s, second.get(s, s)))
        return torch.empty(shape, dtype=t.dtype, device="meta")
    args, kwargs = recorded
    args = pytree.tree_map(one, args)
    kwargs = {k: (False if k == "use_cache" else pytree.tree_map(one, v)) for k, v in kwargs.items()}
    return args, kwargs


def trace(module: nn.Module, inputs: tuple) -> list[Op]:
    """Every torch call ``module``'s forward makes on ``inputs`` (meta), in order."""
    from autopar.sharding.check import _MetaValues  # the same answers to data-dependent Python

    args, kwargs = inputs
    rec = _Recorder()
    with torch.no_grad(), _MetaValues(), rec:
        module(*args, **kwargs)
    return rec.ops


def head_splits(ops: Iterable[Op]) -> set[tuple[int, int]]:
    """(heads, head width) of every view/reshape that splits a last dimension ``H·D`` into ``(H, D)``;
    a split into pairs that ``view_as_complex`` reads (rotary embeddings as complex numbers) is no head
    split (see :func:`complex_pairs`)."""
    found = set()
    ops = list(ops)
    for op, after in zip(ops, [*ops[1:], None]):
        if op.name not in ("view", "reshape", "unflatten") or not op.in_shape or not op.out_shape:
            continue
        i, o = op.in_shape, op.out_shape
        if len(o) == len(i) + 1 and o[:-2] == i[:-1] and o[-2] > 1 and o[-1] > 1 and o[-2] * o[-1] == i[-1] \
                and not _complex_split(op, after):
            found.add((o[-2], o[-1]))
    return found


def _complex_split(op: Op, after: Op | None) -> bool:
    return op.out_shape[-1] == 2 and after is not None and after.name == "view_as_complex" \
        and after.in_shape == op.out_shape


def complex_pairs(ops: Iterable[Op]) -> set[int]:
    """The pair counts ``D/2`` of every head width ``D`` split into pairs for ``view_as_complex``: a width
    that scales with ``D`` (Meta's Llama: its ``freqs_cis`` holds ``D/2`` complex numbers a position)."""
    return {int(op.in_shape[-2]) for op in ops if op.name == "view_as_complex" and len(op.in_shape) >= 2}


def _divisors_desc(n: int) -> list[int]:
    return sorted({d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k)}, reverse=True)


def _param_widths(module: nn.Module) -> set[int]:
    sizes: set[int] = set()
    for p in module.parameters():
        sizes.update(int(s) for s in p.shape)
    return sizes


def narrow_copy(module: nn.Module, recorded: tuple, batch: int, seq: int | None) -> NarrowCopy:
    """``module`` narrowed (see the module docstring), proved isomorphic to the full layer by
    tracing both; raises :class:`NarrowRefused` with the reason otherwise."""
    full_mod = meta_module(module)
    params = _param_widths(module)
    probes = [p for p in PROBE_SEQS if seq is None or p <= seq] + ([seq] if seq is not None else [])
    n_params = sum(p.numel() for p in module.parameters())
    why = ""
    for probe in probes:  # a probe sequence that is no width (a size with one role) and a factor it admits
        full_in = probe_inputs(recorded, {}, batch, seq, probe)
        try:
            full = trace(full_mod, full_in)
        except Exception as exc:  # noqa: BLE001 - the layer's forward does not run on meta
            raise NarrowRefused(f"its forward does not run on the meta device ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
        splits = head_splits(full)
        head_widths = sorted({d for _, d in splits})
        heads = tuple(sorted({h for h, _ in splits}))
        if head_widths:
            widths = {s for s in params if any(s % d == 0 for d in head_widths) and s not in heads} | set(head_widths)
            widths |= {n for n in complex_pairs(full) if 2 * n in widths}
            least, floor = min(head_widths), MIN_HEAD
        else:
            widths = {s for s in params if s >= MIN_WIDTH}
            least, floor = (min(widths) if widths else 0), MIN_WIDTH
        if not widths:
            raise NarrowRefused("it has no width to narrow")
        joint = bool(widths & set(heads))  # a head count equal to a width: narrowed with it (see _size_maps)
        taken = widths | set(heads) if joint else widths
        if probe in taken or PROBE_BATCH in taken:
            why = why or (f"its sequence or batch is one of its widths {sorted(widths)}, so a narrower copy "
                          "cannot tell them apart")
            continue
        unmapped = {v for op in full for v in (*op.ints, *op.out) if v not in taken}
        # the narrowest map whose narrowed sizes read as none of the layer's other sizes (at this probe)
        found = next(((f, sizes) for f, sizes in _size_maps(widths, set(head_widths), set(heads), least, floor)
                      if not set(sizes.values()) & unmapped and len(set(sizes.values())) == len(sizes)), None)
        if found is None:
            if joint:
                why = (f"the size {min(widths & set(heads))} is both a width and a head count, and no factor "
                       "narrows both alike keeping the head count's divisors up to "
                       f"{max(SIMULATED)} and each head >= {floor} wide")
            else:
                why = f"no factor narrows its widths {sorted(widths)} unambiguously (each head kept >= {floor} wide)"
            continue  # another probe sequence may free the size a narrowed width would read as
        f, sizes = found
        small = meta_module(module, sizes)
        small_params = sum(p.numel() for p in small.parameters())
        if small_params > HARD_PARAMS:
            raise NarrowRefused(f"its narrowest copy still has {small_params:,} parameters")
        small_in = probe_inputs(recorded, sizes, batch, seq, probe)
        try:
            narrow = trace(small, small_in)
        except Exception as exc:  # noqa: BLE001 - the copy's forward fails: its code does not scale
            raise NarrowRefused(f"a {f}x narrower copy of it fails ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:120] if str(exc) else ''}): its code does not "
                                "scale with its widths") from None
        differs = isomorphic(full, narrow, sizes)
        if differs:
            raise NarrowRefused(f"{differs} (a {f}x narrower copy of its {n_params:,} parameters)")
        return NarrowCopy(small, small_in, sizes, f, tuple(sorted({sizes.get(h, h) for h in heads})))
    raise NarrowRefused(why)


def _size_maps(widths: set[int], head_widths: set[int], heads: set[int], least: int,
               floor: int) -> Iterable[tuple[int, dict[int, int]]]:
    """Candidate size maps full → narrow, narrowest first, each with its factor ``f``.

    Usually head counts are kept and every width is divided by ``f``. Where a head count equals a
    width (Megatron's 310B and 1T rows: 128 heads of 128, 160 of 160) one integer has two roles, and
    keeping one while narrowing the other would not be a renaming at all. The map must stay a
    function, so both are narrowed alike: head counts and head widths by ``f``, every other width
    (a multiple of heads × head width) by ``f²``. It is still one injective map applied to every
    integer, so :func:`isomorphic` can check the copy is the same program. Only the tp degrees the
    copy simulates could change: ``f`` is taken only where every head count keeps exactly the
    divisors in :data:`SIMULATED` it had (128 → 8 keeps 2, 4, 8), so the degrees proved numerically
    are the real layer's, and the larger ones stay the shape proof's at the real size."""
    both = widths & heads
    if not both:
        for f in _divisors_desc(math.gcd(*widths)):
            if f > 1 and least // f >= floor:
                yield f, {w: w // f for w in widths}
        return
    others = widths - head_widths - heads
    for f in _divisors_desc(math.gcd(*head_widths, *heads)):
        if f == 1 or least // f < floor or any(w % (f * f) for w in others):
            continue
        if any(_simulated_divisors(h // f) != _simulated_divisors(h) for h in heads):
            continue
        sizes = {w: w // (f * f) for w in others}
        sizes.update({d: d // f for d in head_widths | heads})
        yield f, sizes


def _simulated_divisors(n: int) -> tuple[int, ...]:
    return tuple(t for t in SIMULATED if n % t == 0)


def isomorphic(full: list[Op], narrow: list[Op], sizes: dict[int, int]) -> str:
    """Empty when ``narrow`` makes the same calls as ``full`` with every integer renamed by ``sizes``;
    else the first op where they part."""
    for a, b in zip(full, narrow):
        want = tuple(sizes.get(v, v) for v in a.ints)
        got_out = tuple(sizes.get(v, v) for v in a.out)
        if a.name != b.name:
            return f"{a.name}: the narrower copy runs {b.name} here instead, so its code depends on its widths"
        if want != b.ints or got_out != b.out:
            return (f"{a.name}: takes {_short(a.ints)} at full width, but {_short(b.ints)} in the narrower copy "
                    f"(expected {_short(want)}): a size in it does not scale with the layer's widths")
    if len(full) != len(narrow):
        return (f"the narrower copy makes {len(narrow)} torch calls where the layer makes {len(full)}, so its "
                "code depends on its widths")
    return ""


def _short(ints: tuple[int, ...]) -> str:
    return str(list(ints[:12]))[:-1] + (", ...]" if len(ints) > 12 else "]")


__all__ = ["HARD_PARAMS", "NarrowCopy", "NarrowRefused", "Op", "head_splits", "isomorphic",
           "meta_module", "narrow_copy", "probe_inputs", "trace"]
