"""A tiny deterministic RoPE transformer: ground truth for CacheBlend.

Random weights from a seed, a few pre-norm layers of multi-head attention
(RoPE, neox style) and a ReLU MLP, tied embeddings for logits.  Full prefill
of a prompt is the ground truth; `TinyRopeTransformer.blend_prefill` runs the
CacheBlend algorithm the way LMCache's blender does (all tokens recomputed up
to the check layer, then only the selected tokens, attending over cached KV
patched with their fresh rows), so standard CacheBlend, hole mode and plain
reuse can be measured against the truth without model weights.

It uses the package's own token selection (`lmcache_ascend.blend.selection`),
so what it measures is the selection the blender patch runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lmcache_ascend.blend.selection import RecomputeSelection, select_recompute_tokens
from tests.blend.reference.rope import RopeSpec, apply_rope

__all__ = ["BlendOutcome", "PromptKV", "RecomputeChooser", "TinyModelConfig", "TinyRopeTransformer"]

# (fresh keys, cached keys, cached-token mask) at the check layer -> the tokens to recompute.
RecomputeChooser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], RecomputeSelection]


@dataclass(frozen=True)
class TinyModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 4
    mlp_size: int = 128
    rope_base: float = 10000.0
    # Scale of the Q/K projections: larger makes attention peakier, so that
    # a token's KV depends clearly on its context (what CacheBlend repairs).
    attention_sharpness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyModelConfig hidden_size={self.hidden_size} is not a multiple "
                f"of num_heads={self.num_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"TinyModelConfig head size {self.hidden_size // self.num_heads} is odd; "
                "RoPE needs an even head size"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class PromptKV:
    """Per-layer K and V of a prompt, each ``[num_tokens, num_heads, head_dim]``
    (K after RoPE, as a paged KV cache holds it)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[0])

    def rows(self, start: int, end: int) -> "PromptKV":
        return PromptKV(
            tuple(k[start:end].clone() for k in self.keys),
            tuple(v[start:end].clone() for v in self.values),
        )


@dataclass(frozen=True)
class BlendOutcome:
    kv: PromptKV  # the KV cache the blend leaves for decoding
    # Final (normed) hidden states of the recomputed tokens, in the order
    # of `recomputed`; other tokens have none (CacheBlend never computes them).
    final_hidden: torch.Tensor
    recomputed: torch.Tensor  # int64 ascending token indices
    selection: RecomputeSelection | None


class _Layer:
    def __init__(self, config: TinyModelConfig, generator: torch.Generator) -> None:
        d, f = config.hidden_size, config.mlp_size

        def weight(rows: int, cols: int, scale: float) -> torch.Tensor:
            return torch.randn(rows, cols, generator=generator) * (scale / math.sqrt(rows))

        self.q_proj = weight(d, d, config.attention_sharpness)
        self.k_proj = weight(d, d, config.attention_sharpness)
        self.v_proj = weight(d, d, 1.0)
        self.o_proj = weight(d, d, 1.0)
        self.up_proj = weight(d, f, 1.0)
        self.down_proj = weight(f, d, 1.0)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


class TinyRopeTransformer:
    """See the module docstring.  Deterministic: same config, same numbers."""

    def __init__(self, config: TinyModelConfig | None = None) -> None:
        self.config = config or TinyModelConfig()
        generator = torch.Generator().manual_seed(self.config.seed)
        self.embedding = torch.randn(
            self.config.vocab_size, self.config.hidden_size, generator=generator
        )
        self.layers = [_Layer(self.config, generator) for _ in range(self.config.num_layers)]
        self.rope = RopeSpec(head_dim=self.config.head_dim, base=self.config.rope_base)

    # -- building blocks -------------------------------------------------
    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens shape {tuple(tokens.shape)}; need a non-empty 1-D sequence")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}); got "
                f"min {int(tokens.min())}, max {int(tokens.max())}"
            )
        return tokens

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], self.config.num_heads, self.config.head_dim)

    def project_qkv(
        self, layer_id: int, hidden: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K and V ``[tokens, heads, head_dim]`` of ``hidden`` at a layer;
        Q and K rotated for ``positions`` (None: unrotated, for callers that
        rotate later, as LMCache's blender does)."""
        layer = self.layers[layer_id]
        normed = _rms_norm(hidden)
        q = self._split_heads(normed @ layer.q_proj)
        k = self._split_heads(normed @ layer.k_proj)
        v = self._split_heads(normed @ layer.v_proj)
        if positions is None:
            return q, k, v
        return apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope), v

    @staticmethod
    def attend(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_index: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of the queries at ``query_index`` over all keys."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("shd,thd->hst", q, keys) * scale
        key_index = torch.arange(keys.shape[0])
        visible = key_index[None, :] <= query_index[:, None]
        scores = scores.masked_fill(~visible[None, :, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.einsum("hst,thd->shd", weights, values)

    def finish_layer(self, layer_id: int, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        layer = self.layers[layer_id]
        hidden = hidden + attention.reshape(hidden.shape[0], -1) @ layer.o_proj
        return hidden + torch.relu(_rms_norm(hidden) @ layer.up_proj) @ layer.down_proj

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return final_hidden @ self.embedding.T

    # -- full prefill (ground truth) -------------------------------------
    def prefill(self, tokens: torch.Tensor, start_position: int = 0) -> tuple[torch.Tensor, PromptKV]:
        """Final hidden states of every token and the prompt's KV."""
        tokens = self._check_tokens(tokens)
        count = tokens.shape[0]
        positions = torch.arange(start_position, start_position + count)
        token_index = torch.arange(count)
        hidden = self.embedding[tokens]
        keys, values = [], []
        for layer_id in range(self.config.num_layers):
            q, k, v = self.project_qkv(layer_id, hidden, positions)
            keys.append(k)
            values.append(v)
            hidden = self.finish_layer(layer_id, hidden, self.attend(q, k, v, token_index))
        return _rms_norm(hidden), PromptKV(tuple(keys), tuple(values))

    # -- CacheBlend -------------------------------------------------------
    def blend_prefill(
        self,
        tokens: torch.Tensor,
        cached: PromptKV,
        cached_token_mask: torch.Tensor,
        check_layer: int,
        recompute_ratio: float,
        budget_ranges: Sequence[tuple[int, int]] | None = None,
        *,
        choose: RecomputeChooser | None = None,
    ) -> BlendOutcome:
        """CacheBlend over a prompt whose cached rows are in ``cached``.

        ``cached`` holds, for every prompt token, K (already rotated for the
        token's NEW position) and V; rows where ``cached_token_mask`` is False
        are ignored (they may hold garbage: the tests fill them with NaN).
        Layers before ``check_layer`` recompute every token; at it the
        selection (holes + top-k by K deviation) is made; from then on only
        the selected tokens are recomputed and the others keep cached KV.
        ``check_layer=0`` with ratio 0 is plain reuse without blending.
        ``budget_ranges``: see `select_recompute_tokens`.
        ``choose``: picks the tokens at the check layer instead of the ratio
        rule (``recompute_ratio`` and ``budget_ranges`` are then unused), e.g.
        a fixed number of tokens for comparisons at equal budget.
        """
        tokens = self._check_tokens(tokens)
        count = tokens.shape[0]
        if cached.num_tokens != count:
            raise ValueError(f"cached KV has {cached.num_tokens} rows for {count} tokens")
        if not 0 <= check_layer < self.config.num_layers:
            raise ValueError(
                f"check_layer={check_layer}; allowed: 0 to {self.config.num_layers - 1}"
            )
        positions = torch.arange(count)
        selected = torch.arange(count)
        hidden = self.embedding[tokens]
        selection: RecomputeSelection | None = None
        keys, values = [], []
        for layer_id in range(self.config.num_layers):
            q, k, v = self.project_qkv(layer_id, hidden, positions[selected])
            if layer_id == check_layer:
                if choose is None:
                    selection = select_recompute_tokens(
                        k, cached.keys[layer_id], cached_token_mask, recompute_ratio, budget_ranges
                    )
                else:
                    selection = choose(k, cached.keys[layer_id], cached_token_mask)
                keep = selection.indices
                q, k, v, hidden = q[keep], k[keep], v[keep], hidden[keep]
                selected = keep
            if layer_id < check_layer:
                layer_keys, layer_values = k, v
            else:
                layer_keys = cached.keys[layer_id].clone()
                layer_values = cached.values[layer_id].clone()
                layer_keys[selected] = k
                layer_values[selected] = v
            keys.append(layer_keys)
            values.append(layer_values)
            attention = self.attend(q, layer_keys, layer_values, selected)
            hidden = self.finish_layer(layer_id, hidden, attention)
        return BlendOutcome(
            kv=PromptKV(tuple(keys), tuple(values)),
            final_hidden=_rms_norm(hidden),
            recomputed=selected,
            selection=selection,
        )
