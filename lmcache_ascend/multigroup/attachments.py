"""What lmcache-ascend attaches to upstream objects: one typed accessor per attachment.

Patches hand state from one upstream call to a later one by attaching it to the
upstream object that travels between them (LMCache's ``ReqMeta``, its
``RequestTracker``, the in-process connector, the engine's metadata). Each such
attachment is declared here once, with its attribute name and what it holds;
code reads and writes it only through `Attachment.get` / `Attachment.set`.

A leaf module (standard library only): vLLM's scheduler process imports it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = [
    "BLOCK_TRACKER",
    "CHUNK_PLANNER",
    "CONNECTOR_GROUPS",
    "FAILED_KEYS",
    "GROUP_HINTS",
    "GROUP_PLAN",
    "MP_GROUP_STATE",
    "REUSE_BLOCKER",
    "SCHEDULER_STATE",
    "SERVER_FORMAT",
    "STEP_BLOCK_IDS",
    "Attachment",
]

T = TypeVar("T")

_PREFIXES = ("ascend_", "_ascend_", "lmcache_ascend_")


class Attachment(Generic[T]):
    """One attribute lmcache-ascend sets on instances of an upstream class.

    Its name starts with ``ascend_``, ``_ascend_`` or ``lmcache_ascend_``, which no upstream class
    uses, so plain attribute access reads ours only. Not through the instance's ``__dict__``:
    asking CPython for an instance's dict gives up its compact attribute storage, and every later
    read of any of its fields is slower; the owners here include LMCache's connector, whose fields
    upstream's scheduler loop reads for every request of every step.
    """

    __slots__ = ("name", "holds")

    def __init__(self, name: str, holds: str) -> None:
        if not name.startswith(_PREFIXES):
            raise ValueError(f"attachment name {name!r} is not allowed; it must start with one of {_PREFIXES}")
        self.name = name
        self.holds = holds  # what the value is, for readers and error messages

    def get(self, owner: Any, default: T | None = None) -> T | None:
        return getattr(owner, self.name, default)

    def is_set(self, owner: Any) -> bool:
        return hasattr(owner, self.name)

    def set(self, owner: Any, value: T) -> None:
        setattr(owner, self.name, value)

    def __repr__(self) -> str:
        return f"Attachment({self.name!r}: {self.holds})"


# On LMCache's ReqMeta: the request's per-group block ids for this step (multigroup.slots);
# pickled to the workers with it, which resolve them to slots on the device.
STEP_BLOCK_IDS: Attachment = Attachment("ascend_step_block_ids", "StepBlockIds of the request, this step")
# On the request trackers of vLLM's builtin MP connector: the request's per-group block ids
# (multigroup.tracker). LMCache's in-process connector keeps them in its SCHEDULER_STATE instead:
# its RequestTracker is read many times per request and step, and an instance whose dict has been
# asked for reads its attributes more slowly.
BLOCK_TRACKER: Attachment = Attachment("ascend_block_tracker", "GroupBlockTracker of the request")
# On LMCache's in-process connector (LMCacheConnectorV1Impl): its multi-group layout, None for one group.
CONNECTOR_GROUPS: Attachment = Attachment("_ascend_kv_groups", "KVGroups or None")
# On the same connector: its multi-group scheduler state, made at its first step.
SCHEDULER_STATE: Attachment = Attachment(
    "_ascend_scheduler_state",
    "the adapter patch's scheduler state (layout, block trackers by request), or its single-group mark",
)
# On the LMCache engine's metadata: the chunk planner whose byte shape memory objects take.
CHUNK_PLANNER: Attachment = Attachment("ascend_chunk_planner", "kv_worker.ChunkPlanner of the registered caches")

REUSE_BLOCKER: Attachment = Attachment(
    "_ascend_reuse_blocker", "why the connector supplies no prefix (str), or None where reuse may be exact"
)

# On vLLM's builtin MP connector and its request trackers (which also carry BLOCK_TRACKER):
# what the connector knows of its groups and its server's wire format.
MP_GROUP_STATE: Attachment = Attachment("ascend_mp_group_state", "MPGroupState of the connector")

# LMCache 0.4.x's MP server and worker adapter (per-group block ids):
# On KVLayerGroupsManager: (plan, KV-cache group of each layer group), or unset for a flat registration.
GROUP_PLAN: Attachment = Attachment("lmcache_ascend_group_plan", "(ServerGroupPlan, tuple of KV group per layer group)")
# On LMCacheMPWorkerAdapter: the per-group LayoutHints entries to register with (multi-group models only).
GROUP_HINTS: Attachment = Attachment("lmcache_ascend_group_hints", "dict of per-group LayoutHints entries")
# On LMCacheMPWorkerAdapter: (PER_GROUP or FLAT, the server's name) from its answer to the registration.
SERVER_FORMAT: Attachment = Attachment("lmcache_ascend_server_format", "(wire format, server name or None)")

# On LMCache's remote backends (RemoteBackend): keys whose load failed (missing, unreadable, or
# failing the seal check), in the order found, as dict keys (lookups answer a miss at them until
# a store of the key completes).
FAILED_KEYS: Attachment = Attachment("_ascend_failed_keys", "dict of CacheEngineKeys whose load failed")
