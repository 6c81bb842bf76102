"""LMCache's remote job queue (its real ``AsyncPQExecutor``) still runs jobs after callers gave up.

Each of the queue's workers is handed a job whose caller is cancelled while the job
runs (a get past its timeout, a batched get whose other gets failed), half of them
ending with an error as a get to a server that is gone does. Then more jobs are
submitted: with ``lmcache-job-queue-cancelled-jobs`` every one returns its own value or
error; without it (the control) each cancelled job ended its worker and the next job
is never run.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

PATCH = "lmcache-job-queue-cancelled-jobs"  # the `patched` fixture's patch
WORKERS = 4
# How long a job is given before the test calls it never run (jobs here take milliseconds).
NEVER_RUN_S = 5.0


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    async def stop_every_task():
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(stop_every_task(), loop).result(NEVER_RUN_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(NEVER_RUN_S)
    loop.close()


async def _job(value, started: threading.Event, release: threading.Event, fails: bool):
    started.set()
    while not release.is_set():
        await asyncio.sleep(0.001)
    if fails:
        raise ConnectionError(f"job {value}: the server is gone")
    return value


def _cancel_while_running(executor, loop, value, fails: bool) -> None:
    """One job whose caller is cancelled after the job started and before it ends."""
    started, release = threading.Event(), threading.Event()
    caller = asyncio.run_coroutine_threadsafe(executor.submit_job(_job, value, started, release, fails), loop)
    assert started.wait(NEVER_RUN_S), f"job {value} never started"
    caller.cancel()
    while not caller.done():
        time.sleep(0.001)
    release.set()


def test_the_queue_runs_jobs_after_every_worker_met_a_cancelled_caller(patched, loop):
    from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor

    executor = AsyncPQExecutor(loop, max_workers=WORKERS)
    for value in range(WORKERS):
        _cancel_while_running(executor, loop, value, fails=value % 2 == 1)
    time.sleep(0.05)  # the cancelled jobs' workers settle them (or, unpatched, end)
    always = threading.Event()
    always.set()
    callers = [asyncio.run_coroutine_threadsafe(executor.submit_job(_job, value, threading.Event(), always,
                                                                      value % 3 == 0), loop)
               for value in range(100, 112)]
    outcomes = []
    for caller in callers:
        try:
            outcomes.append(caller.result(NEVER_RUN_S))
        except ConnectionError as error:
            outcomes.append(str(error))
        except TimeoutError:  # never run: no worker is left, and none of the later jobs will run either
            break
    if not patched:
        assert outcomes == [], f"the control ran jobs after four cancelled callers ({outcomes}): no worker had ended"
        return
    assert outcomes == [f"job {value}: the server is gone" if value % 3 == 0 else value for value in range(100, 112)]
