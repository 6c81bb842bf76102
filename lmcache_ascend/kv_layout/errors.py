"""The one error type of KV-cache layout handling (pure logic)."""

from __future__ import annotations

__all__ = ["LayoutError"]


class LayoutError(ValueError):
    """A registered KV cache has a shape or placement the transfer path cannot serve."""
