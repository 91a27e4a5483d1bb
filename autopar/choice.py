"""What one layer runs as: the per-layer choice that pricing, the solver, the plan and the passes share.

:class:`LayerChoice` holds every per-layer field of every axis: the
tensor-parallel style and its sequence parallelism (tp), the ZeRO stage (dp)
and the recompute kind. A new axis with a per-layer decision adds one field
here, with a default that means "as before", and nothing else has to spell
it: a plan file without the field loads with the default
(:meth:`LayerChoice.from_dict`).

Where a layer runs (its pipeline stage) and which layer it is are not part of
the choice: pricing shares one row of choices between every layer of a cost
class and prices a choice the same on any stage, so the plan's
:class:`~autopar.plan.LayerPlan` is ``name``, ``stage`` and a choice, and the
solver's assignment is a stage and a choice per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum, StrEnum
from typing import Any


class Recompute(IntEnum):
    """What a layer recomputes in backward instead of keeping from forward.

    ``NONE`` keeps every saved activation; ``SELECTIVE`` checkpoints the layer's
    module with torch's selective policy, keeping the outputs of matmul-class
    ops and recomputing the rest; ``ALTERNATE_MM`` is torchtitan's op-level
    policy, keeping fused attention's outputs and every other ``mm`` output (the
    1st, 3rd, …) and recomputing the rest, the other matmuls included (offered
    when pinned, not searched); ``FULL`` keeps only the module's inputs and
    re-runs its whole forward. FULL is 1 and NONE 0 so that a plan written when
    recompute was a bool, and code that still passes one, mean what they meant.
    """

    NONE = 0
    FULL = 1
    SELECTIVE = 2
    ALTERNATE_MM = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def of(cls, value: Recompute | bool | int | str) -> Recompute:
        """A recompute kind from itself, a bool (True = full), or its name."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError("recompute must be one of none, selective, alternate_mm, full; "
                                 f"got {value!r}") from None
        return cls(int(value))


class CpAttention(StrEnum):
    """How attention sees the whole sequence under context parallelism (cp): one method for the plan.

    ``ALL_GATHER`` gathers K and V over the cp group and runs each rank's query chunks against the key
    prefixes they see; ``ULYSSES`` (DeepSpeed-Ulysses) moves q, k and v by all-to-all from a split of the
    sequence to a split of the heads, runs causal attention over the whole sequence for the rank's
    heads, and moves the output back; ``RING`` passes K and V round the cp ring in cp − 1 steps, each
    step's transfer overlapped with the attention of the chunk in hand, the partial outputs merged by
    their log-sum-exp (torch's ``_templated_ring_attention``), so no rank holds the gathered K/V
    (``passes/context_parallel.py``). A plan file written before the method was a choice means all-gather.
    """

    ALL_GATHER = "allgather"
    ULYSSES = "ulysses"
    RING = "ring"

    @classmethod
    def of(cls, value: CpAttention | str) -> CpAttention:
        """A method from itself or its name (``all_gather``, ``all-gather``, ``a2a`` spelled as aliases)."""
        text = str(value).lower().replace("-", "").replace("_", "")
        aliases = {"allgather": cls.ALL_GATHER, "ulysses": cls.ULYSSES, "a2a": cls.ULYSSES, "alltoall": cls.ULYSSES,
                   "ring": cls.RING}
        if text not in aliases:
            raise ValueError(f"cp_attention must be allgather, ulysses or ring, got {value!r}")
        return aliases[text]


class LossKind(StrEnum):
    """How the plan's loss runs: one choice for the plan (``training.loss`` in the file).

    ``FULL`` runs the head on every token and the loss on the whole logits (the model as written;
    torch's cross-entropy holds fp32 logits-sized tensors at its peak); ``CHUNKED`` runs the head's
    linear and the cross-entropy a chunk of tokens at a time, recomputing each chunk's logits in
    backward, so the whole logits are never held (:mod:`autopar.runtime.chunked_loss`; where it runs:
    :func:`autopar.contract.chunked_loss_refusal`); ``VOCAB_PARALLEL`` is the chunked loss on a head
    split over tp on its vocabulary: each rank a chunk of tokens × its vocabulary shard, the log-sum-exp
    and the target logit joined over tp, the vocabulary never gathered (:mod:`autopar.runtime.vocab_loss`;
    where: :func:`autopar.contract.loss_engine`). A pin asks for ``chunked``; the contract runs it
    vocabulary-parallel where tp splits the head. A plan file written before the choice means full.
    """

    FULL = "full"
    CHUNKED = "chunked"
    VOCAB_PARALLEL = "vocab_parallel"

    @classmethod
    def of(cls, value: LossKind | str) -> LossKind:
        """A loss kind from itself or its name (``full`` / ``chunked`` / ``vocab_parallel``; ``off`` / ``on``
        as aliases)."""
        text = str(value).lower()
        aliases = {"full": cls.FULL, "off": cls.FULL, "chunked": cls.CHUNKED, "chunk": cls.CHUNKED, "on": cls.CHUNKED,
                   "vocab_parallel": cls.VOCAB_PARALLEL}
        if text not in aliases:
            raise ValueError(f"loss must be full, chunked or vocab_parallel, got {value!r}")
        return aliases[text]

    @property
    def chunked(self) -> bool:
        """Whether the head and the loss run a chunk of tokens at a time (never the whole logits)."""
        return self is not LossKind.FULL


class BatchCoupling(StrEnum):
    """How a plan runs layers whose output depends on the batch they see (BatchNorm's statistics, a
    GShard/Switch capacity MoE's token drops): one choice for the plan (``training.batch_coupled``).

    ``EXACT`` keeps one device's numbers: BatchNorm's statistics all-reduced over dp (priced), and
    no plan that splits a capacity block's tokens or runs a BatchNorm on microbatches (those have
    no global statistic or capacity before the first split runs) is offered. ``SPLIT`` runs every
    such layer on its own split, a dp rank's microbatch, as plain data parallelism does (no
    collective). ``AUTO``, the default, is exact where the runtime can be (BatchNorm's statistics
    over the whole dp group) and split where it cannot (per microbatch; a capacity block per dp
    rank's microbatch, as GShard, Switch and DeepSpeed-MoE compute capacity per device), so no
    model people train data parallel is refused data parallelism. A plan that splits names the
    splits (:mod:`autopar.batch_coupling`), and ``verify`` compares it with one process running the
    same splits. A plan file written before the choice means auto.
    """

    AUTO = "auto"
    EXACT = "exact"
    SPLIT = "split"

    @classmethod
    def of(cls, value: BatchCoupling | str) -> BatchCoupling:
        text = str(value).lower()
        if text not in {k.value for k in cls}:
            raise ValueError(f"batch_coupled must be auto, exact or split, got {value!r}")
        return cls(text)


@dataclass(frozen=True)
class LayerChoice:
    """One layer's choices: tensor-parallel style (None = replicated over tp), ZeRO stage over dp,
    recompute (a :class:`Recompute`; a bool means full or none), and sequence parallelism on the style."""

    tp: str | None = None
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    sp: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", Recompute.of(self.recompute))

    def __str__(self) -> str:
        return f"tp={self.style_text()} zero={self.zero} recompute={self.recompute}"

    def style_text(self) -> str:
        """The tensor-parallel style as plans print it: ``megatron+sp``, or ``-`` for none."""
        return (self.tp or "-") + ("+sp" if self.sp and self.tp else "")

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """The choice's fields as a plan file writes them inside a layer's entry."""
        return {"tp": self.tp, "zero": self.zero, "recompute": str(self.recompute), "sp": self.sp}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> LayerChoice:
        """A layer entry's choice fields, each checked; a field the file leaves out takes its default
        (``sp`` was added within schema 1). Raises ValueError naming the field."""
        kinds = {"tp": (str, type(None)), "zero": int, "recompute": (str, bool), "sp": bool}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in raw:
                if f.name in REQUIRED_IN_FILE:
                    raise ValueError(f"{source}: a layer is missing field {f.name!r}")
                continue
            value = raw[f.name]
            if not isinstance(value, kinds[f.name]) or (kinds[f.name] is int and isinstance(value, bool)):
                raise ValueError(f"{source}: a layer's field {f.name!r} has the wrong type ({type(value).__name__})")
            values[f.name] = value
        if "recompute" in values:
            try:
                values["recompute"] = Recompute.of(values["recompute"])
            except ValueError:
                raise ValueError(f"{source}: a layer's recompute is {values['recompute']!r}; use none, selective, "
                                 "alternate_mm or full") from None
        return cls(**values)


CHOICE_FIELDS = tuple(f.name for f in fields(LayerChoice))
# fields every plan file has had; one added later (sp, a new axis's) loads with its default when absent
REQUIRED_IN_FILE = ("zero", "recompute")

__all__ = ["CHOICE_FIELDS", "CpAttention", "LayerChoice", "LossKind", "Recompute"]
