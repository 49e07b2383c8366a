"""Capture: a model and an example batch in, one training step's :class:`OpGraph` out."""

from explorer.capture.tracing import capture, captured_graph

__all__ = ["capture", "captured_graph"]
