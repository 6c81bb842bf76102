"""LMCache's remote job queue keeps its workers when a job's caller stopped waiting.

``AsyncPQExecutor`` runs every operation of LMCache's Redis connector (and the others
built on it) on four worker coroutines. A worker that finishes a job sets the result
or the error on the job's future; when the caller has been cancelled meanwhile (a
``get_blocking`` past its timeout, a batched get whose other gets failed: with the
server gone every batched get does), that future is already cancelled, setting it
raises ``InvalidStateError`` and the worker ends. After four such jobs no worker is
left: every later lookup waits forever on a job nobody runs, and the engine never
reuses a chunk again, even after the server is back.

The replacement is upstream's worker loop, with the job's future settled only while
it is still pending. A job whose code is itself cancelled cancels its future (its
caller would otherwise wait forever) and ends the worker as upstream does; a
cancellation of the worker (the queue's shutdown) ends it too.
"""

from __future__ import annotations

import asyncio

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def _stop_marker():
    """Upstream's shutdown item (looked up once per worker, not once per job)."""
    from lmcache.v1.storage_backend.job_executor import pq_executor

    return pq_executor._SENTINEL


async def worker(self):
    """``AsyncPQExecutor._worker`` (fingerprint in PATCH) settling a job's future only while pending."""
    stop = _stop_marker()
    while True:
        try:
            item = await self._queue.get()
        except (GeneratorExit, asyncio.CancelledError, Exception):  # closing, cancelled or broken: stop, as upstream
            break
        if item is stop or (isinstance(item, tuple) and len(item) >= 3 and item[2] is stop):
            self._queue.task_done()
            break
        _, _, fn, args, kwargs, done = item
        try:
            result = await fn(*args, **kwargs)
        except asyncio.CancelledError:
            if not done.done():
                done.cancel()
            raise
        except Exception as error:
            if not done.done():
                done.set_exception(error)
        else:
            if not done.done():
                done.set_result(result)
        finally:
            self._queue.task_done()


PATCH = Patch(
    name="lmcache-job-queue-cancelled-jobs",
    target="lmcache.v1.storage_backend.job_executor.pq_executor",
    attributes=("AsyncPQExecutor._worker",),
    kind=PatchKind.REPLACE,
    build=lambda ctx: {"AsyncPQExecutor._worker": worker},
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        # Fixed upstream once the worker looks at the job's future before settling it.
        fixed_if_source_contains=("done.done()", "done.cancelled()"),
        unfixed_if_source_contains=("done.set_result(result)",),
    ),
    summary="LMCache's remote job queue keeps its workers when a job's caller was cancelled",
    why="each job finished after its caller timed out or was cancelled ended one of the queue's four workers; "
    "with a remote server gone, four such jobs left no worker and every later lookup waited forever",
    mirrors="lmcache.v1.storage_backend.job_executor.pq_executor.AsyncPQExecutor._worker",
    delete_when="LMCache's job queue worker settles only a pending future",
    tested_fingerprints={"AsyncPQExecutor._worker": ("f87c25059247",)},  # LMCache 0.4.5 and 0.5.6
)
