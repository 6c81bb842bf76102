"""The engine harness removes what its own killed processes leave in /dev/shm and the temp folder, and
nothing of anyone else's.

A stand-in for an engine run, started the way run_engine starts one
(``engine_environment`` inside ``ipc_reclaimed``, a process group of its own),
creates what vLLM's and LMCache's processes do: a shared-memory segment, a
multiprocessing semaphore (in a spawned child too, as vLLM's engine core and
workers are) and a listening socket file in its temp folder; it is killed with
SIGKILL the way every engine run ends. Meanwhile an unrelated program creates and
holds a semaphore and a segment of its own: a semaphore shows in its creator's
/proc/<pid>/maps under a temporary name only, so judging by other processes'
maps took it for a leftover and removed it, and the next vLLM engine of that
program failed in ``SemLock._rebuild``.
"""

from __future__ import annotations

import _multiprocessing
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.synchronize import SEMAPHORE
from pathlib import Path

import pytest

from tests.engine.harness import SHARED_MEMORY_DIR, engine_environment, ipc_reclaimed, wait_until_group_gone

pytestmark = pytest.mark.skipif(not SHARED_MEMORY_DIR.is_dir(), reason="needs /dev/shm")

# Run as a script (a spawned child re-imports it as its main module).
_STAND_IN = textwrap.dedent("""
    import json, multiprocessing, socket, tempfile, time
    from multiprocessing import shared_memory
    from pathlib import Path

    def worker(queue):
        lock = multiprocessing.get_context("spawn").Lock()
        queue.put(lock._semlock.name)
        time.sleep(600)

    if __name__ == "__main__":
        spawn = multiprocessing.get_context("spawn")
        queue = spawn.Queue()
        spawn.Process(target=worker, args=(queue,)).start()
        segment = shared_memory.SharedMemory(create=True, size=1 << 20)
        lock = spawn.Lock()
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(Path(tempfile.gettempdir()) / "engine.sock"))
        listener.listen()
        print(json.dumps({"segment": segment.name, "semaphores": [lock._semlock.name, queue.get(timeout=120)],
                          "socket": listener.getsockname()}), flush=True)
        time.sleep(600)
""")

# Holds its semaphore and segment until its stdin closes, then removes them itself.
_UNRELATED = textwrap.dedent("""
    import json, multiprocessing, sys
    from multiprocessing import shared_memory
    lock = multiprocessing.get_context("spawn").Lock()
    segment = shared_memory.SharedMemory(create=True, size=4096)
    segment.buf[:4] = b"mine"
    print(json.dumps({"segment": segment.name, "semaphore": lock._semlock.name}), flush=True)
    sys.stdin.read()
    segment.close()
    segment.unlink()
""")


def _semaphore_path(name: str) -> Path:
    return SHARED_MEMORY_DIR / ("sem." + name.lstrip("/"))


def _stand_in_run(tmp_path: Path) -> dict:
    """Start the stand-in as run_engine starts an engine, wait for its objects, kill its group."""
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    child = subprocess.Popen([sys.executable, str(script)], env=engine_environment({}), stdout=subprocess.PIPE,
                             start_new_session=True, text=True)
    try:
        made = json.loads(child.stdout.readline())
    finally:
        # As run_engine ends a run: SIGKILL at once (a SIGTERM first would let the resource tracker tidy up).
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        wait_until_group_gone(child.pid)
    made["paths"] = [SHARED_MEMORY_DIR / made["segment"], *map(_semaphore_path, made["semaphores"]), Path(made["socket"])]
    # the control: SIGKILL alone leaves all of them behind
    assert all(path.exists() for path in made["paths"]), made
    return made


def test_what_the_harness_processes_leave_is_removed(tmp_path):
    with ipc_reclaimed() as scope:
        made = _stand_in_run(tmp_path)
        assert Path(made["socket"]).parent == scope.temp_dir
    assert not any(path.exists() for path in made["paths"]), made
    assert not scope.root.exists()


def test_other_programs_objects_stay_usable(tmp_path):
    earlier = shared_memory.SharedMemory(name=f"lmcache_ascend_test_{time.monotonic_ns()}_earlier", create=True, size=4096)
    try:
        with ipc_reclaimed():
            unrelated = subprocess.Popen([sys.executable, "-c", _UNRELATED], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            try:
                theirs = json.loads(unrelated.stdout.readline())
                mine = _stand_in_run(tmp_path)
                earlier.close()  # unmapped now, but it was there before the block
            except BaseException:
                unrelated.kill()
                raise
        try:
            assert not any(path.exists() for path in mine["paths"]), mine
            assert (SHARED_MEMORY_DIR / earlier.name).exists()
            # What the next vLLM engine of the other program does with its semaphore: open it by name.
            assert _semaphore_path(theirs["semaphore"]).exists()
            lock = _multiprocessing.SemLock._rebuild(0, SEMAPHORE, 1, theirs["semaphore"])
            assert lock.acquire(timeout=10)
            lock.release()
            segment = shared_memory.SharedMemory(name=theirs["segment"])
            resource_tracker.unregister(segment._name, "shared_memory")  # theirs to unlink, not this process's
            try:
                assert bytes(segment.buf[:4]) == b"mine"
            finally:
                segment.close()
        finally:
            unrelated.stdin.close()
            assert unrelated.wait(timeout=30) == 0
    finally:
        earlier.unlink()
