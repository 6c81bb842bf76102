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
    "GROUP_HINTS",
    "GROUP_PLAN",
    "MP_GROUP_STATE",
    "REUSE_BLOCKER",
    "SERVER_FORMAT",
    "STEP_BLOCK_IDS",
    "STEP_READS",
    "Attachment",
]

T = TypeVar("T")


class Attachment(Generic[T]):
    """One attribute lmcache-ascend sets on instances of an upstream class.

    Read from the instance's own dict only: a class attribute of the same name,
    or an attribute upstream may add one day, is never mistaken for ours.
    """

    __slots__ = ("name", "holds")

    def __init__(self, name: str, holds: str) -> None:
        self.name = name
        self.holds = holds  # what the value is, for readers and error messages

    # Read for every request on every scheduler step: ``owner.__dict__`` is the dict ``vars(owner)``
    # returns, without the builtin's call.
    def get(self, owner: Any, default: T | None = None) -> T | None:
        return owner.__dict__.get(self.name, default)

    def is_set(self, owner: Any) -> bool:
        return self.name in owner.__dict__

    def set(self, owner: Any, value: T) -> None:
        setattr(owner, self.name, value)

    def __repr__(self) -> str:
        return f"Attachment({self.name!r}: {self.holds})"


# On LMCache's ReqMeta: the request's per-group block ids for this step (multigroup.slots);
# pickled to the workers with it, which resolve them to slots on the device.
STEP_BLOCK_IDS: Attachment = Attachment("ascend_step_block_ids", "StepBlockIds of the request, this step")
# On LMCache's RequestTracker, and on the request trackers of vLLM's builtin MP connector: the
# request's per-group block ids (multigroup.tracker).
BLOCK_TRACKER: Attachment = Attachment("ascend_block_tracker", "GroupBlockTracker of the request")
# On LMCache's in-process connector (LMCacheConnectorV1Impl): its multi-group layout, None for one group.
CONNECTOR_GROUPS: Attachment = Attachment("_ascend_kv_groups", "KVGroups or None")
# On the same connector: what each of its scheduler steps reads, fixed at its first step.
STEP_READS: Attachment = Attachment(
    "_ascend_step_reads", "the adapter patch's per-step reads (layout, upstream's table), or its single-group mark"
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
