"""Capture: a model and example inputs → the :class:`~autopar.graph.LayerGraph` planning reads.

``trace`` traces (torch.fx, else torch.export), groups nodes into layers and
measures them; ``tp_detect`` finds each layer's tensor-parallel styles;
``twins`` replays a repeated layer's measurements instead of re-running it.
"""

from autopar.capturing.trace import capture, trace_layers

__all__ = ["capture", "trace_layers"]
