"""What each KV-cache spec type means for prefix reuse: KV to move, safe to skip, or no reuse.

Every spec type of the pinned vLLM and vllm-ascend versions is listed in `SPEC_KINDS`
by class name, with one of three kinds:

- ``MOVE``: per-token (or per compressed row) KV that the overlay's row rules
  move exactly (full attention, sliding windows, MLA, compressed MLA);
- ``SKIP``: DeepSeek-V4's compressor/indexer ``*State*`` specs on vllm-ascend,
  the only groups ``LMCACHE_ASCEND_SKIP_STATE_GROUPS`` may leave out. They are
  moved by default: a prefill resumed after a reused prefix reads state rows
  from before the chunk boundary (the ratio-4 compressors' windows overlap the
  previous window; any ratio reads its open window when the prefix does not end
  on a multiple of the ratio, as when LMCache recomputes a whole prompt's last
  token), so leaving them out would change the outputs;
- ``NO_REUSE``: state or KV without which a reused prefix cannot be exact here
  (a Mamba layer's recurrent state is the state after the whole request, not
  per token; cross-attention KV comes from the encoder input, not the prefix;
  layouts the overlay has no row rule for), or nothing to reuse at all
  (encoder-only attention). A model with such a group gets no reuse from
  LMCache: every lookup reports nothing, and the start log says why.

`classify` takes a spec's class name and the names of its ancestors (the MRO,
most derived first), so it runs without importing vLLM: the first name found in
the table decides. A spec none of whose classes is listed (or only the abstract
bases) is refused, naming it. ``UniformTypeKVCacheSpecs`` is a bundle: its
member specs are classified.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = [
    "BUNDLE_SPEC_NAMES",
    "SPEC_KINDS",
    "SpecKind",
    "SpecVerdict",
    "UnknownSpecError",
    "classify",
    "known_spec_names",
]


class SpecKind(enum.Enum):
    MOVE = "KV to move"
    SKIP = "compressor state, skipped only on request"
    NO_REUSE = "state without which reuse is impossible"


class UnknownSpecError(ValueError):
    """A KV-cache spec type that is not classified."""


@dataclass(frozen=True)
class SpecVerdict:
    kind: SpecKind
    reason: str
    classified_as: str  # the table entry that decided (the class itself or an ancestor)


_RECURRENT = (
    "a state-space layer keeps one recurrent state per request (the state after its last token), "
    "not per-token KV: a prefix's state cannot be read from a later request's cache"
)
_NO_ROW_RULE = "the overlay has no exact row rule for this layout"
_COMPRESSOR_STATE = (
    "DeepSeek-V4 compressor state: a resumed prefill reads its rows from before the chunk boundary "
    "(overlapping ratio-4 windows; an open window where the prefix does not end on a multiple of the ratio), "
    "so it is moved unless LMCACHE_ASCEND_SKIP_STATE_GROUPS asks to skip it"
)

# name -> (kind, reason). Abstract bases are absent on purpose: a spec that is only a
# KVCacheSpec / AttentionSpec is not known.
SPEC_KINDS: dict[str, tuple[SpecKind, str]] = {
    # vLLM (vllm.v1.kv_cache_interface, 0.18 to 0.33)
    "FullAttentionSpec": (SpecKind.MOVE, "per-token K/V"),
    "TQFullAttentionSpec": (
        SpecKind.NO_REUSE, f"TurboQuant slots: a token's bytes come from tq_slot_size, not heads x head size; {_NO_ROW_RULE}"
    ),
    "MLAAttentionSpec": (SpecKind.MOVE, "per-token latent KV (one row per token, or per compress_ratio tokens)"),
    "SlidingWindowSpec": (SpecKind.MOVE, "per-token K/V; each chunk's last window is moved"),
    "SlidingWindowMLASpec": (SpecKind.MOVE, "per-token latent KV in a sliding window"),
    "EncoderOnlyAttentionSpec": (SpecKind.NO_REUSE, "encoder-only attention keeps no KV between steps: nothing to reuse"),
    "MambaSpec": (SpecKind.NO_REUSE, _RECURRENT),
    "CrossAttentionSpec": (SpecKind.NO_REUSE, "cross-attention KV is computed from the encoder input, not the prefix"),
    "ChunkedLocalAttentionSpec": (
        SpecKind.NO_REUSE, f"chunk-local attention frees blocks outside the current attention chunk; {_NO_ROW_RULE}"
    ),
    "SinkFullAttentionSpec": (SpecKind.NO_REUSE, f"attention-sink blocks precede the prompt's; {_NO_ROW_RULE}"),
    "RSWASpec": (SpecKind.NO_REUSE, f"R-SWA evicts gap blocks between prefill and decode window; {_NO_ROW_RULE}"),
    "CircularBufferSpec": (
        SpecKind.NO_REUSE, "a ring of the keys still being compressed (one block per request), not per-token KV"
    ),
    "HiSparseHotSpec": (SpecKind.NO_REUSE, "HiSparse hot cache: per-request scratch, not prefix-cacheable in vLLM"),
    "HiSparseResidentSpec": (SpecKind.NO_REUSE, "HiSparse resident pages: not prefix-cacheable in vLLM"),
    "HiddenStateCacheSpec": (SpecKind.NO_REUSE, "hidden states extracted for another consumer, not attention KV"),
    # vllm-ascend (vllm_ascend.core.kv_cache_interface, patch_kv_cache_interface)
    "AscendMLAAttentionSpec": (SpecKind.MOVE, "per-token MLA planes (latent, rope, indexer keys, scales)"),
    "AscendSlidingWindowMLASpec": (SpecKind.MOVE, "per-token latent KV in a sliding window"),
    # vllm-ascend's DeepSeek-V4 compressor / indexer state (C4 indexer KV itself is MLA KV)
    "C4AttnKVState": (SpecKind.SKIP, _COMPRESSOR_STATE),
    "C4AttnScoreState": (SpecKind.SKIP, _COMPRESSOR_STATE),
    "C4IndexerKVState": (SpecKind.SKIP, _COMPRESSOR_STATE),
    "C4IndexerScoreState": (SpecKind.SKIP, _COMPRESSOR_STATE),
    "C128AttnKVState": (SpecKind.SKIP, _COMPRESSOR_STATE),
    "C128AttnScoreState": (SpecKind.SKIP, _COMPRESSOR_STATE),
}

# Wrappers whose members are the specs to classify.
BUNDLE_SPEC_NAMES: frozenset[str] = frozenset({"UniformTypeKVCacheSpecs"})


def names_of_kind(kind: SpecKind) -> tuple[str, ...]:
    """The spec type names the table gives `kind`, sorted."""
    return tuple(sorted(name for name, (entry_kind, _) in SPEC_KINDS.items() if entry_kind is kind))


def known_spec_names() -> frozenset[str]:
    """Every spec type name the table (or the bundle list) knows."""
    return frozenset(SPEC_KINDS) | BUNDLE_SPEC_NAMES


def classify(class_name: str, ancestor_names: Sequence[str] | Iterable[str] = ()) -> SpecVerdict:
    """The verdict for a spec of class `class_name` whose MRO names are `ancestor_names`."""
    for name in (class_name, *ancestor_names):
        entry = SPEC_KINDS.get(name)
        if entry is not None:
            return SpecVerdict(kind=entry[0], reason=entry[1], classified_as=name)
    raise UnknownSpecError(
        f"KV-cache spec type {class_name!r} (classes {[class_name, *ancestor_names]}) is not classified: "
        "lmcache-ascend cannot tell whether it is KV to move, compressor state it may skip on request, "
        f"or state that makes reuse impossible; known types: {', '.join(sorted(SPEC_KINDS))}"
    )
