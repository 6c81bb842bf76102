"""LMCache's Redis connector sends a command again, once, on a connection found dead.

``RedisConnector.__init__`` builds its connection pool from the URL alone, so every
pooled connection gets redis-py's default of no retry. When the Redis server restarts
(a crash, a failover, an operator's restart), each connection the pool kept from before
fails the next command sent on it with ``ConnectionError`` ("Connection closed by
server") and is only then reconnected: after a restart the engine's next stores are
lost one connection at a time (LMCache logs "batched put error" and nothing else
happens), and so are its next lookups and loads, until every old connection has failed
once. A pool holds up to 150 connections.

The wrapper runs the original, then gives the pool's connection settings one retry on
``ConnectionError`` with no wait (redis-py disconnects a connection whose command failed
and connects it again before the retry). Every command the connector sends (GET, SET,
EXISTS, DEL) may be sent twice without changing what it does. A server that is really
gone still fails at once: the retry's fresh connection is refused.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def _retry_once_on_connection_error():
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def init_wrapper(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    settings = instance.pool.connection_kwargs
    if settings.get("retry") is None and not settings.get("retry_on_error"):  # a URL that asks for its own keeps it
        # The policy alone: each connection copies it and adds its own list of errors (a list in
        # these settings would be shared, and a URL's retry_on_timeout appends to it per connection).
        settings["retry"] = _retry_once_on_connection_error()


PATCH = Patch(
    name="lmcache-redis-reconnect",
    target="lmcache.v1.storage_backend.connector.redis_connector",
    attributes=("RedisConnector.__init__",),
    kind=PatchKind.WRAP,
    wrappers={"RedisConnector.__init__": init_wrapper},
    # LMCache's Redis connector imports redis-py, which LMCache installs only with its full set.
    requires={"lmcache": ">=0.4.5,<0.6", "redis": ">=4.2"},
    guard=UpstreamGuard(
        # Fixed upstream once the connector gives its pool a retry policy.
        fixed_if_source_contains=("retry",),
        unfixed_if_source_contains=("ConnectionPool.from_url(",),
    ),
    summary="LMCache's Redis connector retries a command once on a connection that died with a server restart",
    why="after a Redis restart every pooled connection failed its next command: stores, lookups and loads "
    "were lost one connection at a time (up to 150) before the engine reused anything again",
    mirrors="lmcache.v1.storage_backend.connector.redis_connector.RedisConnector.__init__",
    delete_when="LMCache's Redis connector configures a retry on connection errors",
    tested_fingerprints={"RedisConnector.__init__": ("2b2e96dabecc",)},  # LMCache 0.5.6
)
