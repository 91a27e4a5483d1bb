"""Offer a Megatron style only once it is proved exact: numerically on a small copy, by shapes at full size.

:func:`verify_styles` takes the captured layers with their *candidate*
Megatron styles (:mod:`autopar.sharding.detect` finds column → row
projection groups from the graph) and, for one layer of each group of
identical layers, proves the style twice:

* numerically: :func:`autopar.sharding.check.check_style` simulates the
  shards at tp = 2 … 8 on a real copy of the layer — the module itself when
  it has at most ``MAX_CHECK_PARAMS`` parameters, else one rebuilt narrower
  from the model's config, else a narrower copy of the module itself
  (:mod:`autopar.sharding.narrow`, proved to run the same program with its
  widths renamed);
* by shapes: :func:`autopar.sharding.shapes.prove_shapes` runs the same
  rules at the layer's real size on meta, at every degree up to
  ``shapes.MAX_DEGREE`` that its real sizes admit (why a proof at the
  simulated degrees carries to the larger ones: see that module).

A proved style gets its fused projections' segments (at the real size),
the sizes tp must divide and the degrees proved (``checked``); a failed
one is withdrawn and the layer records why (``Layer.tp_refusal``: the op
that stopped it, with "at the layer's real size" when only the real size
shows it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.graph import Layer
from autopar.sharding import check as shard_check
from autopar.sharding import narrow, shapes
from autopar.sharding.channel_ops import channel_params
from autopar.sharding.collectives import with_statistics, with_whole, without_replicated
from autopar.sharding.layout import NoShardRule
from autopar.sharding.rules import projection_dims
from autopar.tp_style import TPStyle

SHORT_SEQ = 16  # the sequence length a small layer is simulated at when the example's is longer
DEGREES = tuple(range(2, 9))  # simulated numerically (threads in one process); larger ones by shapes only


def _degrees(divisors: tuple[int, ...]) -> list[int]:
    return [t for t in DEGREES if all(d % t == 0 for d in divisors)]


def _config(model: nn.Module, module: nn.Module) -> Any:
    for owner in (module, model):
        for name in ("config", "cfg"):
            value = getattr(owner, name, None)
            if value is not None and not isinstance(value, (int, float, str, nn.Module)):
                return value
    return None


def _signature(module: nn.Module, style: TPStyle, prefix: str) -> tuple:
    """Layers with equal signatures are twins: one simulation proves (or refutes) them all."""
    def rel(p: str) -> str:
        return p[len(prefix) + 1:]

    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return (type(module), shapes, tuple(map(rel, style.column)), tuple(map(rel, style.row)))


def _short_records(model: nn.Module, args: tuple, kwargs: dict, paths: list[str], batch: int,
                   seq_len: int | None) -> dict[str, tuple]:
    """Each layer's inputs recorded from the model's own forward on its example cut to
    ``SHORT_SEQ`` positions (every input dimension of the sequence's length), for the numerical
    proof; empty where that cannot be told apart or the model refuses the shorter example.

    Shrinking a layer's recorded inputs maps sizes by value, so where the sequence is as long as
    a width (Llama 3 70B: 8192 of both) the copy would keep the width's length, and attention
    over it costs seconds; the model's own forward gives the short inputs with no such clash."""
    if not seq_len or seq_len <= SHORT_SEQ or batch == seq_len:
        return {}

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        for d, size in enumerate(t.shape):
            if int(size) == seq_len:
                t = t.narrow(d, 0, SHORT_SEQ)
        return t

    short_args, short_kwargs = pytree.tree_map(cut, (args, kwargs))
    try:
        return shard_check.record_inputs(model, short_args, short_kwargs, paths)
    except Exception:  # noqa: BLE001 - the longer records still serve (shrunk by value)
        return {}


def _lacks(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return True
    return False


def _check(model: nn.Module, module: nn.Module, style: TPStyle, prefix: str, recorded: tuple,
           batch: int, seq_len: int | None,
           short: tuple | None = None) -> tuple[shard_check.CheckResult, nn.Module | None, tuple]:
    """The style's simulation, and the layer copy and recorded-form inputs it was proved on
    (``short``: the layer's inputs recorded at ``SHORT_SEQ`` positions, tried first)."""
    gen = torch.Generator().manual_seed(0)
    cols = tuple(p[len(prefix) + 1:] for p in style.column)
    rows = tuple(p[len(prefix) + 1:] for p in style.row)
    n_params = sum(p.numel() for p in module.parameters())
    if n_params <= shard_check.MAX_CHECK_PARAMS:
        copy, inputs = shard_check.layer_copy(module, gen), recorded
        if seq_len and seq_len > SHORT_SEQ:  # attention over a long sequence costs seconds: check a short one
            for shrunk in (short, shard_check.shrink_inputs(recorded, {seq_len: SHORT_SEQ})):
                if shrunk is None:
                    continue
                result = _check_inputs(copy, cols, rows, shrunk)
                if result is not None and result.ok:
                    return result, copy, shrunk
    else:
        config = _config(model, module)
        if short is not None:
            built = shard_check.small_copy(module, config, gen, {})
            if built is not None and not any(_lacks(built[0], p) for p in cols + rows):
                copy, mapping = built
                mapping.setdefault(batch, 1)
                shrunk = shard_check.shrink_inputs(short, mapping)
                result = _check_inputs(copy, cols, rows, shrunk)
                if result is not None and result.ok:
                    return _scaled_segments(module, cols, result), copy, shrunk
        lengths = {seq_len: SHORT_SEQ} if seq_len and seq_len > SHORT_SEQ else {}
        built = shard_check.small_copy(module, config, gen, lengths)
        if built is not None:
            copy, mapping = built
            mapping.setdefault(batch, 1)
            inputs = shard_check.shrink_inputs(recorded, mapping)
        else:  # no config: narrow the module itself (proved to run the same program, widths renamed)
            try:
                narrowed = _narrowed(module, recorded, short, batch, seq_len)
            except narrow.NarrowRefused as exc:
                return shard_check.CheckResult(False, {}, reason=f"too large to simulate ({n_params:,} parameters) "
                                               f"and no narrower copy of it runs the same program: {exc}"), \
                    None, recorded
            copy, inputs = shard_check.layer_copy(narrowed.module, gen), narrowed.inputs
    missing = [p for p in cols + rows if _lacks(copy, p)]
    if missing:  # e.g. a copy of DeepSeek-V3's decoder class built at a dense layer's index: not this layer
        return shard_check.CheckResult(False, {}, reason=f"too large to simulate ({n_params:,} parameters) and "
                                       f"the narrower copy of its class has no {missing[0]}"), None, recorded
    result = _check_inputs(copy, cols, rows, inputs)
    if result is None:
        return shard_check.CheckResult(False, {}, reason="a column projection is not a Linear or Conv1D"), None, inputs
    if result.ok and n_params > shard_check.MAX_CHECK_PARAMS:
        result = _scaled_segments(module, cols, result)
    return result, copy, inputs


def _narrowed(module: nn.Module, recorded: tuple, short: tuple | None, batch: int,
              seq_len: int | None) -> narrow.NarrowCopy:
    """A narrower copy of ``module`` (:func:`narrow.narrow_copy`), traced from its inputs recorded at
    ``SHORT_SEQ`` positions where there are such (``short``), else at the example's: a sequence as long
    as a width (Llama-2-7B's 4,096 of both) has two roles in the example's records, which a narrower
    copy cannot tell apart; at the second length it has one. What the real sequence changes is the shape
    proof's at the real size (:func:`_prove_at_size`)."""
    tries = [(short, SHORT_SEQ)] if short is not None else []
    tries.append((recorded, seq_len))
    refused: narrow.NarrowRefused | None = None
    for rec, length in tries:
        hidden = shard_check.hidden_input(*rec)
        b, t = (int(hidden[1].shape[0]), int(hidden[1].shape[1])) if hidden is not None and \
            hidden[1].dim() == 3 else (batch, length)
        try:
            return narrow.narrow_copy(module, rec, b, t)
        except narrow.NarrowRefused as exc:
            refused = refused or exc  # the first length's reason: the one with a size of one role
    raise refused  # type: ignore[misc]


def _scaled_segments(module: nn.Module, cols: tuple[str, ...],
                     result: shard_check.CheckResult) -> shard_check.CheckResult:
    """``result`` proved on a narrower copy, with its segments scaled back to the module's own
    widths (the same fractions of each projection)."""
    full = {c: projection_dims(module.get_submodule(c))[1] for c in cols}  # type: ignore[index]
    segments = {}
    for c, segs in result.segments.items():
        factor = full[c] // sum(segs)
        segments[c] = tuple(s * factor for s in segs)
    return dataclasses.replace(result, segments=segments, copy_segments=result.segments)


def _prove_at_size(module: nn.Module, style: TPStyle, prefix: str, recorded: tuple,
                   result: shard_check.CheckResult, simulated_whole: bool = False) -> shard_check.CheckResult:
    """``result`` (the numerical proof) with the degrees the shape proof at the layer's real size
    admits: the simulated ones it confirms and every larger one up to ``shapes.MAX_DEGREE`` the real
    sizes admit; withdrawn (naming the op) where a simulated degree fails at the real size.
    ``simulated_whole``: the numerical proof ran the layer itself at its real size on its recorded
    inputs, so an op with no meta kernel (a torchtitan MoE's ``bincount``) leaves the simulated
    degrees proved, and offers no larger one."""
    cols = tuple(c for c in (p[len(prefix) + 1:] for p in style.column) if c not in result.replicated)
    rows = tuple(p[len(prefix) + 1:] for p in style.row)
    n_params = sum(p.numel() for p in module.parameters())
    full = narrow.meta_module(module)
    inputs = shapes.meta_inputs(recorded)

    no_meta: list[bool] = []

    def attempt(tp: int) -> tuple[set[int] | None, str, bool]:
        try:
            return shapes.prove_shapes(full, inputs, cols, rows, result.segments, tp, whole=result.whole), "", False
        except NoShardRule as exc:
            return None, str(exc), "does not divide" in exc.why or "cannot share exactly" in exc.why
        except Exception as exc:  # noqa: BLE001 - the layer's own code failed at its real size
            no_meta.append(isinstance(exc, NotImplementedError) and "Meta" in str(exc))
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}", False

    first = result.degrees[0]
    divisors, why, _ = attempt(first)
    if divisors is None and simulated_whole and no_meta and no_meta[-1]:
        return result
    if divisors is None:
        return dataclasses.replace(result, ok=False, reason=f"{why} (at the layer's real size, {n_params:,} "
                                   f"parameters, tp={first})")
    proved = [first]
    for tp in shapes.degrees_to_try(divisors):
        if tp == first or (tp <= max(DEGREES) and tp not in result.degrees):
            continue  # a small degree the numerical proof did not run is not offered
        found, why, indivisible = attempt(tp)
        if found is not None:
            proved.append(tp)
        elif tp in result.degrees and not indivisible:
            return dataclasses.replace(result, ok=False, reason=f"{why} (at the layer's real size, {n_params:,} "
                                       f"parameters, tp={tp})")
    return dataclasses.replace(result, divisors=tuple(sorted(divisors)), degrees=tuple(sorted(proved)))


def _full_size(copy: nn.Module, path: str, model: nn.Module) -> bool:
    """Whether ``copy`` has the layer's own sizes (not a narrowed copy)."""
    mine = model.get_submodule(path)
    return [p.shape for p in copy.parameters()] == [p.shape for p in mine.parameters()]


def _sequence_fields(model: nn.Module, module: nn.Module, copy: nn.Module, result: shard_check.CheckResult,
                     cols: tuple[str, ...], rows: tuple[str, ...], used: tuple, recorded: tuple) -> dict[str, Any]:
    """TPStyle's sequence-parallel fields: simulated on the copy the style was proved on, costed at the
    model's own sizes (the recorded hidden state's length and width, the projections' widths)."""
    if result.whole:
        return {"sequence_refusal": "sequence parallelism beside key/value rows run whole is not ruled"}
    hidden = shard_check.hidden_input(*recorded)
    if hidden is None or hidden[1].dim() != 3:
        return {"sequence_refusal": "the layer's hidden state (its first tensor argument) is not "
                                    "[batch, sequence, features]"}
    length, width = int(hidden[1].shape[shard_check.SEQ_DIM]), int(hidden[1].shape[-1])
    degrees = tuple(d for d in result.degrees if length % d == 0 and d <= max(DEGREES))  # simulated ones
    if not degrees:
        return {"sequence_refusal": f"no tp degree the style runs at divides the sequence ({length})"}
    segs = result.copy_segments or result.segments
    proved, stats, why = shard_check.check_sequence(copy, used, cols, rows, segs, degrees)
    if not proved:
        return {"sequence_refusal": why}
    if not why:  # every simulated degree passed: the larger ones by shapes at the real size
        full, inputs = narrow.meta_module(module), shapes.meta_inputs(recorded)
        for tp in (d for d in result.degrees if d > max(DEGREES) and length % d == 0):
            try:
                shapes.prove_shapes(full, inputs, cols, rows, result.segments, tp, sequence=True)
            except Exception:  # noqa: BLE001 - not offered at this degree (the plain style still is)
                continue
            proved = (*proved, tp)
    copy_hidden = shard_check.hidden_input(*used)
    scale = width / int(copy_hidden[1].shape[-1]) if copy_hidden is not None else 1.0  # type: ignore[index]
    gathered = sum(projection_dims(module.get_submodule(g[0]))[0] for g in stats.gathers)  # type: ignore[index]
    return {"sequence": proved, "sequence_refusal": why,
            "sequence_gathers": len(stats.gathers), "sequence_gather_elems": float(gathered * length),
            "sequence_grad_sums": len(stats.grad_sums),
            "sequence_grad_sum_elems": int(round(sum(stats.grad_sums) * scale)),
            "sequence_stream_elems": float(length * width)}


def _check_inputs(copy: nn.Module, cols: tuple[str, ...], rows: tuple[str, ...],
                  inputs: tuple) -> shard_check.CheckResult | None:
    widths = {}
    for c in cols:
        dims = projection_dims(copy.get_submodule(c))
        if dims is None:
            return None
        widths[c] = dims[1]
    return shard_check.check_style(copy, shard_check.real_inputs(inputs), cols, rows, widths, _degrees)


def verify_styles(model: nn.Module, args: tuple, kwargs: dict, layers: list[Layer], batch: int,
                  seq_len: int | None) -> list[Layer]:
    """``layers`` with every Megatron style proved by simulation or withdrawn (with the reason)."""
    todo = [i for i, l in enumerate(layers) if l.module_path and any(s.name == "megatron" for s in l.tp_styles)]
    if not todo:
        return layers
    groups: dict[tuple, list[int]] = {}
    for i in todo:
        layer = layers[i]
        style = next(s for s in layer.tp_styles if s.name == "megatron")
        module = model.get_submodule(layer.module_path)  # type: ignore[arg-type]
        groups.setdefault(_signature(module, style, layer.module_path), []).append(i)  # type: ignore[arg-type]
    firsts = [layers[members[0]].module_path for members in groups.values()]
    try:
        recorded = shard_check.record_inputs(model, args, kwargs, firsts)  # type: ignore[arg-type]
        failure = ""
    except Exception as exc:  # noqa: BLE001 - the style cannot be proved, so it is not offered
        recorded, failure = {}, f"running the model's forward to record the layer's inputs failed: " \
                                f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    short = _short_records(model, args, kwargs, firsts, batch, seq_len) if recorded else {}
    linked: set[str] | None = None  # recorded by a whole forward: only once a style needs it
    out = list(layers)
    for members in groups.values():
        first = layers[members[0]]
        path = first.module_path
        style = next(s for s in first.tp_styles if s.name == "megatron")
        rec = recorded.get(path)  # type: ignore[arg-type]
        if rec is None:
            result = shard_check.CheckResult(False, {}, reason=failure or "the model's forward never called "
                                             f"{path} as a module")
        else:
            result, copy, used = _check(model, model.get_submodule(path), style, path, rec, batch, seq_len,  # type: ignore[arg-type]
                                        short.get(path))  # type: ignore[arg-type]
            if result.ok:
                at_size = used is rec and copy is not None and _full_size(copy, path, model)  # type: ignore[arg-type]
                result = _prove_at_size(model.get_submodule(path), style, path, rec, result,  # type: ignore[arg-type]
                                        simulated_whole=at_size)
        sequence: dict[str, Any] = {}
        if result.ok and copy is not None:
            cols = tuple(c for c in (p[len(path) + 1:] for p in style.column)  # type: ignore[arg-type]
                         if c not in result.replicated)
            rows = tuple(p[len(path) + 1:] for p in style.row)  # type: ignore[arg-type]
            sequence = _sequence_fields(model, model.get_submodule(path), copy, result, cols, rows, used, rec)  # type: ignore[arg-type]
        if sequence.get("sequence") and linked is None:
            linked = _links(model, args, kwargs, layers)
        if sequence.get("sequence") and not all(layers[i].module_path in linked for i in members if i - 1 in members):
            sequence = {"sequence_refusal": "the model does not hand each block's hidden state straight to the next, "
                                            "so their shares of the sequence cannot pass between them"}
        for i in members:
            layer = layers[i]
            style = next(s for s in layer.tp_styles if s.name == "megatron")
            others = tuple(s for s in layer.tp_styles if s.name != "megatron")
            if result.ok:
                style = without_replicated(style, model.get_submodule(layer.module_path), layer.module_path,  # type: ignore[arg-type]
                                           result.replicated, seq_len or 1)
                module = model.get_submodule(layer.module_path)  # type: ignore[arg-type]
                rel = len(layer.module_path) + 1  # type: ignore[arg-type]
                # a Mamba mixer's backward sums its replicated dt, B, C and x_proj weight (channel_ops.py)
                summed = (result.grad_sums, result.grad_sum_values) if channel_params(
                    module, tuple(c[rel:] for c in style.column), tuple(r[rel:] for r in style.row)) else None
                style = with_statistics(style, result.statistics, seq_len or 1, result.statistic_values, summed)
                style = with_whole(style, model.get_submodule(layer.module_path), layer.module_path,  # type: ignore[arg-type]
                                   result.whole, result.segments, seq_len or 1)
                proved = dataclasses.replace(
                    style, divisors=tuple(sorted(set(style.divisors) | set(result.divisors))),
                    segments={f"{layer.module_path}.{c}": s for c, s in result.segments.items() if len(s) > 1},
                    checked=result.degrees, **sequence,
                    sequence_linked=bool(sequence.get("sequence")) and layer.module_path in (linked or ()))
                out[i] = dataclasses.replace(layer, tp_styles=(proved, *others))
            else:
                out[i] = dataclasses.replace(layer, tp_styles=others,
                                             tp_refusal=f"tensor parallelism withdrawn: {result.reason}")
    return out


def _links(model: nn.Module, args: tuple, kwargs: dict, layers: list[Layer]) -> set[str]:
    """Module paths of the layers whose hidden state is their predecessor's output, untouched
    (:func:`autopar.sharding.check.record_links`); empty if the forward fails."""
    paths = [l.module_path for l in layers if l.module_path]
    try:
        return shard_check.record_links(model, args, kwargs, paths)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - no links known: sequence parallelism gathers at every layer
        return set()


__all__ = ["verify_styles"]
