"""activate() racing an import of a patch target: the patch applies once, to the finished module.

The target is a module of the test's own whose body blocks on an event, so the
interleaving "target half imported, then activate from other threads" happens
every run (a real vLLM module can't be paused half way). Eight threads
activate at once; 100 runs must all end in the same states.
"""

from __future__ import annotations

import sys
import threading

from lmcache_ascend import flags as flag_table
from lmcache_ascend.patches.model import Patch, PatchKind
from lmcache_ascend.patches.registry import Registry

THREADS = 8
RUNS = 100
WAIT_S = 60  # bound on each wait between the threads of one run (fails, never hangs)
BODY = """
import race_gate
race_gate.entered[__name__].set()
race_gate.release[__name__].wait(10)

def answer():
    return 42
"""


def _counting_patch(target: str, calls: list[str]) -> Patch:
    def build(ctx):
        original = ctx.original_function("answer")

        def answer():
            calls.append("wrapped")
            return original()

        answer.__wrapped__ = original
        return {"answer": answer}

    return Patch(
        name="test-race", target=target, attributes=("answer",), kind=PatchKind.WRAP, build=build,
        summary="counts calls (test only)", why="test", mirrors="-", delete_when="-",
    )


def test_activation_during_a_half_done_import_applies_once_to_the_finished_module(tmp_path, monkeypatch):
    gate = type(sys)("race_gate")
    gate.entered, gate.release = {}, {}
    monkeypatch.setitem(sys.modules, "race_gate", gate)
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = flag_table.validate_all({})
    outcomes = set()
    for run in range(RUNS):
        name = f"race_target_{run}"
        (tmp_path / f"{name}.py").write_text(BODY)
        gate.entered[name], gate.release[name] = threading.Event(), threading.Event()
        calls: list[str] = []
        registry = Registry([_counting_patch(name, calls)])
        importer = threading.Thread(target=__import__, args=(name,))
        importer.start()
        assert gate.entered[name].wait(WAIT_S), f"run {run}: the target's import did not start in {WAIT_S} s"
        start = threading.Barrier(THREADS + 1, timeout=WAIT_S)  # a missing thread breaks it, no hang

        def activate(index: int) -> None:
            start.wait()
            registry.activate(flags, f"thread-{index}")

        activators = [threading.Thread(target=activate, args=(i,)) for i in range(THREADS)]
        for thread in activators:
            thread.start()
        start.wait()
        gate.release[name].set()
        for thread in activators + [importer]:
            thread.join(WAIT_S)
            assert not thread.is_alive(), f"run {run}: {thread.name} still running after {WAIT_S} s"
        module = sys.modules.pop(name)
        record = registry.record("test-race")
        assert module.answer() == 42
        outcomes.add((record.state.value, tuple(calls)))
    assert outcomes == {("applied", ("wrapped",))}
