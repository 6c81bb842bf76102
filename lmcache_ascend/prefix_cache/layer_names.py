"""A readable error when the KV-cache tensors and the specs name different layers."""

from __future__ import annotations

from typing import Iterable, Mapping


class LayerNameMismatchError(ValueError):
    """The layers holding KV-cache tensors are not the layers that have specs."""

    def __init__(self, missing: list[str], extra: list[str], tensor_summary: str):
        self.missing = missing
        self.extra = extra
        super().__init__(
            "KV-cache tensors and KV-cache specs name different layers: "
            f"missing tensors for {len(missing)} layer(s) {missing}; "
            f"tensors without a spec for {len(extra)} layer(s) {extra}; "
            f"tensors: {tensor_summary}"
        )


def summarize_tensors(tensors_by_layer: Mapping[str, object], limit: int = 8) -> str:
    parts = []
    for name in list(tensors_by_layer)[:limit]:
        value = tensors_by_layer[name]
        shape = getattr(value, "shape", None)
        size = getattr(value, "size", None)
        if shape is not None:
            described = str(tuple(shape))
        elif isinstance(size, int):
            described = f"{type(value).__name__}({size} bytes)"
        else:
            described = type(value).__name__
        parts.append(f"{name}: {described}")
    more = len(tensors_by_layer) - limit
    return ", ".join(parts) + (f", ... (+{more} more)" if more > 0 else "") if parts else "(none)"


def check_layer_names(tensors_by_layer: Mapping[str, object], spec_layer_names: Iterable[str]) -> None:
    """Raise `LayerNameMismatchError` unless both sides name the same layers."""
    expected = set(spec_layer_names)
    present = set(tensors_by_layer)
    if expected == present:
        return
    raise LayerNameMismatchError(
        missing=sorted(expected - present),
        extra=sorted(present - expected),
        tensor_summary=summarize_tensors(tensors_by_layer),
    )
