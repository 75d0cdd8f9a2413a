"""The error a `model` argument raises when it cannot become a local model directory.

Its own module, below `source.py` and the GGUF converter, so that both raise it without importing
each other.
"""

from __future__ import annotations


class ModelSourceError(ValueError):
    """A `model` argument that cannot be turned into a local model directory; one-line message."""
