"""A tensor-parallel style: one way to split a layer over the tensor-parallel axis, and what it costs.

Capture's rules (:mod:`autopar.sharding`) make them; each :class:`~autopar.graph.Layer` lists those it admits;
pricing, the contract and the tensor-parallel pass read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TPStyle:
    """One way to split a layer over the tensor-parallel axis, and what it costs.

    ``column`` modules are split on their output features, ``row`` modules on
    their input features (the Megatron column→row pairing), ``vocab`` modules
    (embeddings) on their vocabulary. ``divisors`` are sizes the tp degree must
    divide (attention heads, key/value heads, FFN width, vocabulary).
    ``segments`` gives each column projection's output as the blocks the layer
    later splits it into (a fused ``[q; k; v]`` is three; each block is split
    across ranks; the indices ``whole`` names are run whole on every rank instead,
    a multi-query projection's key/value rows), and ``checked`` the tp degrees at which capture simulated
    the style and found it exact (:mod:`autopar.sharding.check`); a
    style with ``checked`` set admits only those degrees.

    Cost figures are per sample, in elements of the captured dtype:
    ``sharded_params`` parameters are split across tp ranks (the rest of the
    layer's parameters stay replicated), likewise ``sharded_flops_per_sample``
    forward FLOPs and ``sharded_activation_elems_per_sample`` saved
    activations. Communication in the tp group per sample:
    ``fwd_allreduce_elems`` / ``bwd_allreduce_elems`` in ``fwd_allreduce_count``
    / ``bwd_allreduce_count`` collectives, and ``fwd_allgather_elems`` (the
    gathered output size) for outputs gathered to every rank.

    Sequence parallelism (Megatron-SP) on the style is offered at the degrees
    ``sequence`` (simulated exact, and dividing the sequence): the hidden state
    is shared on its sequence outside the projections, each distinct column
    input gathered (``sequence_gathers`` all-gathers of
    ``sequence_gather_elems`` elements per sample in all, kept whole for the
    projections' backward) and each row output reduce-scattered;
    ``sequence_grad_sums`` replicated tensors (norm weights, row biases) have
    their gradients summed over the tp group, ``sequence_grad_sum_elems`` in
    all. ``sequence_stream_elems`` is the hidden state per sample (what a
    region's entry and exit gather), and ``sequence_linked`` says the layer's
    hidden state is its predecessor's output, passed on untouched, so two
    sequence-parallel neighbours hand over their shares without gathering.
    ``sequence_refusal`` says why sequence parallelism is not offered.
    """

    name: str
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    divisors: tuple[int, ...] = ()
    segments: dict[str, tuple[int, ...]] = field(default_factory=dict)
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)  # segments run whole (multi-query k/v)
    checked: tuple[int, ...] = ()
    sharded_params: int = 0
    sharded_flops_per_sample: float = 0.0
    sharded_activation_elems_per_sample: float = 0.0
    fwd_allreduce_elems: float = 0.0
    fwd_allreduce_count: int = 0
    bwd_allreduce_elems: float = 0.0
    bwd_allreduce_count: int = 0
    fwd_allgather_elems: float = 0.0
    sequence: tuple[int, ...] = ()
    sequence_refusal: str = ""
    sequence_linked: bool = False
    sequence_gathers: int = 0
    sequence_gather_elems: float = 0.0
    sequence_grad_sums: int = 0
    sequence_grad_sum_elems: int = 0
    sequence_stream_elems: float = 0.0
    # routed experts modules split across their hidden dimension (Megatron-Core's expert tensor parallelism,
    # ``passes/expert_tensor.py``): their FLOPs and parameters are in ``sharded_*``, their output's all-reduce
    # in the all-reduce counts (``autopar/sharding/experts.py``)
    experts: tuple[str, ...] = ()
    expert_width: int = 0
    # what of the layer the style leaves whole on every tp rank, and why (a sentence for the plan's notes; priced
    # so already: its FLOPs and parameters are not in ``sharded_*``)
    runs_whole: str = ""  # their intermediate size I, which tp divides (a fused gate-up [E, 2I, H], down [E, H, I])

    def admits_sequence(self, tp: int) -> bool:
        """Whether sequence parallelism on this style runs exact on ``tp`` ranks."""
        return tp in self.sequence and self.admits(tp)

    def admits(self, tp: int) -> bool:
        """Whether this style can run on ``tp`` ranks (every divisor divisible)."""
        if tp == 1:
            return True
        return tp >= 1 and all(d % tp == 0 for d in self.divisors) and (not self.checked or tp in self.checked)

    def cost_signature(self) -> tuple:
        """The style's name and numbers, without module paths: equal signatures price alike."""
        return (self.name, self.divisors, self.checked, self.sharded_params,
                round(self.sharded_flops_per_sample, 3),
                round(self.sharded_activation_elems_per_sample, 3),
                self.fwd_allreduce_elems, self.fwd_allreduce_count, self.bwd_allreduce_elems,
                self.bwd_allreduce_count, self.fwd_allgather_elems, self.sequence,
                self.sequence_gathers, self.sequence_gather_elems, self.sequence_grad_sums,
                self.sequence_grad_sum_elems, self.sequence_stream_elems, bool(self.experts))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("column", "row", "vocab", "divisors", "checked", "sequence", "experts"):
            d[key] = list(d[key])
        d["segments"] = {k: list(v) for k, v in self.segments.items()}
        d["whole"] = {k: list(v) for k, v in self.whole.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TPStyle:
        d = dict(d)
        d.pop("heads", None)  # older graphs: head counts, now read from the graph by simulation
        for key in ("column", "row", "vocab", "divisors", "checked", "sequence", "experts"):
            d[key] = tuple(d.get(key, ()))
        d["segments"] = {k: tuple(v) for k, v in d.get("segments", {}).items()}
        d["whole"] = {k: tuple(v) for k, v in d.get("whole", {}).items()}
        return cls(**d)
