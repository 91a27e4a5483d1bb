"""The runtime: lower a Plan for this rank and train it (:func:`compile`, :class:`ParallelModel`),
checkpoint it (:func:`latest_checkpoint`)."""

from autopar.runtime.build import compile, default_optimizer
from autopar.runtime.checkpoint import latest_checkpoint
from autopar.runtime.loss import default_loss
from autopar.runtime.model import ParallelModel

__all__ = ["ParallelModel", "compile", "default_loss", "default_optimizer", "latest_checkpoint"]
