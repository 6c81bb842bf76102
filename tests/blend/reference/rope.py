"""Rotary position embedding and re-rotation of cached K to new positions.

A document's cached K was rotated for the positions it had when stored.
RoPE rotates each feature pair by ``position * inv_freq``, and rotations by
angles a and b compose to a rotation by a + b, so moving cached K from
position p to position p' is one more rotation by ``(p' - p) * inv_freq``:
no need to undo the old rotation first.  Re-rotated K equals K recomputed at
the new positions (up to rounding), which the tests check.

Pure torch; the layout is ``[num_tokens, num_heads, head_dim]`` (any number
of middle dimensions is fine: the last one is rotated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["RopeSpec", "apply_rope", "rerotate_keys"]

RopeStyle = Literal["neox", "gptj"]


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates: ``rotary_dim`` leading features of each head.

    ``neox``: feature i pairs with i + rotary_dim/2 (vLLM ``is_neox_style``);
    ``gptj``: feature 2i pairs with 2i + 1.
    """

    head_dim: int
    rotary_dim: int | None = None  # None = the whole head
    base: float = 10000.0
    style: RopeStyle = "neox"

    def __post_init__(self) -> None:
        rotary = self.rotary_width
        if self.head_dim <= 0:
            raise ValueError(f"RopeSpec head_dim={self.head_dim}; allowed: > 0")
        if rotary <= 0 or rotary > self.head_dim or rotary % 2:
            raise ValueError(
                f"RopeSpec rotary_dim={self.rotary_dim} (head_dim={self.head_dim}); "
                "allowed: an even number in (0, head_dim]"
            )
        if self.style not in ("neox", "gptj"):
            raise ValueError(f"RopeSpec style={self.style!r}; allowed: 'neox', 'gptj'")
        if not self.base > 0:
            raise ValueError(f"RopeSpec base={self.base}; allowed: > 0")

    @property
    def rotary_width(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def inverse_frequencies(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_width, 2, dtype=torch.float64)
        return 1.0 / (self.base ** (exponents / self.rotary_width))


def _rotate(x: torch.Tensor, angle_positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    if x.shape[-1] != spec.head_dim:
        raise ValueError(
            f"tensor last dimension {x.shape[-1]} != RopeSpec head_dim {spec.head_dim}"
        )
    if angle_positions.dim() != 1 or angle_positions.shape[0] != x.shape[0]:
        raise ValueError(
            f"positions shape {tuple(angle_positions.shape)}; need one position "
            f"per token, i.e. ({x.shape[0]},)"
        )
    # Angles in float64 so that large positions keep their precision; the
    # product is then done in at least float32.
    angles = angle_positions.to(torch.float64)[:, None] * spec.inverse_frequencies()[None, :]
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    cos = angles.cos().to(compute_dtype)
    sin = angles.sin().to(compute_dtype)
    # Broadcast over every middle dimension (heads).
    for _ in range(x.dim() - 2):
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
    width = spec.rotary_width
    rotary = x[..., :width].to(compute_dtype)
    if spec.style == "neox":
        first, second = rotary[..., : width // 2], rotary[..., width // 2 :]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    else:
        first, second = rotary[..., 0::2], rotary[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1)
        rotated = rotated.flatten(-2)
    out = x.clone()
    out[..., :width] = rotated.to(x.dtype)
    return out


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """``x`` rotated for ``positions`` (one per token, first dimension)."""
    return _rotate(x, positions, spec)


def rerotate_keys(
    keys: torch.Tensor,
    stored_positions: torch.Tensor,
    new_positions: torch.Tensor,
    spec: RopeSpec,
) -> torch.Tensor:
    """Cached ``keys`` rotated for ``stored_positions``, moved to ``new_positions``."""
    if stored_positions.shape != new_positions.shape:
        raise ValueError(
            f"stored_positions shape {tuple(stored_positions.shape)} != "
            f"new_positions shape {tuple(new_positions.shape)}; need one of each per token"
        )
    shift = new_positions.to(torch.int64) - stored_positions.to(torch.int64)
    return _rotate(keys, shift, spec)
