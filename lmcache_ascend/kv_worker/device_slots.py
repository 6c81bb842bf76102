"""A request's slots on the device, from the block ids the scheduler shipped (`DeviceSlots`).

Every scheduler group's slots in one tensor, made once per request and step: where
the transfer kernel runs (Triton on CUDA or an NPU), the ids and one plan entry per
group are uploaded and one launch expands them there (`kernels.block_slots`);
elsewhere the ids are expanded on the host (a few numpy operations per group) and
copied at once. Either way the cached prefix of a load is masked, rows on vLLM's
null block are -1, and ids outside the worker's caches are refused before anything
moves.

Pure logic: torch, numpy and lmcache_ascend only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch

from lmcache_ascend.kernels import select_backend
from lmcache_ascend.kernels.upload import to_device
from lmcache_ascend.kv_worker.errors import KVCacheShapeError
from lmcache_ascend.multigroup.slots import GroupGeometry, StepBlockIds
from lmcache_ascend.multigroup.specs import KVGroupSpec, RowKey, cached_row_count
from lmcache_ascend.multigroup.tracker import NULL_BLOCK_ID

__all__ = ["DeviceSlots"]


def _expand_block_ids(block_ids: np.ndarray, groups: Sequence[tuple[int, int, int, int, int, int]], out: np.ndarray) -> None:
    """Write every group's slots into `out` from `block_ids` (int64 numpy arrays).

    Per group (first output row, rows, first block, blocks, rows per block, cached rows): -1
    over vLLM's cached prefix; from the first block past it, its whole blocks broadcast
    against the row offsets of a block straight into `out`, ``block_id * rows_per_block +
    offset``, and the rows of a last, partly used block; -1 for every row of vLLM's null block.
    """
    for first_row, num_rows, first_block, num_blocks, rows_per_block, cached_rows in groups:
        ids = block_ids[first_block : first_block + num_blocks]
        whole = num_rows // rows_per_block
        computed = min(cached_rows // rows_per_block, whole)  # blocks wholly cached are not computed
        rows = out[first_row + computed * rows_per_block : first_row + whole * rows_per_block].reshape(
            whole - computed, rows_per_block
        )
        np.add(ids[computed:whole, None] * rows_per_block, np.arange(rows_per_block, dtype=np.int64), out=rows)
        null = ids[computed:whole] == NULL_BLOCK_ID
        if np.count_nonzero(null):
            rows[null] = -1
        rest = num_rows - whole * rows_per_block
        if rest:
            last = int(ids[whole])
            out[first_row + whole * rows_per_block : first_row + num_rows] = (
                -1 if last == NULL_BLOCK_ID else last * rows_per_block + np.arange(rest, dtype=np.int64)
            )
        if cached_rows:
            out[first_row : first_row + cached_rows] = -1


@dataclass(frozen=True)
class _ExpansionPlan:
    """Where one request's slots go in its share of the expansion (see `_expand_block_ids`)."""

    groups: list  # per slot mapping: (first row, rows, first block, blocks, rows per block, cached rows)
    offsets: dict  # RowKey -> first row
    lengths: dict  # RowKey -> rows
    rows: int


def _expansion_plan(step: StepBlockIds, geometry: GroupGeometry, cached_tokens: int) -> _ExpansionPlan:
    """Check `step` against the worker's `geometry` (its digest) and lay its rows out, group after group."""
    plan = []
    offsets: dict[int, int] = {}
    lengths: dict[int, int] = {}
    rows_total = 0
    blocks_total = 0
    groups = geometry.groups
    for group, count in step.group_block_counts(geometry).items():
        spec = groups[group]
        # One slot mapping per compress ratio of the group's layers, all from the group's one list of ids.
        for key in spec.row_keys:
            rows = spec.at_ratio(key[1])
            num_rows = rows.num_rows(step.num_tokens)
            plan.append((rows_total, num_rows, blocks_total, count, rows.rows_per_block,
                         cached_row_count(rows, cached_tokens, num_rows)))
            offsets[key], lengths[key] = rows_total, num_rows
            rows_total += num_rows
        blocks_total += count
    return _ExpansionPlan(plan, offsets, lengths, rows_total)


def _expanded_on_device(requests: Mapping[Hashable, tuple[StepBlockIds, int]], plans: Mapping[Hashable, _ExpansionPlan],
                        bounds: Mapping[Hashable, tuple[int, int]], total_rows: int, device: torch.device) -> torch.Tensor:
    """Every request's slots at its `bounds` of one tensor on `device`, expanded there in one launch."""
    from lmcache_ascend.kernels.block_slots import expand_on_device  # imports Triton

    entries: list[tuple[int, int, int, int, int]] = []
    ids: list[np.ndarray] = []
    first_id = 0
    for key, plan in plans.items():
        begin = bounds[key][0]
        for first_row, num_rows, first_block, _, rows_per_block, cached_rows in plan.groups:
            entries.append((begin + first_row, num_rows, first_id + first_block, rows_per_block, cached_rows))
        request_ids = requests[key][0].block_ids
        ids.append(request_ids)
        first_id += len(request_ids)
    # Rows of no group (a request without rows keeps one entry) are -1; otherwise every row is written.
    covered = sum(plan.rows for plan in plans.values()) == total_rows
    return expand_on_device(entries, ids, total_rows, device, null_id=NULL_BLOCK_ID, fill=not covered)


def _request_name(key: Hashable) -> str:
    request = key[0] if isinstance(key, tuple) and key else key
    return "a request" if request is None else f"request {request!r}"


def _check_block_ids(key: Hashable, block_ids: np.ndarray, plan: _ExpansionPlan, block_counts: Mapping[int, int],
                     fewest: int) -> None:
    """Refuse a block id outside its group's cache (negative, past the end, or wrapping in the
    slot arithmetic) before any row is resolved.

    One min and one max over the request's ids; the groups are only looked at one by one when
    those leave the range every group's cache has (`fewest` blocks).
    """
    if not len(block_ids):
        return
    if block_ids.min() >= 0 and block_ids.max() < fewest:
        return
    for (group, _), (_, _, first_block, count, _, _) in zip(plan.offsets, plan.groups):
        limit = block_counts.get(group)
        if limit is None:
            continue
        ids = block_ids[first_block : first_block + count]
        bad = np.flatnonzero((ids < 0) | (ids >= limit))
        if len(bad):
            raise KVCacheShapeError(
                f"{_request_name(key)}, KV-cache group {group}: block id {int(ids[bad[0]])} (position {int(bad[0])} "
                f"of its {count}) is not a block of this worker's cache, which has {limit} blocks "
                f"(allowed ids 0..{limit - 1}); nothing was moved"
            )


def _check_slots(request: object, group: RowKey, slots: np.ndarray, rows: int | None) -> None:
    """Refuse a slot outside the group's cache rows (-1 means "skip") before anything moves."""
    if rows is None or not len(slots):
        return
    low, high = int(slots.min()), int(slots.max())
    if low >= -1 and high < rows:
        return
    position = int(np.flatnonzero((slots < -1) | (slots >= rows))[0])
    raise KVCacheShapeError(
        f"{_request_name(request)}, KV-cache group {group[0]}: slot {int(slots[position])} (position {position}) "
        f"at compress ratio {group[1]} "
        f"is not a row of this worker's cache, which has {rows} rows (allowed: -1 to skip, 0..{rows - 1}); "
        "nothing was moved"
    )


@dataclass(frozen=True)
class DeviceSlots:
    """The slot mappings of one request (or one call) on the caches' device, in ONE int64 tensor.

    The slots of scheduler group g's layers of compress ratio c are ``slots[offsets[k] : offsets[k] +
    lengths[k]]`` with k = (g, c) (a `RowKey`; one per ratio of the group's layers).
    Made by `DeviceSlots.from_block_ids` (a request's block ids, expanded on the
    host) or `DeviceSlots.upload` (slot mappings given whole): one host-to-device copy.
    """

    slots: torch.Tensor
    offsets: Mapping[RowKey, int]
    lengths: Mapping[RowKey, int]

    @classmethod
    def from_block_ids(
        cls,
        step: StepBlockIds,
        geometry: GroupGeometry,
        device: torch.device,
        cached_tokens: int = 0,
        block_counts: Mapping[int, int] | None = None,
        request: Hashable = None,
        backend: str | None = None,
    ) -> "DeviceSlots":
        """The slots of every transferred group of `step`, on `device`, from its block ids.

        Row r of group g at compress ratio c (one slot mapping per ratio of its layers) has slot
        ``block_id * rows_per_block + r % rows_per_block`` with ``rows_per_block = block_size // c`` and
        ``block_id = ids_g[r // rows_per_block]``; -1 on vLLM's null block and on the rows
        of vLLM's cached prefix (`cached_row_count` of `cached_tokens`; 0 for a store).
        `geometry` is the worker's groups (its ``ChunkPlanner``): their digest must be the one the
        scheduler's gave `step` (`StepBlockIds.check_geometry`). `block_counts` (group -> blocks of
        the worker's cache): an id outside them is refused, naming `request`, before anything moves.
        `backend`: the transfer backend (`kernels.select_backend`): with Triton the ids are
        expanded on the device, else on the host.
        """
        return cls.for_requests({request: (step, cached_tokens)}, geometry, device, block_counts, backend)[request]

    @classmethod
    def for_requests(
        cls,
        requests: Mapping[Hashable, tuple[StepBlockIds, int]],
        geometry: GroupGeometry,
        device: torch.device,
        block_counts: Mapping[int, int] | None = None,
        backend: str | None = None,
    ) -> dict[Hashable, "DeviceSlots"]:
        """`from_block_ids` of many (block ids, cached tokens) at once: key -> its `DeviceSlots`.

        Every request's groups are laid out one after another in ONE tensor on `device`;
        each request's slots are a view of it (one entry at least: an empty tensor may have
        no address for the kernels to anchor on). With Triton (`backend`, as the transfers
        select it) one upload of every request's ids and plan and one launch expand them on
        the device (`kernels.block_slots`); otherwise the host expands them group by group
        (`_expand_block_ids`, a few numpy ops per group) and copies the result at once. On an
        H100 the expansion as torch ops on the device took 0.7-2.2 ms of launches per request
        (scripts/bench_slot_resolution.py --device cuda, docs/design-decisions.md).
        `block_counts`: see `from_block_ids`; every request is checked before any is expanded.
        """
        if not requests:
            return {}
        plans = {key: _expansion_plan(step, geometry, cached_tokens) for key, (step, cached_tokens) in requests.items()}
        if block_counts:
            fewest = min(block_counts.values())
            for key, plan in plans.items():
                _check_block_ids(key, requests[key][0].block_ids, plan, block_counts, fewest)
        bounds, cursor = {}, 0
        for key, plan in plans.items():
            bounds[key] = (cursor, cursor + max(plan.rows, 1))
            cursor = bounds[key][1]
        if select_backend(device, backend) == "triton":
            joined = _expanded_on_device(requests, plans, bounds, cursor, device)
            return {key: cls(joined[slice(*bounds[key])], plan.offsets, plan.lengths) for key, plan in plans.items()}
        host = np.full(cursor, -1, dtype=np.int64)
        for key, plan in plans.items():
            begin = bounds[key][0]
            _expand_block_ids(requests[key][0].block_ids, plan.groups,
                              host[begin : begin + plan.rows])
        joined = to_device(host, device)
        return {key: cls(joined[slice(*bounds[key])], plan.offsets, plan.lengths) for key, plan in plans.items()}

    @classmethod
    def upload(
        cls,
        slot_mappings: Mapping[int | RowKey, object],
        groups: Mapping[int, KVGroupSpec],
        device: torch.device,
        cached_tokens: int = 0,
        slot_rows: Mapping[RowKey, int] | None = None,
        request: Hashable = None,
    ) -> "DeviceSlots":
        """Concatenate `slot_mappings` (group, or (group, compress ratio) where the group's layers compress
        at several ratios -> 1-D ints), mask the rows of vLLM's cached prefix (`cached_row_count`; 0 for a
        store) and copy them to `device` at once.

        `slot_rows` (`RowKey` -> rows of the worker's cache): a slot outside them (or below -1)
        is refused, naming `request` and the group, before anything moves."""
        parts = []
        offsets: dict[RowKey, int] = {}
        lengths: dict[RowKey, int] = {}
        cursor = 0
        for given, slots in slot_mappings.items():
            if slots is None:
                continue
            group = int(given[0] if isinstance(given, tuple) else given)
            spec = groups.get(group)
            if spec is None:
                raise KVCacheShapeError(
                    f"a slot mapping was given for scheduler group {group}, which is not among the registered "
                    f"groups {sorted(groups)}"
                )
            try:
                ratio = int(given[1]) if isinstance(given, tuple) else spec.single_ratio("a slot mapping given by group")
                rows = spec.at_ratio(ratio)
            except ValueError as error:
                raise KVCacheShapeError(f"a slot mapping was given for {given!r}: {error}") from None
            key = (group, ratio)
            host = slots.detach().cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
            if host.ndim != 1:
                raise KVCacheShapeError(f"slot mapping of scheduler group {group} has shape {host.shape}; allowed: 1-D")
            host = host.astype(np.int64, copy=True)
            if slot_rows is not None:
                _check_slots(request, key, host, slot_rows.get(key))
            masked = cached_row_count(rows, cached_tokens, len(host))
            host[:masked] = -1
            parts.append(host)
            offsets[key], lengths[key] = cursor, len(host)
            cursor += len(host)
        joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        # One entry at least: an empty tensor may have no address for the kernels to anchor on.
        if not len(joined):
            joined = np.full(1, -1, dtype=np.int64)
        return cls(to_device(joined, device), offsets, lengths)
