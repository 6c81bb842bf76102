"""Block ids of LMCache's multi-process (MP) protocol, per KV-cache group (import-free).

An MP store or retrieve names a token range [start, end) counted in vLLM
blocks; each KV-cache group g holds that range in its own block table, sliced
by the rule of `lmcache_ascend.multigroup.slicing.group_block_range`. The
message carries ``list[list[int]]`` indexed by group (vLLM #42437 / LMCache
#3261). An MP server of the old format (LMCache 0.4.x, ``list[int]``) can only
take one group: a single-group model sends it the flat list exactly as
before, a multi-group model is refused with both versions named, before any
transfer, rather than sending a list the server would slice as one group.

LMCache 0.4.x's worker adapter learns its server's format when it registers
(`lmcache_ascend.multigroup.mp_server`): there the scheduler hands the worker
per-group slices of a multi-group model (`NEGOTIATED`) and the worker encodes
them for the server's answer (`encode_for_server`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lmcache_ascend.multigroup.slicing import group_block_range, prefix_bound_in_vllm_blocks

__all__ = [
    "FLAT",
    "NEGOTIATED",
    "PER_GROUP",
    "WireFormatMismatch",
    "block_ids_wire_format",
    "encode_block_ids",
    "encode_for_server",
    "group_block_slices",
    "tracked_prefix_bound",
]

PER_GROUP = "list[list[int]]"
FLAT = "list[int]"
# Flat-annotated ops of a worker adapter that learns the server's format at registration:
# a single-group model's ids travel flat, a multi-group model's per group, encoded by the worker.
NEGOTIATED = "negotiated at registration"


class WireFormatMismatch(RuntimeError):
    """The connector's per-group block ids cannot be expressed in the server's format."""


def block_ids_wire_format(load_store_op_cls: type) -> str:
    """`PER_GROUP` or `FLAT`: the ``block_ids`` annotation of an MP ``LoadStoreOp`` class."""
    annotations: dict[str, Any] = {}
    for klass in reversed(load_store_op_cls.__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    if "block_ids" not in annotations:
        raise TypeError(f"{load_store_op_cls.__qualname__} has no block_ids field; cannot tell its wire format")
    text = str(annotations["block_ids"]).replace("typing.", "").replace("List", "list").replace(" ", "")
    if text == PER_GROUP:
        return PER_GROUP
    if text == FLAT:
        return FLAT
    raise TypeError(
        f"{load_store_op_cls.__qualname__}.block_ids is annotated {text!r}; "
        f"allowed: {PER_GROUP!r} or {FLAT!r}"
    )


def tracked_prefix_bound(
    block_ids_by_group: Sequence[Sequence[int]], block_size_by_group: Sequence[int], vllm_block_size: int
) -> int:
    """Whole vLLM blocks every group's tracked block table covers (a group with none counts 0)."""
    if len(block_ids_by_group) != len(block_size_by_group):
        raise ValueError(
            f"block ids of {len(block_ids_by_group)} groups but block sizes of "
            f"{len(block_size_by_group)} groups; one entry per KV-cache group is needed"
        )
    return prefix_bound_in_vllm_blocks(
        {g: len(ids) for g, ids in enumerate(block_ids_by_group)},
        dict(enumerate(block_size_by_group)),
        vllm_block_size,
    )


def group_block_slices(
    block_ids_by_group: Sequence[Sequence[int]],
    block_size_by_group: Sequence[int],
    vllm_block_size: int,
    start_vllm_block: int,
    end_vllm_block: int,
) -> list[list[int]]:
    """Each group's block ids for the vLLM-block range [start, end), one list per group."""
    if len(block_ids_by_group) != len(block_size_by_group):
        raise ValueError(
            f"block ids of {len(block_ids_by_group)} groups but block sizes of "
            f"{len(block_size_by_group)} groups; one entry per KV-cache group is needed"
        )
    slices = []
    for group, (ids, size) in enumerate(zip(block_ids_by_group, block_size_by_group)):
        lo, hi = group_block_range(start_vllm_block, end_vllm_block, size, vllm_block_size)
        if hi > len(ids):
            raise ValueError(
                f"KV-cache group {group} (block size {size}) has {len(ids)} blocks; the vLLM-block "
                f"range [{start_vllm_block}, {end_vllm_block}) needs its blocks [{lo}, {hi})"
            )
        slices.append(list(ids[lo:hi]))
    return slices


def encode_block_ids(
    slices: list[list[int]], wire_format: str, versions: Mapping[str, str | None]
) -> list[list[int]] | list[int]:
    """`slices` in the server's format; refuses what the format cannot carry.

    `versions` names the two sides for the error (e.g. {"connector": "vLLM
    0.18.1", "server protocol": "LMCache 0.4.5"}).
    """
    if wire_format == PER_GROUP:
        return slices
    if wire_format not in (FLAT, NEGOTIATED):
        raise ValueError(f"wire_format={wire_format!r}; allowed: {PER_GROUP!r}, {FLAT!r} or {NEGOTIATED!r}")
    if len(slices) == 1:
        return slices[0]
    if wire_format == NEGOTIATED:
        return slices
    sides = ", ".join(f"{side} {version or 'unknown'}" for side, version in versions.items())
    raise WireFormatMismatch(
        f"LMCache MP wire format mismatch ({sides}): the connector sends block ids of "
        f"{len(slices)} KV-cache groups ({PER_GROUP}) but the server's protocol takes {FLAT} "
        "(one group); refusing the request instead of a mis-sliced transfer. Use an LMCache "
        "MP server that takes per-group block ids, or run the model with one KV-cache group."
    )


def encode_for_server(
    block_ids: list[int] | list[list[int]], server_format: str, versions: Mapping[str, str | None]
) -> list[int] | list[list[int]]:
    """A `NEGOTIATED` op's block ids in the format its server answered the registration with.

    Flat ids (a single-group model) travel as they are; per-group ids go to a
    per-group server as they are and are refused by a flat one.
    """
    if all(not isinstance(ids, list) for ids in block_ids):
        return block_ids
    return encode_block_ids(list(block_ids), server_format, versions)
