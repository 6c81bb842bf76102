"""LMCache's Redis get releases its buffer when the value is gone, short or unreadable.

``RedisConnector._get`` reads a chunk's metadata key, allocates a buffer of the size it
names, then reads the chunk's bytes key. Upstream keeps the buffer when the bytes key is
gone (a ``maxmemory`` eviction takes the two keys apart) and when the copy raises (a
value shorter or longer than its metadata says): the buffer's reference is never given
back, and with no local CPU cache to evict, the allocator fills until an allocation
blocks LMCache's event loop, every later get times out and each timed-out get kills one
worker of the connector's job queue (it cannot complete a cancelled future); from then on
every lookup of the engine waits for its timeout and finds nothing.

The replacement reads the same two keys the same way and returns the same buffer for a
whole value, and for the rest gives the buffer back and answers None (a miss): bytes gone
(the metadata key is deleted, as upstream does), a length other than the metadata's, or
any error while filling the buffer (logged with the key). Metadata that does not parse
(empty, cut short) is a miss too, and its key is deleted, where upstream raised: the
remote backend's batched get then cancelled the chunk's other gets, and each get
cancelled after the job queue had taken it ended one of the queue's workers.
"""

from __future__ import annotations

import logging

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

logger = logging.getLogger(__name__)


def _release(memory_obj) -> None:
    try:
        memory_obj.ref_count_down()
    except Exception:  # an object without reference counts: nothing to give back
        pass


def _fill(memory_obj, kv_bytes, length: int) -> bool:
    """Copy `kv_bytes` (exactly `length` bytes) into the buffer; False when they cannot fit it."""
    view = memory_obj.byte_array
    view = view if isinstance(view, memoryview) else memoryview(view)
    view = view.cast("B") if view.format != "B" else view
    data = kv_bytes.encode("utf-8") if isinstance(kv_bytes, str) else kv_bytes
    if len(data) != length or length > view.nbytes:
        return False
    view[:length] = data
    return True


async def get(self, key):
    from lmcache.v1.protocol import RemoteMetadata

    key_str = key.to_string()
    async with self.sem:
        metadata_bytes = await self.connection.get(key_str + "metadata")
        if metadata_bytes is None:
            return None
        try:
            metadata = RemoteMetadata.deserialize(memoryview(metadata_bytes))
        except Exception as error:  # empty or cut short: a miss, and the unreadable key goes
            logger.warning("lmcache-ascend: chunk %s from Redis has unreadable metadata (%s); it is a miss",
                           key_str, error)
            await self.connection.delete(key_str + "metadata")
            return None
        memory_obj = self.local_cpu_backend.allocate(metadata.shapes, metadata.dtypes, metadata.fmt)
        if memory_obj is None:
            logger.warning("lmcache-ascend: no buffer for chunk %s from Redis; it is a miss", key_str)
            return None
        try:
            kv_bytes = await self.connection.get(key_str + "kv_bytes")
        except BaseException:
            _release(memory_obj)
            raise
    if kv_bytes is None:  # evicted apart from its metadata: the metadata goes too
        _release(memory_obj)
        async with self.sem:
            await self.connection.delete(key_str + "metadata")
        return None
    try:
        whole = _fill(memory_obj, kv_bytes, metadata.length)
    except Exception as error:
        logger.warning("lmcache-ascend: chunk %s from Redis could not be read (%s); it is a miss", key_str, error)
        whole = False
    else:
        if not whole:
            logger.warning("lmcache-ascend: chunk %s from Redis has %d bytes where its metadata says %d; it is a miss",
                           key_str, len(kv_bytes), metadata.length)
    if not whole:
        _release(memory_obj)
        return None
    return memory_obj


PATCH = Patch(
    name="lmcache-redis-get-releases",
    target="lmcache.v1.storage_backend.connector.redis_connector",
    attributes=("RedisConnector._get",),
    kind=PatchKind.REPLACE,
    build=lambda ctx: {"RedisConnector._get": get},
    # LMCache's Redis connector imports redis-py, which LMCache installs only with its full set.
    requires={"lmcache": ">=0.4.5,<0.6", "redis": ">=4"},
    guard=UpstreamGuard(
        # Fixed upstream once the get gives its buffer back on the paths that return without it.
        fixed_if_source_contains=("ref_count_down",),
        unfixed_if_source_contains=("view[: metadata.length] = kv_bytes",),
    ),
    summary="LMCache's Redis get gives its buffer back and misses when a chunk's bytes are gone, short or unreadable",
    why="a value evicted apart from its metadata or of another length leaked its buffer; with no local CPU cache the "
    "allocator filled, blocked LMCache's event loop, and every later lookup of the engine timed out",
    mirrors="lmcache.v1.storage_backend.connector.redis_connector.RedisConnector._get",
    delete_when="LMCache's Redis connector releases the buffer on every path that returns without it",
    # LMCache 0.4.5 and 0.5.6 (the same source).
    tested_fingerprints={"RedisConnector._get": ("39b49377a566",)},
)
