"""Two engines share KV through LMCache's own remote server and through Redis: exactly, or not at all.

Stack D (vLLM's CPU build + LMCache 0.5.6). LMCache's remote KV server
(`python -m lmcache.v1.server`, chunks in its memory) runs on loopback; engine
processes started one after another point LMCache at it (`lm://`, no local CPU
backend), so whatever a later engine loads, an earlier one stored there:

- the writer: the Gemma-style hybrid model, hybrid manager kept, stores the
  first round of `test_engine_reuse` (A, B, L, C);
- a reader of the same model and layout gets every chunk-aligned prefix from the
  writer, with outputs equal to the no-connector engine;
  every block it loaded holds the bytes the writer's vLLM computed for the same
  tokens (`tests.engine.kv_oracle`, across the two processes);
- readers whose chunks would be other bytes or other chunks (vLLM's hybrid
  manager off: one group instead of two; planes exploded into layer groups of
  their own; 512-token chunks) and a reader of another checkpoint written to the
  same path get nothing of the writer's (only what they stored themselves),
  start and finish every request (a chunk that does not fit is never read), and
  give the no-connector engine's outputs. The other checkpoint's outputs differ
  from the first one's, so the path really holds other weights.

The same writer and reader pair also runs over a Redis server (`redis://`, LMCache's
Redis connector; skipped where no ``redis-server`` is installed: `scripts/test`
installs Debian's where it runs as root).

The chunk key names the chunk plan and the model's config and weights files
(`kv_worker.chunk_identity`), so engines that would read the bytes differently
never find each other's chunks.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from tests.engine.harness import redis_server, remote_server, run_engine
from tests.engine.kv_oracle import assert_loaded_blocks_were_computed
from tests.engine.models import MODELS, build
from tests.engine.test_engine_reuse import (  # noqa: F401 - model_dir is a fixture
    EXPECTED_WARM_HITS,
    ROUNDS,
    _assert_same_outputs,
    _spec,
    model_dir,
)

NAME = "gemma3-sliding128"
OTHER_CHECKPOINT = dataclasses.replace(MODELS[NAME], name=f"{NAME}-other-weights", seed=MODELS[NAME].seed + 100)
ROUND_A = [ROUNDS[0]]


def _hits(run: dict) -> list[int]:
    return [output["num_cached_tokens"] for output in run["rounds"][0]]


@pytest.fixture(scope="module")
def engines(model_dir):
    """Every engine run of this module, in order, over one remote server."""
    shared_path = model_dir / "shared-path"
    if shared_path.exists():
        shutil.rmtree(shared_path)
    shutil.copytree(build(MODELS[NAME], model_dir), shared_path)
    other = build(OTHER_CHECKPOINT, model_dir)
    runs = {}
    with remote_server() as port:
        env = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_URL": f"lm://127.0.0.1:{port}",
               "LMCACHE_REMOTE_SERDE": "naive"}

        def engine(label: str, env: dict = env, **options) -> dict:
            spec = _spec(model_dir, NAME, lmcache=True, env=env, rounds=ROUND_A, run_label=f"shared-{label}", **options)
            spec["model"] = str(shared_path)
            return run_engine(spec)

        runs["writer"] = engine("writer")
        runs["reader"] = engine("reader")
        runs["hybrid-off"] = engine("hybrid-off", disable_hybrid_kv_cache_manager=True)
        runs["planes-exploded"] = engine("planes-exploded", env={**env, "LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": "0"})
        runs["chunk-512"] = engine("chunk-512", env={**env, "LMCACHE_CHUNK_SIZE": "512"})
        shutil.rmtree(shared_path)
        shutil.copytree(other, shared_path)
        runs["other-checkpoint"] = engine("other-checkpoint")
    runs["baseline"] = run_engine(_spec(model_dir, NAME, lmcache=False, rounds=ROUND_A))
    other_baseline = _spec(model_dir, NAME, lmcache=False, rounds=ROUND_A)
    other_baseline["model"] = str(other)
    runs["other-baseline"] = run_engine(other_baseline)
    return runs


def test_a_second_engine_gets_the_first_engines_chunks(engines):
    _assert_reader_got_the_writers_chunks(engines["writer"], engines["reader"], engines["baseline"])


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="no redis-server on PATH (Debian's redis-server package; scripts/test installs it as root)")
def test_two_engines_share_through_redis(model_dir):
    env = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_SERDE": "naive"}
    with redis_server() as port:
        env["LMCACHE_REMOTE_URL"] = f"redis://127.0.0.1:{port}"
        writer, reader = (run_engine(_spec(model_dir, NAME, lmcache=True, env=env, rounds=ROUND_A,
                                           run_label=f"redis-{label}")) for label in ("writer", "reader"))
    baseline = run_engine(_spec(model_dir, NAME, lmcache=False, rounds=ROUND_A))  # the module's own, cached
    _assert_reader_got_the_writers_chunks(writer, reader, baseline)


def _assert_reader_got_the_writers_chunks(writer: dict, reader: dict, baseline: dict) -> None:
    assert writer["workers"][0]["connector"]["tokens_stored"] > 0, "the writer stored nothing"
    assert _hits(reader) == EXPECTED_WARM_HITS[0], f"reader got {_hits(reader)}, writer had {_hits(writer)}"
    assert reader["workers"][0]["connector"]["tokens_loaded"] == sum(EXPECTED_WARM_HITS[0])
    _assert_same_outputs(baseline, reader)
    _assert_same_outputs(baseline, writer)
    prompts = ROUND_A[0] * 2  # the writer's prompts, then the reader's
    records = writer["kv_oracle"][0] + reader["kv_oracle"][0]
    checked = assert_loaded_blocks_were_computed(records, prompts, _hits(writer) + _hits(reader))
    assert checked > 0, "no loaded block was checked"


@pytest.mark.parametrize("label", ["hybrid-off", "planes-exploded", "chunk-512", "other-checkpoint"])
def test_an_engine_that_reads_bytes_differently_gets_none_of_them(engines, label):
    """A, L and C were stored only by the writer; B shares A's first 512 tokens, so an engine may
    find them in its own store of A, depending on when its scheduler looks B up."""
    hits = _hits(engines[label])
    only_the_writers = [hits[index] for index in (0, 2, 3)]
    assert only_the_writers == [0, 0, 0], f"{label}: found {hits} (a reader of the writer's chunks finds {EXPECTED_WARM_HITS[0]})"
    assert hits[1] in (0, 512)
    baseline = engines["other-baseline" if label == "other-checkpoint" else "baseline"]
    _assert_same_outputs(baseline, engines[label])


def test_the_other_checkpoint_really_is_other_weights(engines):
    first = [output["tokens"] for output in engines["baseline"]["rounds"][0]]
    other = [output["tokens"] for output in engines["other-baseline"]["rounds"][0]]
    assert first != other

