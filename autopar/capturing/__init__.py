"""Capture: a model and example inputs → the :class:`~autopar.graph.LayerGraph` planning reads.

``trace`` traces (torch.fx, else torch.export), groups nodes into layers and
measures them, and has each layer's tensor-parallel styles found and proved by
:mod:`autopar.sharding`;
``twins`` replays a repeated layer's measurements instead of re-running it;
``layer_trace`` traces with each layer kept one module call, for the
pipeline stage split.
"""

from autopar.capturing.layer_trace import trace_layers
from autopar.capturing.trace import capture

__all__ = ["capture", "trace_layers"]
