"""The one error type of the worker's KV-cache handling (pure logic)."""

from __future__ import annotations

__all__ = ["KVCacheShapeError"]


class KVCacheShapeError(ValueError):
    """A registered KV cache has a shape or placement the transfer path cannot serve."""
