"""Per-KV-cache-group plan of LMCache 0.4.x's MP server (import-free).

LMCache 0.4.5's MP server takes one flat block-id list per store/retrieve and
slices it with one ``blocks_per_chunk`` for every layer group; its layer
groups are keyed by shape and dtype, and a "compressed" group shares the
engine's block ids. vLLM's hybrid manager gives each KV-cache group its own
block table and block size (DeepSeek-V4 on CUDA: 256/64/64/4/8 tokens per
block against vLLM's 4). This module holds what the server needs to move such
a model: which registered layer belongs to which KV-cache group, each group's
tokens per block, and the per-chunk slice of each group's block ids.

How the two sides agree (see `lmcache_ascend.multigroup.mp_wire`): a
multi-group connector registers with the `LayoutHints` keys below; a server
that speaks the per-group format answers the registration with
`server_answer()`; one that does not answers nothing (msgspec drops the unknown
hint keys), and the connector refuses its first multi-group request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lmcache_ascend.multigroup.mp_wire import FLAT, PER_GROUP, WireFormatMismatch

__all__ = [
    "HINT_CLIENT",
    "HINT_ENGINE_BLOCK_SIZE",
    "HINT_GROUP_BLOCK_SIZES",
    "HINT_LAYER_GROUPS",
    "ServerGroupPlan",
    "block_ids_format",
    "check_request_format",
    "chunk_block_ids",
    "client_hints",
    "layer_kv_groups",
    "plan_from_hints",
    "retrieve_batches",
    "server_answer",
    "server_format_from_answer",
    "skip_blocks",
]

# LayoutHints keys a multi-group connector adds to REGISTER_KV_CACHE.
HINT_CLIENT = "lmcache_ascend_client"  # who sends per-group ids, e.g. "lmcache-ascend 0.1 on vLLM 0.18.1"
HINT_LAYER_GROUPS = "lmcache_ascend_layer_kv_groups"  # per registered layer, its KV-cache group id
HINT_GROUP_BLOCK_SIZES = "lmcache_ascend_group_block_sizes"  # per KV-cache group, tokens per block
# LMCache 0.4.x's own LayoutHints key of the engine's block size (tokens per block)
HINT_ENGINE_BLOCK_SIZE = "inference_engine_logical_block_size"

_ANSWER_PREFIX = f"{PER_GROUP} from "


@dataclass(frozen=True)
class ServerGroupPlan:
    """Which registered layers each KV-cache group holds, and its tokens per block."""

    layer_groups: tuple[int, ...]  # per registered layer (registration order), its KV-cache group id
    block_sizes: tuple[int, ...]  # per KV-cache group, tokens per block
    client: str

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def layers_of(self, group: int) -> list[int]:
        return [layer for layer, owner in enumerate(self.layer_groups) if owner == group]

    def blocks_per_chunk(self, chunk_size: int) -> tuple[int, ...]:
        """Per KV-cache group, its blocks in one LMCache chunk; each block size must divide the chunk."""
        bad = [(g, size) for g, size in enumerate(self.block_sizes) if chunk_size % size]
        if bad:
            raise ValueError(
                f"LMCache chunk size {chunk_size} is not a multiple of the block size of KV-cache group(s) "
                + ", ".join(f"{g} ({size} tokens)" for g, size in bad)
                + "; allowed: a chunk size every group's block size divides"
            )
        return tuple(chunk_size // size for size in self.block_sizes)


def layer_kv_groups(layer_names: Sequence[str], group_layer_names: Sequence[Sequence[str]]) -> list[int]:
    """Per layer of `layer_names` (registration order), the index of the KV-cache group listing it."""
    owner: dict[str, int] = {}
    for group, names in enumerate(group_layer_names):
        for name in names:
            owner.setdefault(name, group)
    missing = [name for name in layer_names if name not in owner]
    if missing:
        raise ValueError(
            f"registered KV-cache layers {missing} belong to no KV-cache group; the groups list "
            f"{sum(len(names) for names in group_layer_names)} layer names"
        )
    return [owner[name] for name in layer_names]


def client_hints(layer_groups: Sequence[int], block_sizes: Sequence[int], client: str) -> dict[str, Any]:
    """The LayoutHints entries a multi-group connector registers with (checked as the server checks them)."""
    hints = {HINT_CLIENT: client, HINT_LAYER_GROUPS: list(layer_groups), HINT_GROUP_BLOCK_SIZES: list(block_sizes)}
    plan_from_hints(hints, len(layer_groups))
    return hints


def plan_from_hints(hints: Mapping[str, Any] | None, num_layers: int) -> ServerGroupPlan | None:
    """The per-group plan a registration announces, or None for a registration of the flat protocol."""
    if not hints or HINT_LAYER_GROUPS not in hints:
        return None
    layer_groups = hints.get(HINT_LAYER_GROUPS)
    block_sizes = hints.get(HINT_GROUP_BLOCK_SIZES)
    client = hints.get(HINT_CLIENT)
    if not isinstance(client, str) or not client:
        raise ValueError(f"layout hint {HINT_CLIENT}={client!r}; allowed: a non-empty string naming the connector")
    if not _int_list(block_sizes) or min(block_sizes) <= 0:
        raise ValueError(
            f"layout hint {HINT_GROUP_BLOCK_SIZES}={block_sizes!r}; allowed: a non-empty list of block sizes > 0"
        )
    if not _int_list(layer_groups) or len(layer_groups) != num_layers:
        raise ValueError(
            f"layout hint {HINT_LAYER_GROUPS}={layer_groups!r}; allowed: one KV-cache group id per registered "
            f"layer ({num_layers})"
        )
    outside = sorted({g for g in layer_groups if not 0 <= g < len(block_sizes)})
    empty = [g for g in range(len(block_sizes)) if g not in set(layer_groups)]
    if outside or empty:
        raise ValueError(
            f"layout hint {HINT_LAYER_GROUPS} names group(s) {outside} outside 0..{len(block_sizes) - 1} or leaves "
            f"group(s) {empty} without a layer; allowed: every layer in a group, every group with a layer"
        )
    return ServerGroupPlan(tuple(layer_groups), tuple(block_sizes), client)


def _int_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def server_answer(server: str) -> str:
    """What a per-group server answers a per-group registration with (`server` names it and its version)."""
    return f"{_ANSWER_PREFIX}{server}"


def server_format_from_answer(answer: object) -> tuple[str, str | None]:
    """(`PER_GROUP` or `FLAT`, the server's own name) from its answer to a per-group registration."""
    if answer is None:
        return FLAT, None  # a server without the per-group protocol answers a registration with nothing
    if isinstance(answer, str) and answer.startswith(_ANSWER_PREFIX):
        return PER_GROUP, answer[len(_ANSWER_PREFIX):]
    raise ValueError(f"LMCache MP server answered a registration with {answer!r}; allowed: None or {_ANSWER_PREFIX!r}...")


def block_ids_format(block_ids: Sequence[Any]) -> str:
    """`FLAT` for a list of ints, `PER_GROUP` for a list of int lists; anything else raises."""
    if all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        return FLAT
    if all(isinstance(ids, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in ids) for ids in block_ids):
        return PER_GROUP
    raise ValueError(f"block ids mix ints and lists ({block_ids!r:.80}); allowed: {FLAT} or {PER_GROUP}")


def check_request_format(sent: str, registered: str, versions: Mapping[str, str | None]) -> None:
    """Refuse a request whose block-id format differs from the one its instance registered with."""
    if sent == registered:
        return
    sides = ", ".join(f"{side} {version or 'unknown'}" for side, version in versions.items())
    raise WireFormatMismatch(
        f"LMCache MP wire format mismatch ({sides}): the request carries {sent} block ids but its KV caches "
        f"were registered for {registered}; refusing the request instead of a mis-sliced transfer"
    )


def chunk_block_ids(
    block_ids_by_group: Sequence[Sequence[int]], blocks_per_chunk: Sequence[int], num_chunks: int
) -> list[list[list[int]]]:
    """Per chunk, per KV-cache group, that group's block ids; each group must cover exactly `num_chunks` chunks."""
    if len(block_ids_by_group) != len(blocks_per_chunk):
        raise ValueError(
            f"block ids of {len(block_ids_by_group)} KV-cache groups for a registration of "
            f"{len(blocks_per_chunk)} groups; allowed: exactly one list per group"
        )
    wrong = [
        f"group {g}: {len(ids)} ids, {num_chunks * per} needed"
        for g, (ids, per) in enumerate(zip(block_ids_by_group, blocks_per_chunk))
        if len(ids) != num_chunks * per
    ]
    if wrong:
        raise ValueError(
            f"block ids do not cover {num_chunks} chunk(s) of blocks per chunk {list(blocks_per_chunk)}: "
            + "; ".join(wrong)
        )
    return [
        [list(ids[chunk * per:(chunk + 1) * per]) for ids, per in zip(block_ids_by_group, blocks_per_chunk)]
        for chunk in range(num_chunks)
    ]


def skip_blocks(skip_tokens: int, block_size: int) -> int:
    """Whole blocks of `block_size` tokens among the first `skip_tokens` tokens (a partial block is written)."""
    if skip_tokens < 0 or block_size <= 0:
        raise ValueError(f"skip_tokens={skip_tokens}, block_size={block_size}; allowed: skip >= 0, block size > 0")
    return skip_tokens // block_size


def retrieve_batches(num_chunks: int, batch: int, chunk_size: int, skip_first_n_tokens: int) -> list[tuple[int, int, int]]:
    """(first chunk, chunks, tokens to skip in them) per batch of at most `batch` chunks.

    The first `skip_first_n_tokens` tokens are already in the engine's own prefix
    cache; a batch lying wholly inside them is left out (upstream's rule).
    """
    if batch < 1 or chunk_size < 1 or num_chunks < 0 or skip_first_n_tokens < 0:
        raise ValueError(
            f"num_chunks={num_chunks}, batch={batch}, chunk_size={chunk_size}, skip_first_n_tokens="
            f"{skip_first_n_tokens}; allowed: batch and chunk size >= 1, the others >= 0"
        )
    batches = []
    for first in range(0, num_chunks, batch):
        count = min(batch, num_chunks - first)
        skip = max(0, skip_first_n_tokens - first * chunk_size)
        if skip < count * chunk_size:
            batches.append((first, count, skip))
    return batches
