"""The benchmark scripts that run without an accelerator run to the end on the CPU, with the fewest rounds.

What is measured is not checked here (no timings in tests): that each script still runs against the
package as it is, prints its table and writes its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "bench_slot_resolution.py": ["--device", "cpu", "--rounds", "2", "--tokens", "1024"],
    "bench_tracker.py": ["--rounds", "1", "--prompt", "512", "--prefill-chunk", "256", "--decode-steps", "2",
                         "--batch", "1,4"],
    "bench_transfer.py": ["--device", "cpu", "--tokens", "256", "--calls", "1", "--repeats", "1",
                          "--request-tokens", "1024", "--request-rounds", "1"],
    "bench_chunk_seal.py": ["--rounds", "3", "--sizes-mib", "0.1"],
    "bench_cpu_path.py": ["--tokens", "512", "--rounds", "1", "--layouts", "gemma3-tiny (2 groups),dsv4_bundled"],
    "bench_hole_blend.py": ["--seeds", "1", "--random-seeds", "1", "--documents", "6", "--holes", "1",
                            "--placements", "start", "--ratios", "0.3"],
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_benchmark_script_runs_on_the_cpu(script, tmp_path):
    if script == "bench_tracker.py":
        pytest.importorskip("lmcache.integration.vllm.vllm_v1_adapter", reason="times LMCache's own adapter")
    out = tmp_path / "result.json"
    env = dict(os.environ, LMCACHE_ASCEND_AUTOLOAD="0", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), *SCRIPTS[script], "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout
    assert json.loads(out.read_text())


def _engine_benchmark(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_engine", REPO / "scripts" / "bench_engine.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_engine", bench)  # its dataclass looks itself up there
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the repository first on the path
    spec.loader.exec_module(bench)
    return bench


def test_the_engine_benchmark_summarises_a_run_without_an_engine(tmp_path, monkeypatch):
    """bench_engine.py's workloads, summaries, tables and plot on made-up answers (its engines are too slow for here)."""
    import random

    bench = _engine_benchmark(monkeypatch)
    queries = bench.workloads(random.Random(0), 512, bench.SHAPES["quick"])
    shape = bench.SHAPES["quick"]
    interleaved = [q["key"] for q in queries["docs-interleaved"]]
    assert interleaved[: shape["documents"]] == [f"doc {d}" for d in range(shape["documents"])]
    assert bench.working_set(queries["no-reuse"]) == shape["unique_prompts"] * len(queries["no-reuse"][0]["prompt"])
    requests = [
        {"arm": arm, "workload": workload, "index": index, "prompt_tokens": len(query["prompt"]),
         "ttft_s": 0.1 if arm == "vllm" else 0.05, "wall_s": 0.2, "tokens": [1, 2], "logprobs": [-1.0, -2.0],
         "num_cached_tokens": 0, "local_hits": 0, "external_hits": 0}
        for workload, listed in queries.items() for index, query in enumerate(listed) for arm in ("vllm", "overlay")
    ]
    report = {"start_s": 1.0, "kv_cache_size_tokens": 1000, "hybrid_manager": True, "overlay_patches": [3],
              "workers": [{"groups": [{"spec": "FullAttentionSpec"}], "omp_threads": 1, "kv_connector": None}]}
    group = {"model": "m", "arms": ["vllm", "overlay"], "failed": {"upstream-mp": "Error: x"}, "requests": requests,
             "capacity": {"vllm": report, "overlay": report},
             "working_set": {w: bench.working_set(listed) for w, listed in queries.items()}}
    group["summary"] = bench.summarize(group)
    assert group["summary"]["outputs"]["equal"]
    meta = {"command": "c", "commit": "h", "date": "d", "machine": "m", "device": "cpu", "quick": True,
            "arms": ["vllm", "overlay", "upstream-mp"], "shape": shape, "kv_cache_mib": 6, "offload_gb": 1.0,
            "reserved_cpus": 1, "eager": True, "versions": {"vllm": "v", "lmcache": "l", "torch": "t"}}
    result = {"meta": meta, "groups": [group]}
    assert "did not start: `Error: x`" in bench.markdown(result)
    assert "Not run: upstream-mp" in bench.headline(result)
    pytest.importorskip("matplotlib")
    bench.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(result))
    rendered = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_engine.py"), "--from-json", str(saved),
                               "--out", str(tmp_path / "again")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    assert (tmp_path / "again" / "bench_engine.md").read_text() == bench.markdown(result) + "\n"
    requests[-1]["tokens"] = [1, 3]
    assert not bench.summarize(group)["outputs"]["equal"]


def test_the_engine_benchmark_gives_every_process_cpus_of_its_own(monkeypatch):
    """--cpus-per-engine: disjoint CPUs for the driver, each engine and each MP server; too few is refused."""
    bench = _engine_benchmark(monkeypatch)
    arms = list(bench.ARMS)
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: set(range(100, 116)))
    plan = bench.cpu_plan(arms, 2)
    taken = [*plan.driver, *(c for cpus in plan.engines.values() for c in cpus),
             *(c for cpus in plan.servers.values() for c in cpus)]
    assert len(taken) == len(set(taken)) == 1 + 2 * len(arms) + 2
    assert set(taken) <= set(range(100, 116))
    assert all(len(plan.engines[name]) == 2 for name in arms)
    assert set(plan.servers) == {name for name in arms if bench.ARMS[name].mp_server}
    # The engines take the host's last CPUs, away from its housekeeping on the first ones.
    assert plan.driver == [100] and {c for cpus in plan.servers.values() for c in cpus} == {101, 102}
    assert {c for cpus in plan.engines.values() for c in cpus} == set(range(116 - 2 * len(arms), 116))
    assert bench.cpu_plan(arms, 0) is None
    with pytest.raises(ValueError, match=r"--cpus-per-engine 3: .* need 21 CPUs, .* 16 .* allowed here: 0 \(no pinning\) to 2"):
        bench.cpu_plan(arms, 3)


def test_the_engines_cpu_sets_rotate_among_the_arms(monkeypatch):
    """Query by query, every arm gets every engine CPU set once per len(arms) queries, the sets disjoint."""
    bench = _engine_benchmark(monkeypatch)
    arms = list(bench.ARMS)
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: set(range(100, 116)))
    plan = bench.cpu_plan(arms, 2)
    turns = [bench.rotated(plan, arms, turn) for turn in range(1, len(arms) + 1)]
    for placement in turns:
        cpus = [cpu for sets in placement.values() for cpu in sets]
        assert len(cpus) == len(set(cpus)) and sorted(map(tuple, placement.values())) == sorted(
            map(tuple, plan.engines.values()))
    for name in arms:
        assert sorted(tuple(placement[name]) for placement in turns) == sorted(map(tuple, plan.engines.values()))


def test_a_process_group_moves_with_every_thread(monkeypatch):
    """move_group re-pins every thread of an engine's process group to the CPU at its place in the new set."""
    bench = _engine_benchmark(monkeypatch)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to move a process between")
    program = ("import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
               "print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen(bench.on_cpus([cpus[0]], [sys.executable, "-c", program]), stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        threads = bench.group_threads(child.pid)
        assert len(threads) >= 2 and all(os.sched_getaffinity(t) == {cpus[0]} for t in threads)
        bench.move_group(child.pid, [cpus[0]], [cpus[1]])
        assert all(os.sched_getaffinity(t) == {cpus[1]} for t in bench.group_threads(child.pid))
    finally:
        child.kill()
        child.wait()


def test_a_pinned_command_runs_on_its_cpus_only(monkeypatch):
    bench = _engine_benchmark(monkeypatch)
    cpu = max(os.sched_getaffinity(0))
    command = bench.on_cpus([cpu], [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"])
    assert subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip() == f"[{cpu}]"
    assert bench.on_cpus(None, ["x"]) == ["x"]

