"""Pins: user constraints that fix part of a plan; the solver fills in the rest.

Global pins are ``KEY=VALUE`` with KEY a mesh axis (``pp``, ``dp``, ``tp``: every
axis :mod:`autopar.mesh` declares, its degree), ``microbatches``, ``schedule``
(``gpipe``, ``1f1b``, ``interleaved_1f1b``, and the split-backward ones ``interleaved_zb``
(alias ``zb``), ``zbv``, ``dualpipev``), ``chunks`` (model chunks per rank: interleaved 1F1B and
interleaved_zb; zbv and dualpipev run exactly 2, in a V), ``zero`` (0–3, every layer) and ``recompute`` (``none``,
``selective`` or ``full``). Per-layer pins
are ``GLOB:KEY=VALUE`` with KEY one of ``stage``, ``tp`` (a style name or
``none``), ``zero`` and ``recompute`` (as the global one), where GLOB is an
``fnmatch`` pattern over layer names, e.g. ``blocks.0:stage=0`` or
``blocks.*:zero=3``. Pinning everything prices a hand-made plan. For
recompute, ``on``/``all`` still mean ``full`` and ``off`` means ``none``.
A global ``recompute=selective`` applies to the layers that have something to
keep and leaves the others without recompute (the plan notes them); a
per-layer one on a layer with nothing to keep is a PinError (planning checks
it against the graph). ``sp=on|off`` (global or per layer) turns sequence
parallelism on the layers' tensor-parallel styles on or off: a global
``sp=on`` applies to the layers whose style can take it at the plan's tp; a
per-layer one on a layer that cannot is a PinError naming the layer.
``cp_attention=allgather|ulysses|ring`` fixes how attention sees the whole sequence
under cp (K/V all-gather, the head all-to-all of DeepSpeed-Ulysses, or K/V passed
round the cp ring); free, the solver prices each that runs and takes the cheapest.
``loss=full|chunked`` fixes how the loss runs (:class:`~autopar.choice.LossKind`): ``full`` holds the
whole logits as the model computes them; ``chunked`` (the default wherever the contract offers it)
runs the head and the cross-entropy a chunk of tokens at a time (vocabulary-parallel where tp splits
the head). A ``chunked`` pin on a model whose head or loss cannot run chunked is a PinError naming why.
``batch_coupled=auto|exact|split`` fixes how layers whose output depends on the batch they see
(BatchNorm, a capacity MoE) run (:class:`~autopar.choice.BatchCoupling`): ``exact`` offers only plans
that keep one device's numbers, ``split`` runs each on its own split, ``auto`` (the default) is
exact where the runtime can be and split where it cannot.
Hybrid sharding (:mod:`autopar.contract_hsdp`): ``dp_replicate=R`` (a mesh axis) splits dp into R replicas
of ZeRO's shards; ``dp_shard=S`` fixes instead the dp ranks of one replica (dp / dp_replicate), whatever dp
the solver takes. Free, the solver tries dp_replicate 1 and the node-sized shard group.
A Ulysses pin on a model whose key/value heads cp (× tp) does not divide, or a
ring pin where the ring cannot run, is a PinError naming why (planning checks it
against the graph).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autopar import mesh
from autopar.choice import BatchCoupling, CpAttention, LossKind, Recompute
from autopar.cost_models.pipeline import MULTI_CHUNK, V_SHAPED, ScheduleKind
from autopar.errors import PinError

_UNSET: Any = object()
# the global keys besides the axes
PLAN_KEYS = ("microbatches", "schedule", "chunks", "zero", "recompute", "sp", "cp_attention", "loss",
             "batch_coupled", "dp_shard")
LAYER_KEYS = ("stage", "tp", "zero", "recompute", "sp")
_RECOMPUTE = {**dict.fromkeys(("full", "all", "on", "true", "yes", "1"), Recompute.FULL),
              **dict.fromkeys(("none", "off", "false", "no", "0"), Recompute.NONE),
              **dict.fromkeys(("selective", "sac"), Recompute.SELECTIVE),
              **dict.fromkeys(("alternate_mm", "alternate-mm"), Recompute.ALTERNATE_MM)}
SCHEDULE_NAMES = {
    "gpipe": ScheduleKind.GPIPE,
    "1f1b": ScheduleKind.ONE_F_ONE_B,
    "interleaved_1f1b": ScheduleKind.INTERLEAVED_1F1B,
    "interleaved": ScheduleKind.INTERLEAVED_1F1B,
    "interleaved_zb": ScheduleKind.INTERLEAVED_ZB,
    "zb": ScheduleKind.INTERLEAVED_ZB,
    "zb1p": ScheduleKind.INTERLEAVED_ZB,
    "zbv": ScheduleKind.ZBV,
    "dualpipev": ScheduleKind.DUALPIPE_V,
    "dualpipe_v": ScheduleKind.DUALPIPE_V,
    "none": ScheduleKind.NONE,
}


@dataclass(frozen=True)
class LayerPin:
    """Constraints on the layers whose names match ``pattern``; ``_UNSET`` leaves a field free."""

    pattern: str
    stage: Any = _UNSET
    tp: Any = _UNSET  # style name, or None for replicated
    zero: Any = _UNSET
    recompute: Any = _UNSET
    sp: Any = _UNSET  # sequence parallelism on the layer's tensor-parallel style: True / False

    def fields_set(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in LAYER_KEYS if getattr(self, k) is not _UNSET}


@dataclass(frozen=True)
class Pins:
    """Every pin of a planning request, validated for form (not yet against a model). ``degrees``:
    the pinned mesh axes and their degrees, in the order pinned (:meth:`mesh_degrees`)."""

    degrees: tuple[tuple[str, int], ...] = ()
    microbatches: int | None = None
    schedule: ScheduleKind | None = None
    chunks: int | None = None
    zero: int | None = None
    recompute: Recompute | None = None
    sp: bool | None = None  # every layer whose style can take it (global), or none
    cp_attention: CpAttention | None = None  # under cp: all-gather, Ulysses or ring (None: the solver's choice)
    loss: LossKind | None = None  # full or chunked (None: chunked wherever it runs)
    batch_coupled: BatchCoupling | None = None  # auto, exact or split (None: auto)
    dp_shard: int | None = None  # hybrid sharding: the dp ranks of a replica, dp / dp_replicate (contract_hsdp)
    layers: tuple[LayerPin, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, items: Iterable[str]) -> Pins:
        """Pins from ``KEY=VALUE`` / ``GLOB:KEY=VALUE`` strings (the CLI's ``--pin``)."""
        pins = cls()
        for item in items:
            pins = pins._with(item)
        return pins

    @classmethod
    def from_any(cls, pins: Pins | Mapping[str, Any] | Iterable[str] | None) -> Pins:
        """Accept a Pins, a mapping (``{"tp": 8, "blocks.*": {"zero": 3}}``), strings or None."""
        if pins is None:
            return cls()
        if isinstance(pins, Pins):
            return pins
        if isinstance(pins, str):
            return cls.parse([pins])
        if isinstance(pins, Mapping):
            items: list[str] = []
            for key, value in pins.items():
                if isinstance(value, Mapping):
                    items += [f"{key}:{k}={_text(v)}" for k, v in value.items()]
                else:
                    items.append(f"{key}={_text(value)}")
            return cls.parse(items)
        return cls.parse(list(pins))

    def mesh_degrees(self) -> dict[str, int]:
        """The pinned degree of each pinned mesh axis, outermost first."""
        pinned = dict(self.degrees)
        return {name: pinned[name] for name in mesh.axis_names() if name in pinned}

    def degree(self, axis: str) -> int | None:
        """The degree pinned on mesh axis ``axis`` (None if free)."""
        return dict(self.degrees).get(axis)

    def _with(self, item: str) -> Pins:
        if not isinstance(item, str) or "=" not in item:
            raise PinError(f"pin {item!r} is not KEY=VALUE or LAYER_GLOB:KEY=VALUE")
        lhs, value = item.split("=", 1)
        lhs, value = lhs.strip(), value.strip()
        if ":" in lhs:
            pattern, key = (s.strip() for s in lhs.rsplit(":", 1))
            if key not in LAYER_KEYS:
                raise PinError(f"pin {item!r}: per-layer key must be one of {', '.join(LAYER_KEYS)}")
            pin = LayerPin(pattern, **{key: _layer_value(key, value, item)})
            return replace(self, layers=self.layers + (pin,))
        if lhs in mesh.axis_names():
            return self._with_degree(lhs, _int(value, item, minimum=1), item)
        if lhs not in PLAN_KEYS:
            raise PinError(
                f"pin {item!r}: unknown key {lhs!r}; the mesh axes are {', '.join(mesh.axis_names())} and "
                f"the other global keys {', '.join(PLAN_KEYS)}; per-layer pins are written LAYER_GLOB:KEY=VALUE"
            )
        parsed = _global_value(lhs, value, item)
        old = getattr(self, lhs)
        if old is not None and old != parsed:
            raise PinError(f"pins contradict each other: {lhs} pinned to both {_text(old)} and {value}")
        return replace(self, **{lhs: parsed})

    def _with_degree(self, axis: str, degree: int, item: str) -> Pins:
        """A mesh axis pinned: a degree the axis can run at (an axis not searched runs at 1 only)."""
        declared = mesh.axis(axis)
        if degree > 1 and not declared.searched:
            axes = ", ".join(a.name for a in mesh.AXES if a.searched)
            raise PinError(f"pin {item!r}: the {axis} axis runs at degree 1 only (it is declared, but "
                           f"{declared.pending}); the axes a pin can set above 1 are {axes}")
        old = self.degree(axis)
        if old is not None and old != degree:
            raise PinError(f"pins contradict each other: {axis} pinned to both {old} and {degree}")
        return replace(self, degrees=tuple((k, v) for k, v in self.degrees if k != axis) + ((axis, degree),))

    def to_strings(self) -> list[str]:
        """The pins written back as CLI strings (recorded in the plan)."""
        out = [f"{k}={v}" for k, v in self.mesh_degrees().items()]
        out += [f"{k}={_text(getattr(self, k))}" for k in PLAN_KEYS if getattr(self, k) is not None]
        for pin in self.layers:
            out += [f"{pin.pattern}:{k}={_text(v)}" for k, v in pin.fields_set().items()]
        return out

    def check_form(self) -> None:
        """Contradictions visible without a model or world size."""
        if self.chunks is not None and self.schedule in V_SHAPED and self.chunks != 2:
            raise PinError(f"pins contradict each other: schedule={self.schedule.value} runs 2 chunks per "
                           f"rank (a V), not chunks={self.chunks}")
        if self.chunks == 1 and self.schedule is ScheduleKind.INTERLEAVED_1F1B:
            raise PinError("pins contradict each other: interleaved_1f1b needs chunks ≥ 2")
        if self.chunks not in (None, 1) and self.schedule not in (None, *MULTI_CHUNK):
            raise PinError(f"pins contradict each other: chunks={self.chunks} needs schedule=interleaved_1f1b "
                           f"(or interleaved_zb, zbv, dualpipev), not {self.schedule.value}")
        pp = self.degree("pp")
        if pp == 1 and self.schedule not in (None, ScheduleKind.NONE):
            raise PinError(f"pins contradict each other: schedule={self.schedule.value} needs pp > 1")
        if pp is not None and pp > 1 and self.schedule is ScheduleKind.NONE:
            raise PinError(f"pins contradict each other: pp={pp} needs a pipeline schedule")
        for pin in self.layers:
            set_ = pin.fields_set()
            if self.zero is not None and "zero" in set_ and set_["zero"] != self.zero:
                raise PinError(f"pins contradict each other: zero={self.zero} for every layer but "
                               f"{pin.pattern}:zero={set_['zero']}")
            if self.sp is not None and "sp" in set_ and set_["sp"] != self.sp:
                raise PinError(f"pins contradict each other: sp={_text(self.sp)} for every layer but "
                               f"{pin.pattern}:sp={_text(set_['sp'])}")
            if self.recompute is not None and "recompute" in set_ and set_["recompute"] != self.recompute:
                raise PinError(f"pins contradict each other: recompute={_text(self.recompute)} for "
                               f"every layer but {pin.pattern}:recompute={_text(set_['recompute'])}")
            if pp is not None and "stage" in set_:
                stages = pp * (self.chunks or (2 if self.schedule in V_SHAPED else 1))
                if set_["stage"] >= stages:
                    raise PinError(f"pin {pin.pattern}:stage={set_['stage']} is outside the "
                                   f"{stages} pipeline stages pinned (stages count from 0)")

    def resolve_layers(self, names: list[str]) -> list[dict[str, Any]]:
        """Per layer, the fields pinned for it (global zero/recompute included)."""
        resolved: list[dict[str, Any]] = [{} for _ in names]
        for pin in self.layers:
            matched = [i for i, n in enumerate(names) if fnmatch.fnmatchcase(n, pin.pattern)]
            if not matched:
                sample = ", ".join(names[:6]) + (", …" if len(names) > 6 else "")
                raise PinError(f"pin pattern {pin.pattern!r} names no layer (layers: {sample})")
            for i in matched:
                for key, value in pin.fields_set().items():
                    if key in resolved[i] and resolved[i][key] != value:
                        raise PinError(f"pins contradict each other on layer {names[i]!r}: "
                                       f"{key}={_text(resolved[i][key])} and {key}={_text(value)}")
                    resolved[i][key] = value
        for i in range(len(names)):
            if self.zero is not None:
                resolved[i].setdefault("zero", self.zero)
            if self.recompute is not None:
                resolved[i].setdefault("recompute", self.recompute)
            if self.sp is not None:  # planning applies it where the layer can take it
                resolved[i]["sp_all"] = self.sp
        stages = [(names[i], r["stage"]) for i, r in enumerate(resolved) if "stage" in r]
        for (a, sa), (b, sb) in zip(stages, stages[1:]):
            if sb < sa:
                raise PinError(f"pins contradict each other: {a} is pinned to stage {sa} but the "
                               f"later layer {b} to stage {sb}; stages cannot go backwards")
        return resolved


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Recompute):
        return str(value)
    if isinstance(value, ScheduleKind):
        return value.value
    if value is None:
        return "none"
    return str(value)


def _int(value: str, item: str, *, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise PinError(f"pin {item!r}: {value!r} is not an integer") from None
    if number < minimum:
        raise PinError(f"pin {item!r}: value must be ≥ {minimum}")
    return number


def _recompute(value: str, item: str) -> Recompute:
    try:
        return _RECOMPUTE[value.lower()]
    except KeyError:
        raise PinError(f"pin {item!r}: recompute must be none, selective, alternate_mm or full (on/off: full/none), "
                       f"got {value!r}") from None


def _global_value(key: str, value: str, item: str) -> Any:
    if key in ("microbatches", "dp_shard"):
        return _int(value, item, minimum=1)
    if key == "chunks":
        return _int(value, item, minimum=1)
    if key == "zero":
        zero = _int(value, item, minimum=0)
        if zero > 3:
            raise PinError(f"pin {item!r}: ZeRO stage must be 0, 1, 2 or 3")
        return zero
    if key == "recompute":
        return _recompute(value, item)
    if key == "sp":
        return _on_off(value, item)
    if key == "cp_attention":
        try:
            return CpAttention.of(value)
        except ValueError:
            raise PinError(f"pin {item!r}: cp_attention must be allgather, ulysses or ring, got {value!r}") from None
    if key == "batch_coupled":
        try:
            return BatchCoupling.of(value)
        except ValueError:
            raise PinError(f"pin {item!r}: batch_coupled must be auto, exact or split, got {value!r}") from None
    if key == "loss":
        try:
            kind = LossKind.of(value)
        except ValueError:
            raise PinError(f"pin {item!r}: loss must be full or chunked, got {value!r}") from None
        if kind is LossKind.VOCAB_PARALLEL:  # not a separate ask: where tp splits the head, chunked runs so
            raise PinError(f"pin {item!r}: pin loss=chunked; it runs vocabulary-parallel wherever tp splits the head")
        return kind
    try:
        return SCHEDULE_NAMES[value.lower()]
    except KeyError:
        raise PinError(f"pin {item!r}: schedule must be one of gpipe, 1f1b, interleaved_1f1b, "
                       "interleaved_zb, zbv, dualpipev") from None


def _layer_value(key: str, value: str, item: str) -> Any:
    if key == "stage":
        return _int(value, item, minimum=0)
    if key == "zero":
        return _global_value("zero", value, item)
    if key == "recompute":
        return _recompute(value, item)
    if key == "sp":
        return _on_off(value, item)
    return None if value.lower() in ("none", "-", "replicate") else value


def _on_off(value: str, item: str) -> bool:
    text = value.lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise PinError(f"pin {item!r}: sp must be on or off, got {value!r}")
