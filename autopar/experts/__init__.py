"""Routed experts in one home: the description capture writes (``description``), every library's names for
an experts layer's parts (``layouts``: the one module that names them), and the ways a block calls its
experts, run whole or split over ranks (``calls``)."""

from autopar.experts.description import (
    DEFAULT_IMBALANCE_MARGIN,
    Call,
    Dispatch,
    ExpertLayout,
    MoEFacts,
    RouterKind,
)

__all__ = ["DEFAULT_IMBALANCE_MARGIN", "Call", "Dispatch", "ExpertLayout", "MoEFacts", "RouterKind"]
