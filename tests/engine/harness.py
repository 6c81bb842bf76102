"""Run engine specs in subprocesses with a hard timeout; cache the results per session.

Each run is ``python -m tests.engine.runner`` in a new process group: vLLM's
engine core and worker processes belong to it, so a timeout kills all of them
and a hung engine never hangs the suite.  What the killed processes leave behind
(their private temp folder, the shared-memory objects they recorded creating) is removed
after each run; nobody else's.  The child sees no ``PYTHONHASHSEED``
(a user's engine would not either) and activates lmcache-ascend the way a user's
does, through the installed entry points.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = int(os.environ.get("LMCACHE_ASCEND_ENGINE_TIMEOUT", "900"))

_results: dict[str, dict] = {}

# Every engine test runs eager: vLLM's graph capture costs about a third of an
# engine start on this CPU and is not on the path the overlay changes (the
# connector is called from the attention op either way); both sides of every
# comparison run alike. scripts/bench_engine.py runs compiled, as users do.
# The engine core runs in the driver process (``"engine_core": "in-driver"``) where
# nothing needs it elsewhere: a process of its own imports vLLM once more, about a
# quarter of an engine start.  The worker always has its own process, so the
# connector's scheduler and worker sides still meet only through vLLM's messages.
# vLLM's default layout (``"process"``) stays for the in-process reuse tests, the
# served engine, and any other connector (LMCache's MP connector finishes requests
# on its own time: an engine core in the driver steps only while the driver waits
# for outputs, so the requests' blocks would still be held when a test resets the
# prefix cache or waits for the server's stores).
ENGINE_TEST_DEFAULTS = {"enforce_eager": True}


def _engine_core(spec: dict) -> str:
    if spec.get("kv_connector", "LMCacheConnectorV1") != "LMCacheConnectorV1":
        return "process"
    return "in-driver"


class EngineRunError(AssertionError):
    """An engine run that failed; `log` is its whole output (stdout and stderr of every process)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def engine_environment(extra: dict[str, str]) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONHASHSEED", "LMCACHE_ASCEND_AUTOLOAD")}
    env.update(
        # Worker reports travel through LLM.collective_rpc as a pickled function.
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        LMCACHE_LOG_LEVEL=os.environ.get("LMCACHE_LOG_LEVEL", "WARNING"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO_ROOT),
    )
    scopes = _ipc_scopes()
    if scopes:  # started inside an ipc_reclaimed block: the innermost one cleans up after it
        env.update(scopes[-1].environment())
    env.update(extra)
    return env


def run_engine(spec: dict, timeout_s: int = ENGINE_TIMEOUT_S) -> dict:
    """The runner's JSON result for `spec` (cached: each distinct spec runs once)."""
    spec = {**ENGINE_TEST_DEFAULTS, "engine_core": _engine_core(spec), **spec}
    key = json.dumps(spec, sort_keys=True)
    if key in _results:
        return _results[key]
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-engine-") as scratch, ipc_reclaimed():
        spec_path, out_path, log_path = (Path(scratch) / name for name in ("spec.json", "out.json", "log.txt"))
        spec_path.write_text(key)
        env = engine_environment(spec.get("env", {}))
        for hook in spec.get("engine_hooks", ()):
            env["PYTHONPATH"] = _after_ipc_record(env["PYTHONPATH"], ENGINE_HOOKS_DIR / hook)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.engine.runner", str(spec_path), str(out_path)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: engine core and workers included
            )
            try:
                code = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # leftovers of a finished run too
                except ProcessLookupError:
                    pass
                process.wait()
                wait_until_group_gone(process.pid)
        log_text = log_path.read_text(errors="replace")
        tail = log_text[-6000:]
        if code is None:
            raise EngineRunError(f"engine run timed out after {timeout_s} s; log tail:\n{tail}", log_text)
        if code != 0 or not out_path.exists():
            raise EngineRunError(f"engine run exited {code}; {_first_errors(log_text)}log tail:\n{tail}", log_text)
        result = json.loads(out_path.read_text())
    result["log_tail"] = tail
    _results[key] = result
    _record(spec, result)
    return result


# A spec's ``engine_hooks`` name folders here whose sitecustomize every process of the run executes
# (tests/engine/ipc_record's sitecustomize runs the next one on the path): what a model needs of the
# tests in vLLM's spawned processes too, e.g. tests/engine/dsv4_cpu.
ENGINE_HOOKS_DIR = Path(__file__).resolve().parent


def _after_ipc_record(python_path: str, folder: Path) -> str:
    entries = python_path.split(os.pathsep)
    at = entries.index(str(IPC_RECORD_DIR)) + 1 if str(IPC_RECORD_DIR) in entries else 0
    return os.pathsep.join(entries[:at] + [str(folder)] + entries[at:])


SHARED_MEMORY_DIR = Path("/dev/shm")
# Its sitecustomize.py records the /dev/shm names a process creates (in the file RECORD_ENV names).
IPC_RECORD_DIR = Path(__file__).resolve().parent / "ipc_record"
RECORD_ENV = "LMCACHE_ASCEND_IPC_RECORD"


class IpcScope:
    """One ipc_reclaimed block: a private folder holding the temp folder of the processes started in
    it and the record of the /dev/shm names they create."""

    def __init__(self, root: Path):
        self.root = root
        self.temp_dir = root / "tmp"
        self.record = root / "shm-names"

    def environment(self) -> dict[str, str]:
        """What a process started in the block needs in its environment to be cleaned up after.

        LMCache's ZeroMQ ipc sockets, vLLM's ``vllm_dist_*`` init files and
        multiprocessing's listener folders follow ``tempfile.gettempdir()``; vLLM's
        ZeroMQ ipc sockets follow ``VLLM_RPC_BASE_PATH``, which defaults to it. The
        record folder comes first on the path, so that its sitecustomize runs.
        """
        return {
            "TMPDIR": str(self.temp_dir),
            "VLLM_RPC_BASE_PATH": str(self.temp_dir),
            RECORD_ENV: str(self.record),
            "PYTHONPATH": os.pathsep.join((str(IPC_RECORD_DIR), str(REPO_ROOT))),
        }

    def recorded(self) -> set[Path]:
        """The /dev/shm entries the block's processes recorded creating (gone or not)."""
        with contextlib.suppress(FileNotFoundError):
            names = set(self.record.read_text().split())
            return {SHARED_MEMORY_DIR / name for name in names if "/" not in name and name not in (".", "..")}
        return set()


_threads = threading.local()


def _ipc_scopes() -> list[IpcScope]:
    """The ipc_reclaimed blocks open in this thread, innermost last (engines run from two threads
    at once each clean up after their own)."""
    if not hasattr(_threads, "ipc_scopes"):
        _threads.ipc_scopes = []
    return _threads.ipc_scopes


@contextlib.contextmanager
def ipc_reclaimed():
    """Remove, once the block ends, what the processes started in it left: their temp folder and
    the /dev/shm segments and semaphores they created. Yields the block's IpcScope.

    Engine runs end with SIGKILL to their process group (vLLM's own shutdown costs
    seconds per engine), so nothing unlinks vLLM's shared-memory rings and
    multiprocessing semaphores, LMCache's KV-cache segments of the MP mode
    (256 MiB each) or the ZeroMQ socket files. On tmpfs the segments keep their
    memory until they are removed: left alone they pile up run after run, on a
    machine the whole suite runs on again.

    Only what the block's own processes made goes: processes started with
    engine_environment inside the block get a private temp folder and record each
    /dev/shm name they create (tests/engine/ipc_record/sitecustomize.py). Nothing
    is judged by what other processes map or hold open: a multiprocessing
    semaphore shows in its creator's maps under a temporary name, so another
    program's live semaphore would look unused. The block's processes must be
    gone when it ends (run_engine and stop_group wait for that).
    """
    scope = IpcScope(Path(tempfile.mkdtemp(prefix="lmcache-ascend-ipc-")))
    scope.temp_dir.mkdir()
    # torch inductor's cache and precompiled headers default to the temp folder: keep using the
    # shared one (the private one goes after the block: all of it would be compiled again every run).
    inductor_cache = _inductor_cache_dir()
    inductor_cache.mkdir(parents=True, exist_ok=True)
    (scope.temp_dir / inductor_cache.name).symlink_to(inductor_cache, target_is_directory=True)
    _ipc_scopes().append(scope)
    try:
        yield scope
    finally:
        _ipc_scopes().remove(scope)
        for path in scope.recorded():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        shutil.rmtree(scope.root, ignore_errors=True)


def _inductor_cache_dir() -> Path:
    """torch inductor's default cache folder, named as torch names it, in this process's temp folder."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def wait_until_group_gone(group: int, timeout_s: float = 30.0) -> None:
    """Wait until no live process of process group `group` is left (zombies count as gone).

    A killed group's members keep their mappings until the kernel has torn them
    down; their leftovers are removed only after that.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_live_member(process, group) for process in Path("/proc").iterdir() if process.name.isdigit()):
            return
        time.sleep(0.05)


def _live_member(process: Path, group: int) -> bool:
    try:
        fields = (process / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[2]) == group


def _first_errors(log_text: str, count: int = 3) -> str:
    """The first distinct exception lines of a failed run's log (a worker's root cause is often
    thousands of lines above the tail)."""
    found: list[str] = []
    for line in log_text.splitlines():
        message = line.split("] ", 1)[-1].strip()
        if re.match(r"^[\w.]+(Error|Exception): ", message) and message not in found:
            found.append(message)
            if len(found) == count:
                break
    return "first errors:\n" + "\n".join(found) + "\n" if found else ""


def _record(spec: dict, result: dict) -> None:
    """One line per engine run in results/engine-runs.jsonl: the table of runs for the notes."""
    workers = result.get("workers") or [{}]
    line = {
        "model": Path(spec["model"]).name,
        "lmcache": bool(spec.get("lmcache")),
        "hybrid_manager": not spec.get("disable_hybrid_kv_cache_manager", False),
        "env": spec.get("env", {}),
        "rounds": len(spec["rounds"]),
        "groups": [group["spec"] for group in workers[0].get("groups", [])],
        "num_cached_tokens": [[output["num_cached_tokens"] for output in round_] for round_ in result["rounds"]],
        "connector": workers[0].get("connector"),
        "seconds": result.get("seconds"),
    }
    results = REPO_ROOT / "results"
    results.mkdir(exist_ok=True)
    with open(results / "engine-runs.jsonl", "a") as handle:
        handle.write(json.dumps(line) + "\n")


SERVER_START_TIMEOUT_S = 180


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group (LMCache's server shuts down on it), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    wait_until_group_gone(process.pid)


@contextlib.contextmanager
def server_on_loopback(label: str, command: list[str], port: int, *, cwd: Path = REPO_ROOT,
                       env: dict[str, str] | None = None, log_path: Path | None = None,
                       timeout_s: float = SERVER_START_TIMEOUT_S):
    """Run `command` (a server listening on `port`) in a process group of its own; yields the port.

    `env`: more environment over `engine_environment`'s; `log_path`: where its output goes (a
    scratch file otherwise). The server is stopped (its whole process group) however the block ends.
    """
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-server-") as scratch, ipc_reclaimed():
        log_path = log_path or Path(scratch) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, cwd=cwd, env=engine_environment(env or {}), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until_listening(label, process, port, log_path, timeout_s)
            yield port
        finally:
            stop_group(process)


def mp_server_command(port: int, chunk_size: int, l1_size_gb: float = 0.5) -> list[str]:
    """LMCache's multi-process server on loopback `port` (L1 in its memory, LRU)."""
    return [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
            "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
            "--disable-observability"]


def remote_server_command(port: int) -> list[str]:
    """LMCache's own remote KV server (`lm://`, chunks kept in its memory) on loopback `port`."""
    return [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]


def redis_command(port: int, *options: str) -> list[str]:
    """A Redis server on loopback `port`, nothing persisted; `options` are more of ``redis-server``'s."""
    return ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", *options]


def mp_server(chunk_size: int, l1_size_gb: float = 0.5):
    """`mp_server_command` as a context manager yielding its port."""
    port = free_loopback_port()
    return server_on_loopback("LMCache MP server", mp_server_command(port, chunk_size, l1_size_gb), port)


def remote_server():
    """`remote_server_command` as a context manager yielding its port."""
    port = free_loopback_port()
    return server_on_loopback("LMCache remote server", remote_server_command(port), port)


def redis_server(*options: str):
    """`redis_command` as a context manager yielding its port (e.g. ``redis_server("--maxmemory", "2mb")``);
    needs ``redis-server`` on PATH."""
    port = free_loopback_port()
    return server_on_loopback("Redis server", redis_command(port, *options), port)


def wait_until_listening(label: str, process: subprocess.Popen, port: int, log_path: Path,
                         timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineRunError(f"{label} exited {process.returncode}; log:\n{log_path.read_text(errors='replace')[-4000:]}",
                                 log_path.read_text(errors="replace"))
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise EngineRunError(f"{label} not listening on {port} after {timeout_s} s", log_path.read_text(errors="replace"))
