"""The engine harness removes what killed engine processes leave in /dev/shm and the temp folder.

A child in a process group of its own creates a shared-memory segment and a
listening socket file, as vLLM's and LMCache's processes do, and is killed with
SIGKILL the way every engine run ends. Entries that existed before, or that a
live process still maps, stay.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from tests.engine.harness import SHARED_MEMORY_DIR, SOCKET_DIR, ipc_reclaimed, stop_group

pytestmark = pytest.mark.skipif(not SHARED_MEMORY_DIR.is_dir(), reason="needs /dev/shm")

_CHILD = textwrap.dedent("""
    import socket, sys, time
    from multiprocessing import shared_memory
    segment = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=1 << 20)
    segment.buf[:4] = b"kept"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[2])
    listener.listen()
    print("ready", flush=True)
    time.sleep(600)
""")


def _killed_child(tag: str) -> tuple[Path, Path]:
    segment, sock = SHARED_MEMORY_DIR / f"lmcache_ascend_test_{tag}", SOCKET_DIR / f"lmcache-ascend-test-{tag}.sock"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, segment.name, str(sock)], stdout=subprocess.PIPE,
                             start_new_session=True, text=True)
    assert child.stdout.readline().strip() == "ready"
    assert segment.exists() and sock.exists()
    stop_group(child)
    return segment, sock


def test_a_killed_groups_segment_and_socket_are_removed():
    tag = f"{time.monotonic_ns()}"
    with ipc_reclaimed():
        segment, sock = _killed_child(tag)
        # the control: SIGKILL alone leaves both behind
        assert segment.exists() and sock.exists()
    assert not segment.exists() and not sock.exists()


def test_entries_from_before_and_entries_still_mapped_stay():
    tag = f"{time.monotonic_ns()}"
    earlier = shared_memory.SharedMemory(name=f"lmcache_ascend_test_{tag}_earlier", create=True, size=4096)
    try:
        with ipc_reclaimed():
            mapped = shared_memory.SharedMemory(name=f"lmcache_ascend_test_{tag}_mapped", create=True, size=4096)
            earlier.close()  # unmapped now, but it was there before the block
        try:
            assert (SHARED_MEMORY_DIR / earlier.name).exists()
            assert (SHARED_MEMORY_DIR / mapped.name).exists()
        finally:
            mapped.close()
            mapped.unlink()
    finally:
        earlier.unlink()
