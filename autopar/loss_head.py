"""The model's head as the chunked loss needs it: found at capture, kept on the LayerGraph.

A :class:`LossHead` is a plain ``nn.Linear`` whose output is the model's prediction — what the
default loss reads (:func:`autopar.runtime.loss.prediction`: ``.logits``, else the returned tensor)
— called once per forward, in the graph's last layer. Capture finds it
(:mod:`autopar.capturing.loss_head`) or records in one line why there is none; the contract
(:func:`autopar.contract.chunked_loss_refusal`) offers the chunked loss only where there is one.
Torch-free, like the graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class LossHead:
    """``module_path``: the head module; ``weight`` / ``bias``: its parameters' names as the model
    names them first (a tied weight: the embedding's name), ``bias`` None without one; ``tied``:
    whether the weight is shared with another module (an input embedding); ``in_features`` (the
    hidden size) and ``out_features`` (the vocabulary)."""

    module_path: str
    weight: str
    bias: str | None
    tied: bool
    in_features: int
    out_features: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LossHead:
        return cls(**d)


NOT_CHECKED = "the model's head was not examined at capture (a graph built without capture)"

__all__ = ["NOT_CHECKED", "LossHead"]
