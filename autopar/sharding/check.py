"""Prove a tensor-parallel style right before it is offered: simulate its shards in one process.

For a layer module and a candidate Megatron style (column and row
projections), :func:`check_style` runs the layer once unsharded and once per
simulated tp rank — each rank in its own thread, under the same
:class:`~autopar.sharding.rules.ShardMode` the runtime uses, its
weights sliced from the full ones and its row projections' partial results
summed with the other ranks' — and compares every rank's output and the
gradients of the parameters and inputs with the unsharded run, in float64.
Dropout is off in both (no parallel plan reproduces one device's masks).

A fused projection's layout is read from the run: when the layer splits or
slices a column projection's output at points that are not segment
boundaries, the rules raise with those points and the check retries with
them as segments (``[q; k; v]`` blocks, GQA-shaped q/k/v, fused gate/up);
per-head interleaved q/k/v needs no segments (heads stay whole).

The layer runs on a real, small copy of its module: the module itself
(copied, weights redrawn) when it is small, or one built from the model's
config with narrower widths (:func:`autopar.sharding.copies.small_copy`) when it is large or on the
meta device with more parameters than :data:`MAX_CHECK_PARAMS`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from autopar.sharding.channel_ops import channel_params
from autopar.sharding.copies import layer_copy, real_value, shrink_inputs, small_copy
from autopar.sharding.layout import with_cuts
from autopar.sharding.replay import replayed_twins
from autopar.sharding.rules import OP_ATTR, NoShardRule, Projection, Reducer, ShardMode, SimulatedRank, current_mode
from autopar.sharding.whole import whole_tail

MAX_CHECK_PARAMS = 32_000_000  # a layer copy above this is rebuilt narrower from the model's config
# An exact rewrite differs from one device by rounding only: float64 runs agree to ~1e-15, and
# to ~1e-7 where the layer's own code computes in float32 (Hugging Face's RMSNorm upcasts, then
# casts back); a wrong one is off by 1e-2 or more.
TOLERANCE = 1e-6
MAX_RETRIES = 6
SEQ_DIM = 1  # sequence parallelism shares hidden states [batch, sequence, features] on the sequence


@dataclass(frozen=True)
class Pair:
    """One column → row group of a style, with the column outputs' segments (global sizes)."""

    columns: tuple[str, ...]
    rows: tuple[str, ...]


@dataclass
class CheckResult:
    """What the simulation proved: the segments per column (relative paths), the sizes tp must
    divide, the degrees simulated, and the worst relative error seen; or why it failed."""

    ok: bool
    segments: dict[str, tuple[int, ...]]
    divisors: tuple[int, ...] = ()
    degrees: tuple[int, ...] = ()
    error: float = 0.0
    reason: str = ""
    copy_segments: dict[str, tuple[int, ...]] | None = None  # ``segments`` at a narrower copy's sizes
    replicated: tuple[str, ...] = ()  # columns proved run whole on every rank (too few key/value heads)
    statistics: int = 0  # sums over a sharded dimension, all-reduced, per call of the layer
    statistic_values: float = 0.0  # the values those all-reduces carry per token, in all
    grad_sums: int = 0  # replicated tensors whose gradient is summed over the tp group (backward all-reduces)
    grad_sum_values: float = 0.0  # their elements per token of the simulated call, in all
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a column's segments run whole


# ------------------------------------------------------------------ hooks shared with the runtime


def install_projection_hooks(layer: nn.Module, columns: Iterable[str], rows: Iterable[str],
                             segments: dict[str, tuple[int, ...]], prefix: str = "",
                             whole: dict[str, tuple[int, ...]] | None = None) -> list[Any]:
    """Hooks telling the active :class:`ShardMode` which projection runs (paths relative to ``layer``).

    ``prefix`` is stripped from ``columns``/``rows``/``segments`` keys (full model paths); ``whole``
    names a fused column's segments every rank computes in full (:mod:`autopar.sharding.whole`)."""
    handles = []

    def rel(p: str) -> str:
        return p[len(prefix) + 1:] if prefix and p.startswith(prefix + ".") else p

    columns, rows = tuple(columns), tuple(rows)
    channels = channel_params(layer, tuple(rel(c) for c in columns), tuple(rel(r) for r in rows))
    for role, paths in (("column", columns), ("row", rows)):
        for path in paths:
            mod = layer.get_submodule(rel(path))
            proj = Projection(mod, path, role, tuple(segments.get(path, ())), tuple((whole or {}).get(path, ())))
            shared = channels.get(rel(path), ())

            def pre(module, args, proj=proj, shared=shared):
                mode = current_mode()
                if mode is None:
                    raise RuntimeError(f"{proj.path} ran outside its tensor-parallel layer")
                mode.projections.append(proj)
                if shared:  # the group's per-channel parameters, as this rank's shares from here on
                    mode.add_channels([(p, layer.get_parameter(p)) for p in shared])
                return mode.gather_input(proj, args)

            def post(module, args, output, proj=proj):
                mode = current_mode()
                if mode is not None and mode.projections:
                    mode.projections.pop()
                if mode is None:
                    return None
                if id(module) not in mode.consumed and output is not None:
                    # what the simulation proves is what the mesh runs: a projection whose weight
                    # never went through the rules would run whole here and as a shard there
                    raise NoShardRule(proj.path, "its forward never passed its weight to a projection "
                                      "form the rules shard (F.linear, addmm, x @ weight.T + bias)")
                return mode.scatter_output(proj, output)
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


# ------------------------------------------------------------------ inputs and copies


def record_inputs(model: nn.Module, args: tuple, kwargs: dict, paths: list[str]) -> dict[str, tuple]:
    """Run ``model`` once eagerly and keep the first (args, kwargs) each module of ``paths`` gets.

    On the meta device this costs nothing; a real model runs one forward without gradients.
    """
    seen: dict[str, tuple] = {}
    handles = []

    class _Done(Exception):
        pass

    for path in paths:
        def pre(module, a, k, path=path):  # noqa: ANN001
            if path not in seen:
                seen[path] = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (a, k))
                if len(seen) == len(paths):
                    raise _Done
        handles.append(model.get_submodule(path).register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad(), _MetaValues():
            model(*args, **kwargs)
    except _Done:
        pass
    finally:
        for h in handles:
            h.remove()
    return seen


def record_links(model: nn.Module, args: tuple, kwargs: dict, paths: list[str]) -> set[str]:
    """The modules of ``paths`` (in chain order) whose hidden state (:func:`hidden_input`) is the very
    tensor the previous one returned: the model hands it on untouched, so shares of it can pass."""
    hidden_in: dict[str, Any] = {}
    out: dict[str, Any] = {}
    handles = []
    # twins of the stack are run once per shape: this watches the code between blocks, not in them
    replay = replayed_twins(model, paths)
    for path in paths:
        def pre(module, a, k, path=path):  # noqa: ANN001
            found = hidden_input(a, k)
            hidden_in.setdefault(path, found[1] if found else None)

        def post(module, a, k, o, path=path):  # noqa: ANN001
            leaves = _floating_leaves(o)
            out.setdefault(path, leaves[0] if leaves else None)
        mod = model.get_submodule(path)
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad(), _MetaValues(), replay:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return {b for a, b in zip(paths, paths[1:])
            if hidden_in.get(b) is not None and hidden_in.get(b) is out.get(a)}


class _MetaValues(TorchFunctionMode):
    """Values for a meta model's data-dependent Python (``mask.all()`` in a ``if``): recording only
    needs the inputs' structure and shapes, so a meta scalar reads as true / one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "__bool__", "__int__", "__float__", "__index__", "tolist") and args \
                and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            t = args[0]
            one: Any = True if t.dtype == torch.bool or name == "__bool__" else 1.0 if t.is_floating_point() else 1
            if name == "tolist":
                return torch.ones(t.shape, dtype=t.dtype).tolist()
            return int(one) if name in ("__int__", "__index__") else float(one) if name == "__float__" else one
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------ the simulation


def _floating_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _first_tensor(out: Any) -> torch.Tensor:
    leaves = _floating_leaves(out)
    if not leaves:
        raise NoShardRule("output", "the layer returns no floating-point tensor")
    return leaves[0]


@torch.no_grad()
def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return float((a - b).norm() / max(float(b.norm()), floor))


@dataclass
class SequenceStats:
    """What a simulated run of a layer did: under sequence parallelism, the column projections each
    all-gather fed, and the elements of each replicated tensor whose gradient is summed over the tp
    group; always, how many statistics it all-reduced."""

    gathers: tuple[tuple[str, ...], ...] = ()
    grad_sums: tuple[int, ...] = ()
    statistics: int = 0  # sums over a sharded dimension, all-reduced (a norm over the whole query)
    statistic_values: float = 0.0  # their values per token of the hidden state, in all (Mamba's dt, B, C)
    grad_sum_values: float = 0.0  # the elements of ``grad_sums`` per token of the hidden state


def hidden_input(args: tuple, kwargs: dict) -> tuple[int | str, torch.Tensor] | None:
    """Where a layer's hidden state comes in: its first positional argument if that is a floating
    tensor, else a ``hidden_states`` keyword (Hugging Face's name); None if neither."""
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return 0, args[0]
    x = kwargs.get("hidden_states")
    return ("hidden_states", x) if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a call's hidden state (every dim but its features); 1 when it has none."""
    hidden = hidden_input(args, kwargs)
    return max(1, hidden[1].numel() // max(1, hidden[1].shape[-1])) if hidden is not None else 1


def with_hidden_input(args: tuple, kwargs: dict, where: int | str, x: torch.Tensor) -> tuple[tuple, dict]:
    if isinstance(where, int):
        return (x, *args[1:]), kwargs
    return args, {**kwargs, where: x}


def simulate(layer: nn.Module, inputs: tuple, pair_columns: tuple[str, ...], pair_rows: tuple[str, ...],
             segments: dict[str, tuple[int, ...]], tp: int, gen: torch.Generator,
             sequence: bool = False, stats: SequenceStats | None = None,
             whole: dict[str, tuple[int, ...]] | None = None) -> tuple[float, set[int]]:
    """Worst relative error of ``tp`` simulated ranks against the unsharded layer, and the sizes
    the rules divided by tp. Raises :class:`NoShardRule` where the layer cannot run sharded.

    ``sequence``: sequence parallelism — each rank gets its share of the hidden state's sequence
    (dim :data:`SEQ_DIM`) and must return its share of the output's; ``stats`` (if given) is
    filled with what the run gathered and summed."""
    args, kwargs = inputs
    layer.eval()
    leaves = [t for t in _floating_leaves((args, kwargs))]
    for t in leaves:
        t.requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    with ShardMode(SimulatedRank(1, 0, Reducer(1)), dropout=False):  # one device, dropout off
        ref = _first_tensor(layer(*args, **kwargs))
    cot = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
    ref_grads = torch.autograd.grad((ref * cot).sum(), [*params, *leaves], allow_unused=True)
    hidden, length = None, 0
    if sequence:
        hidden = hidden_input(args, kwargs)
        if hidden is None or hidden[1].dim() != 3:
            raise NoShardRule("sequence parallel", "the layer's hidden state (its first tensor argument) is not "
                              "[batch, sequence, features]")
        length = int(hidden[1].shape[SEQ_DIM])
        if length % tp or ref.dim() <= SEQ_DIM or ref.shape[SEQ_DIM] != length:
            raise NoShardRule("sequence parallel", f"tp={tp} does not divide the sequence ({length}), or the "
                              "output has another length")

    reducer = Reducer(tp)
    outs: list[torch.Tensor | None] = [None] * tp
    divisors: set[int] = set()
    failure: list[BaseException] = []
    handles = install_projection_hooks(layer, pair_columns, pair_rows, segments, whole=whole)

    def rank(r: int) -> None:
        try:
            with ShardMode(SimulatedRank(tp, r, reducer), dropout=False) as mode:
                a, k = args, kwargs
                if hidden is not None:
                    share = mode.enter_sequence(hidden[1].chunk(tp, SEQ_DIM)[r], SEQ_DIM, length)
                    a, k = with_hidden_input(args, kwargs, hidden[0], share)
                outs[r] = _first_tensor(layer(*a, **k))
            lay = mode.layout(outs[r])
            if hidden is not None and (lay is None or not lay.sequence or lay.dim != SEQ_DIM):
                raise NoShardRule("output", "sequence parallel: the layer's output is not its share of the sequence")
            if hidden is None and lay is not None:
                raise NoShardRule("output", "the layer's output is still sharded (no row projection closes it)")
            divisors.update(mode.divisors)
            if r == 0 and stats is not None:
                stats.gathers = tuple(tuple(g) for g in mode.gathers)
                stats.grad_sums = tuple(mode.grad_sums)
                stats.statistics = len(mode.stat_reduces)
                stats.statistic_values = sum(mode.stat_reduces) / _tokens(args, kwargs)
                stats.grad_sum_values = sum(mode.grad_sums) / _tokens(args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - carried to the caller's thread
            failure.append(exc)
            reducer.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(tp)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for h in handles:
            h.remove()
    real = [e for e in failure if not isinstance(e, threading.BrokenBarrierError)]
    if real or failure:
        raise (real or failure)[0]
    if hidden is not None:  # the ranks hold the pieces of one output
        total = sum((o * c).sum() for o, c in zip(outs, cot.chunk(tp, SEQ_DIM)))  # type: ignore[union-attr]
        whole = torch.cat(outs, SEQ_DIM)  # type: ignore[arg-type]
        worst = _rel(whole, ref, 1e-12 * float(ref.detach().norm()) + 1e-300)
    else:  # every rank holds the whole output
        total = sum((o * cot).sum() for o in outs) / tp  # type: ignore[operator]
        worst = max(_rel(o, ref, 1e-12 * float(ref.detach().norm()) + 1e-300) for o in outs)  # type: ignore[arg-type]
    grads = torch.autograd.grad(total, [*params, *leaves], allow_unused=True)
    # a tensor whose exact gradient is ~0 is judged against the largest gradient's scale
    floor = TOLERANCE * max((float(g.norm()) for g in ref_grads if g is not None), default=0.0) + 1e-300
    for g, gr in zip(grads, ref_grads):
        if gr is None and g is None:
            continue
        if gr is None or g is None:
            worst = max(worst, 1.0)
            continue
        worst = max(worst, _rel(g, gr, floor))
    return worst, divisors


def check_style(layer: nn.Module, inputs: tuple, columns: tuple[str, ...], rows: tuple[str, ...],
                widths: dict[str, int], degrees: Callable[[tuple[int, ...]], list[int]],
                seed: int = 0) -> CheckResult:
    """Simulate the style at tp = 2 (finding the segments), then at every further degree
    ``degrees(divisors)`` offers; the style is proved when all runs are within :data:`TOLERANCE`.

    ``columns``/``rows`` are paths relative to ``layer``; ``widths`` each column's output width.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulated ranks are threads: intra-op pools would fight over cores
    try:
        return _check_style(layer, inputs, columns, rows, widths, degrees, seed)
    finally:
        torch.set_num_threads(threads)


def _check_style(layer: nn.Module, inputs: tuple, columns: tuple[str, ...], rows: tuple[str, ...],
                 widths: dict[str, int], degrees: Callable[[tuple[int, ...]], list[int]], seed: int) -> CheckResult:
    segments: dict[str, tuple[int, ...]] = {c: (w,) for c, w in widths.items()}
    gen = torch.Generator().manual_seed(seed)
    divisors: set[int] = set()
    tried: list[int] = []
    first_failure = ""
    worst = 0.0
    todo = [2]
    retries = 0
    statistics, statistic_values, sums = 0, 0.0, SequenceStats()
    replicated: set[str] = set()  # columns run whole on every rank (key/value heads fewer than tp)
    whole: dict[str, tuple[int, ...]] = {}  # a fused column's segments run whole (its key/value rows)
    while todo:
        tp = todo.pop(0)
        active = tuple(c for c in columns if c not in replicated)
        stats = SequenceStats()
        try:
            err, divs = simulate(layer, _fresh(inputs), active, rows,
                                 {c: s for c, s in segments.items() if c not in replicated}, tp, gen, stats=stats,
                                 whole=whole)
        except NoShardRule as exc:
            tail = whole_tail(segments[exc.whole[0]], exc.whole[1]) \
                if exc.whole is not None and exc.whole[0] in segments and exc.whole[0] not in whole else ()
            if tail and not tried and retries < MAX_RETRIES:
                retries += 1
                whole[exc.whole[0]] = tail  # type: ignore[index]
                todo.insert(0, tp)
                continue
            fresh = [c for c in exc.replicate if c in segments and c not in replicated]
            if fresh and not tried and retries < MAX_RETRIES:
                retries += 1
                replicated.update(fresh)
                todo.insert(0, tp)
                continue
            if exc.hint is not None and exc.hint[0] in segments and retries < MAX_RETRIES:
                retries += 1
                merged = with_cuts(segments[exc.hint[0]], exc.hint[1])
                if merged != segments[exc.hint[0]]:
                    segments[exc.hint[0]] = merged
                    todo.insert(0, tp)
                    continue
            if _indivisible(exc) and not tried and tp < max(FIRST_DEGREES):
                todo = [next(d for d in FIRST_DEGREES if d > tp)]  # 25 heads: try 3, 5, 7 before giving up
                first_failure = first_failure or str(exc)
                continue
            return CheckResult(False, segments, reason=first_failure or str(exc))
        except Exception as exc:  # noqa: BLE001 - the layer's own code failed on shards
            return CheckResult(False, segments, reason=failed_op(exc))
        if err > TOLERANCE:
            return CheckResult(False, segments, error=err,
                               reason=f"simulated tp={tp} differs from one device by {err:.2e} (relative)")
        worst = max(worst, err)
        divisors.update(divs)
        for c, s in segments.items():
            if c not in replicated:
                divisors.update(x for i, x in enumerate(s) if i not in whole.get(c, ()))
        tried.append(tp)
        if len(tried) == 1:
            statistics, statistic_values, sums = stats.statistics, stats.statistic_values, stats
            todo = [d for d in degrees(tuple(sorted(divisors))) if d not in tried]
    return CheckResult(True, {c: s for c, s in segments.items() if c not in replicated}, tuple(sorted(divisors)),
                       tuple(tried), worst, replicated=tuple(c for c in columns if c in replicated),
                       statistics=statistics, statistic_values=statistic_values, whole=dict(whole),
                       grad_sums=len(sums.grad_sums), grad_sum_values=sums.grad_sum_values)


def check_sequence(layer: nn.Module, recorded: tuple, columns: tuple[str, ...], rows: tuple[str, ...],
                   segments: dict[str, tuple[int, ...]], degrees: tuple[int, ...], seed: int = 0,
                   ) -> tuple[tuple[int, ...], SequenceStats, str]:
    """Sequence parallelism on a proved style: simulated at each of ``degrees`` (the style's), with
    the sequence lengthened or shortened to a multiple of the degree where it is not one.

    ``recorded``: the layer's inputs as :func:`record_inputs` keeps them (made real here). Returns
    the degrees it is exact at, what the first run gathered and summed, and why it stopped if it
    did (empty when every degree passed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    stats, proved = SequenceStats(), []
    try:
        args, kwargs = recorded
        hidden = hidden_input(args, kwargs)
        if hidden is None or hidden[1].dim() != 3:
            return (), stats, "the layer's hidden state (its first tensor argument) is not [batch, sequence, features]"
        length = int(hidden[1].shape[SEQ_DIM])
        for tp in degrees:
            run = recorded if length % tp == 0 else shrink_inputs(recorded, {length: tp * max(1, length // tp)})
            try:
                err, _ = simulate(layer, real_inputs(run), columns, rows, segments, tp, gen, sequence=True,
                                  stats=stats if not proved else None)
            except NoShardRule as exc:
                return tuple(proved), stats, str(exc)
            except Exception as exc:  # noqa: BLE001 - the layer's own code failed on shares of the sequence
                return tuple(proved), stats, failed_op(exc)
            if err > TOLERANCE:
                return tuple(proved), stats, f"simulated tp={tp} differs from one device by {err:.2e} (relative)"
            proved.append(tp)
        return tuple(proved), stats, ""
    finally:
        torch.set_num_threads(threads)


def failed_op(exc: BaseException) -> str:
    """A refusal's reason for an error the layer's own code raised: the op it raised in, then the
    error (a refusal never goes without the op named)."""
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
    op = getattr(exc, OP_ATTR, None)
    return f"{op}: {what}" if op else what


FIRST_DEGREES = (2, 3, 5, 7)  # the degree the search starts at, until one divides the layer's sizes


def _indivisible(exc: NoShardRule) -> bool:
    return "does not divide" in exc.why or "cannot share exactly" in exc.why


def _fresh(inputs: tuple) -> tuple:
    """Leaf copies of the inputs, so each simulation has its own gradients."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, inputs)


def real_inputs(recorded: tuple, seed: int = 0) -> tuple:
    """Real float64 inputs for a layer copy; a key/value cache becomes None (each run starts empty)."""
    gen = torch.Generator().manual_seed(seed + 1)
    args, kwargs = recorded
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: (None if _is_cache(v) else False if k == "use_cache" else v) for k, v in kwargs.items()}
    return pytree.tree_map(lambda t: real_value(t, gen), (args, kwargs))


def _is_cache(value: Any) -> bool:
    return type(value).__name__.endswith("Cache")


__all__ = ["MAX_CHECK_PARAMS", "SEQ_DIM", "CheckResult", "Pair", "SequenceStats", "check_sequence", "check_style",
           "hidden_input", "record_links", "with_hidden_input", "install_projection_hooks", "layer_copy",
           "real_inputs", "record_inputs", "shrink_inputs", "simulate", "small_copy"]
