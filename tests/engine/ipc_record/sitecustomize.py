"""Record the /dev/shm objects this process creates, so that the engine-test harness removes exactly those.

The harness puts this folder first on the ``PYTHONPATH`` of the processes it
starts (tests/engine/harness.py, ``ipc_reclaimed``), which kills them with
SIGKILL: nothing of theirs unlinks their shared-memory segments and
semaphores then. With ``LMCACHE_ASCEND_IPC_RECORD`` naming a file, each POSIX
shared-memory segment created through ``_posixshmem.shm_open`` (Python's
``SharedMemory`` and LMCache's ``posix_shm`` both go through it) and each
named multiprocessing semaphore appends its /dev/shm file name to that file,
one line each. Children inherit both: forked ones the patched functions,
spawned ones the environment. Any ``sitecustomize`` this one shadows is run
after it.
"""

from __future__ import annotations

import os
import sys

RECORD_ENV = "LMCACHE_ASCEND_IPC_RECORD"


def _record(file_name: str) -> None:
    """Append one /dev/shm file name to the record (one write of one line: appends never interleave)."""
    fd = os.open(os.environ[RECORD_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (file_name + "\n").encode())
    finally:
        os.close(fd)


def _install() -> None:
    import _posixshmem

    plain_shm_open = _posixshmem.shm_open

    def shm_open(path, flags, mode=0o777):
        fd = plain_shm_open(path, flags, mode)
        if flags & os.O_CREAT:
            _record(path.lstrip("/"))
        return fd

    _posixshmem.shm_open = shm_open

    try:
        from multiprocessing import synchronize
    except ImportError:  # no sem_open on this platform: no named semaphores either
        return
    plain_init = synchronize.SemLock.__init__

    def semlock_init(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        name = self._semlock.name  # None where it was unlinked at once (fork context)
        if name is not None:
            _record("sem." + name.lstrip("/"))

    synchronize.SemLock.__init__ = semlock_init


def _run_shadowed() -> None:
    """Run the ``sitecustomize`` that later ``sys.path`` entries hold, as Python would have without this one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if os.environ.get(RECORD_ENV):
    _install()
_run_shadowed()
