"""Per-layer choices: the strategies of each layer the pins allow, and runs of alike layers.

A pinned choice the search space leaves out is priced all the same (the row
is extended for that layer only); a pinned ZeRO stage that cannot run in the
configuration's data-parallel mode rules the configuration out
(:func:`autopar.contract.admits_zero_pin`). Dominated strategies are dropped.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from autopar import contract, contract_compile
from autopar.choice import LayerChoice, Recompute
from autopar.errors import PinError
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.planning import edges
from autopar.planning.pricing import PriceTable


def check_recompute_pins(graph: LayerGraph, pins: Pins) -> None:
    """A per-layer ``recompute=selective`` on a layer whose module keeps nothing under it (no
    matmul-class op) is a PinError naming the layer; a layer without a module of its own runs
    without recompute and is noted, as for full (:func:`autopar.contract.recompute_applies`)."""
    for pin in pins.layers:
        kind = pin.fields_set().get("recompute")
        if kind not in (Recompute.SELECTIVE, Recompute.ALTERNATE_MM):
            continue
        for layer in graph:
            saved = (layer.selective_saved_bytes_per_sample if kind is Recompute.SELECTIVE
                     else layer.alternate_saved_bytes_per_sample)
            if fnmatch.fnmatchcase(layer.name, pin.pattern) and layer.module_path is not None and saved <= 0:
                ops = ("matmul-class op (mm, addmm, bmm, convolution, fused attention)" if kind is Recompute.SELECTIVE
                       else "mm or fused attention")
                raise PinError(f"pin {pin.pattern}:recompute={kind}: layer {layer.name!r} runs no {ops}, so "
                               f"its policy has nothing to keep; pin it recompute=full or none")


def allowed_choices(table: PriceTable, layer_pins: list[dict[str, Any]]) -> list[list[int]]:
    """Indices of each layer's strategies that satisfy its pins. They read the rows, the mesh and the
    data-parallel mode, not the schedule: tables alike (:attr:`PriceTable.alike`) whose rows no pin
    extended share them."""
    key = (table.alike, id(layer_pins))
    shared = table.shared.allowed
    if key in shared and _rows_shared(table):
        return [list(ks) for ks in shared[key][1]]
    allowed = _allowed_choices(table, layer_pins)
    if _rows_shared(table):
        shared[key] = (layer_pins, [list(ks) for ks in allowed])
    return allowed


def _rows_shared(table: PriceTable) -> bool:
    """Whether every layer's row is still the one tables alike share (``index_of`` extends a copy)."""
    return all(a is b for a, b in zip(table.choices, table._rows[0]))


def _allowed_choices(table: PriceTable, layer_pins: list[dict[str, Any]]) -> list[list[int]]:
    allowed = []
    memo: dict[tuple, list[int]] = {}
    classes = table.graph.cost_classes
    floor = contract.root_floor(table.graph, [pin.get("zero") for pin in layer_pins], table.config.mesh.pp)
    for i, (strategies, pin) in enumerate(zip(table.choices, layer_pins)):
        if not _pin_runs_here(table, i, pin, floor):  # the pinned ZeRO stage cannot run in this mode
            allowed.append([])
            continue
        fixed = contract.loss_fixed_tp(table.graph, i, table.config.mesh, table.loss)
        key = (classes[i], id(strategies), tuple(sorted(pin.items())), fixed)
        if key in memo:
            allowed.append(memo[key])
            continue
        sp = _sp_wanted(strategies, pin)
        ks = [k for k, s in enumerate(strategies)
              if pin.get("tp", s.tp) == s.tp and pin.get("zero", s.zero) == s.zero
              and pin.get("recompute", s.recompute) == s.recompute and sp in (None, s.sp)]
        if fixed is not contract.KEEP:
            _check_fixed_pin(table, i, pin, fixed)
            ks = [k for k in ks if strategies[k].tp == fixed]
        if not ks:  # a pinned choice outside the search space extends this layer's row only
            allowed.append(_pinned_outside_search(table, i, pin))
            continue
        if table.training.compiled and contract_compile.compiled_break(table.graph, i, table.config.mesh,
                                                               table.config.cp_attention):
            # full recompute runs with the checkpoint eager around the compiled block; a selective or
            # alternate-mm policy would not see the compiled ops: not offered
            ks = [k for k in ks if strategies[k].recompute in contract_compile.BREAK_RECOMPUTES]
        memo[key] = _undominated_alike(table, i, ks) if ks else []
        allowed.append(memo[key])
    return allowed


def _check_fixed_pin(table: PriceTable, i: int, pin: dict[str, Any], fixed: str | None) -> None:
    """A tp pin against the style the loss fixes for layer ``i`` (:func:`autopar.contract.loss_fixed_tp`)
    is a PinError naming both."""
    if "tp" in pin and pin["tp"] != fixed:
        layer, mesh = table.graph[i], table.config.mesh
        why = (f"the vocabulary-parallel loss splits it over tp={mesh.tp} (style {fixed!r}); pin loss=full to keep "
               "the logits whole" if table.loss.value == "vocab_parallel" else
               "it is an end of tied embeddings in one stage, which runs replicated over tp unless the "
               "vocabulary-parallel loss splits both ends alike")
        raise PinError(f"layer {layer.name!r} pinned tp={pin['tp']}: {why}")


def _sp_wanted(strategies: list[LayerChoice], pin: dict[str, Any]) -> bool | None:
    """The sequence parallelism a layer's pins ask for: its own ``sp`` pin, else a global one where
    the layer has a sequence-parallel strategy here (a global ``sp=on`` skips the layers that
    cannot), else free (None)."""
    if "sp" in pin:
        return pin["sp"]
    wanted = pin.get("sp_all")
    if wanted and not any(s.sp for s in strategies):
        return None
    return wanted


def check_sp_pins(graph: LayerGraph, pins: Pins) -> None:
    """A per-layer ``sp=on`` on a layer without a tensor-parallel style that can take sequence
    parallelism (at the pinned tp, if tp is pinned) is a PinError naming the layer and why."""
    for pin in pins.layers:
        if pin.fields_set().get("sp") is not True:
            continue
        for layer in graph:
            if not fnmatch.fnmatchcase(layer.name, pin.pattern):
                continue
            styles = [s for s in layer.tp_styles if s.sequence]
            if not styles:
                why = next((s.sequence_refusal for s in layer.tp_styles if s.sequence_refusal), "") \
                    or layer.tp_refusal or "it has no tensor-parallel style with projections"
                raise PinError(f"pin {pin.pattern}:sp=on: layer {layer.name!r} cannot run sequence parallel: {why}")
            tp = pins.degree("tp")
            if tp is not None and not any(s.admits_sequence(tp) for s in styles):
                degrees = sorted({d for s in styles for d in s.sequence})
                raise PinError(f"pin {pin.pattern}:sp=on: layer {layer.name!r} runs sequence parallel only at "
                               f"tp={degrees} (its sequence and sizes divide), not tp={tp}")


def _pin_runs_here(table: PriceTable, i: int, pin: dict[str, Any], root_floor: int | None) -> bool:
    """Whether layer i's pinned ZeRO stage can be planned in this configuration's data-parallel
    mode (:func:`autopar.contract.admits_zero_pin`; moot at dp = 1). A pin the contract runs
    otherwise (a root-unit layer below its root's stage, recompute on a layer without a
    module) is kept and priced as it runs; the plan notes it."""
    c = table.config
    if "zero" not in pin or contract.data_ranks(c.mesh) <= 1:
        return True
    return contract.admits_zero_pin(table.graph, i, pin["zero"], c.data_parallel, c.mesh.pp, root_floor=root_floor)


def _undominated_alike(table: PriceTable, i: int, ks: list[int]) -> list[int]:
    """:func:`_undominated`, among the strategies of each ZeRO stage apart for a root-unit layer
    whose stage the solver chooses for every root unit at once (one stage's strategy cannot
    stand in for another's there)."""
    c = table.config
    coupled = (c.data_parallel.sharded and not c.data_parallel.root_zero
               and contract.wrapping(table.graph, c.mesh.pp).root[i])
    if not coupled:
        return _undominated(table, i, ks)
    zeros = sorted({table.choices[i][k].zero for k in ks})
    keep = {k for z in zeros for k in _undominated(table, i, [k for k in ks if table.choices[i][k].zero == z])}
    return [k for k in ks if k in keep]


def _undominated(table: PriceTable, i: int, ks: list[int]) -> list[int]:
    """Drop strategies another one beats or ties on every priced term (time, tail, memory,
    the FSDP2 buffers its ZeRO stage makes the rank hold: none, reduce-scatter, + prefetch, and
    the ZeRO stage its rank's first and last unit then expose at, :mod:`autopar.planning.edges`)."""

    def vector(k: int) -> tuple:
        p = table.prices[i][k]
        # sequence parallelism pays its regions' entries and exits outside the layer's price: it never
        # stands in for a strategy without it
        return (p.time_mb_s, p.tail_s, p.state_bytes, p.activation_mb_bytes, table.buffers_needed(i, k).value,
                edges.edge_level(table, i, k), int(table.choices[i][k].sp))

    vectors = {k: vector(k) for k in ks}

    def beaten(k: int) -> bool:
        for j in ks:
            if j == k:
                continue
            if all(a <= b for a, b in zip(vectors[j], vectors[k])) and (j < k or vectors[j] != vectors[k]):
                return True
        return False

    return [k for k in ks if not beaten(k)]


def _pinned_outside_search(table: PriceTable, i: int, pin: dict[str, Any]) -> list[int]:
    """A pinned choice the search space leaves out (e.g. zero>0 at dp=1): add it, or explain."""
    layer, tp = table.graph[i], table.config.mesh.tp
    style = pin.get("tp")
    if style is not None:
        names = [s.name for s in layer.tp_styles]
        if style not in names:
            why = f"; {layer.tp_refusal}" if layer.tp_refusal and style == "megatron" else ""
            held = ", ".join(sorted({m.weights or "a layout of no known library" for m in layer.moe}))
            if style == "megatron+experts" and held and held != "hf-fused":  # sharding.experts.EXPERTS_STYLE
                why = (f"; its experts ({held}) are not split across their hidden dim: only Hugging Face's "
                       "fused layout is (autopar.experts.layouts.hidden_split_refusal)")
            raise PinError(f"layer {layer.name!r} has no tensor-parallel style {style!r} "
                           f"(it admits: {', '.join(names) or 'none'}{why})")
        if not layer.tp_style(style).admits(tp) or contract.tied_across_stages(table.graph, i, table.config.mesh.pp) \
                or not contract.cp_admits_style(layer.tp_style(style), table.config.mesh):
            return []
        if contract.experts_split_refusal(layer.tp_style(style), table.config.mesh):
            return []  # not on this mesh (another may take it; the infeasibility names it where none does)
        if table.training.compiled and layer.tp_style(style).experts:
            raise PinError(f"layer {layer.name!r}: style {style!r} (experts split over tp) runs eagerly only; "
                           "plan it without --compile, or with tp=megatron")
    sp = bool(pin.get("sp", False))
    if sp and (style is None or not layer.tp_style(style).admits_sequence(tp)
               or not contract.cp_admits_sequence(table.graph.seq_len or 0, table.config.mesh)):
        return []  # sequence parallelism needs a style that takes it at this tp (and S/cp tokens tp divides)
    c = table.config
    offered = contract.offered_zeros(table.graph, i, c.data_parallel, c.mesh.pp, c.schedule.split_backward)
    zero = pin.get("zero", offered[0])
    return [table.index_of(i, LayerChoice(style, zero, pin.get("recompute", False), sp))]


def runs_of(table: PriceTable, allowed: list[list[int]], layer_pins: list[dict]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive layers that price alike and are pinned alike."""
    def key(i: int) -> tuple:
        return (table.graph.cost_classes[i], id(table.choices[i]), tuple(allowed[i]), len(table.choices[i]))

    runs: list[tuple[int, int]] = []
    for i in range(len(table.graph)):
        if runs and "stage" not in layer_pins[i] and "stage" not in layer_pins[runs[-1][0]] \
                and key(i) == key(runs[-1][0]):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
