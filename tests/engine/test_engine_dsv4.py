"""DeepSeek-V4 through the real engine: vLLM's CPU build (stack D), every KV-cache kind of the model.

The model (`tests.engine.models.DSV4`, bfloat16, weights drawn in the engine) has
a sliding window on every layer, ratio-4 compressed attention with its indexer,
ratio-128 compressed attention, and compressor state for each compressed cache.
vLLM makes five KV-cache groups of it (checked below): two sliding-window groups
(64-token blocks), one group of compressed caches (256-token blocks: 64 rows of a
ratio-4 cache, 2 of the ratio-128 one, the indexer's K beside them), and two
compressor-state groups (the last 8 tokens' state of each ratio-4 compressor in
4-token blocks, the last 128 tokens' of the ratio-128 one in 8-token blocks).

Three engine processes need the tests' help on this stack (tests/engine/dsv4_cpu,
loaded in every engine process): torch stand-ins for the Triton kernels of the
attention-metadata builders (no triton-cpu in any registry), a fix of vLLM's CPU
SWA builder (``KeyError: 'c1a'``), and weights drawn from a seed.

vLLM keeps its own prefix caching on for DeepSeek-V4 only on a CPU with AMX
tiles. Elsewhere the tests that need it let the platform decide as it does with
AMX (`tests.engine.dsv4_cpu.amx_decision`), after checking that vLLM's own
prefix reuse gives the cold prefill's outputs on that CPU.

The question the engine answers here: may a connector skip the compressor-state
groups when a loaded prefix ends at a chunk boundary? A warm request's cached
blocks of one group are overwritten (`tests.engine.skipped_groups`) before its
first step: the ratio-128 compressor's state is never read there (outputs stay
bitwise those of the cold prefill, with NaN in it), the ratio-4 compressor's is
(its compressor overlaps windows: the first state past the boundary mixes the 4
tokens before it), so that group must be stored and loaded.

With LMCache in process: where vLLM turned its prefix caching off (no AMX), the
engine runs and LMCache supplies and stores nothing. Where prefix caching stays on
(AMX, or the AMX decision on a CPU where vLLM's own reuse was just shown to equal the
cold prefill), LMCache supplies the chunk-aligned prefix of every group, the group
whose layers compress at ratios 4 and 128 moved at each layer's own ratio. Through
LMCache's MP server with LMCache's own MP connector, the same prefixes, every group.
"""

from __future__ import annotations

import platform

import pytest

from tests.engine.harness import run_engine
from tests.engine.models import DSV4, build
from tests.engine.test_engine_reuse import (  # noqa: F401 - model_dir is a fixture
    LMCACHE_ENV,
    model_dir,
    token_drawer,
)

HOOKS = ["dsv4_cpu"]
AMX_DECISION = {"LMCACHE_ASCEND_TEST_DSV4_AMX_DECISION": "1"}


def _rounds(seed: int = 11) -> list[list[list[int]]]:
    """A (700 tokens), C (A with its first token changed), A again, B (A's first 600 + 100 others);
    one prompt a round. vLLM's own cache and LMCache (256-token chunks) both hold 512 of A."""
    tokens = token_drawer(seed)
    a = tokens(700)
    control = [(a[0] + 1) % 500 or 3] + a[1:]
    return [[a], [control], [a], [a[:600] + tokens(100)]]


ROUNDS = _rounds()
WARM_HITS = [0, 0, 512, 512]


def _spec(model_dir, **options) -> dict:
    spec = {"model": str(build(DSV4, model_dir)), "rounds": ROUNDS, "max_tokens": 8, "dtype": DSV4.dtype,
            "load_format": DSV4.load_format, "engine_hooks": HOOKS, "lmcache": False}
    spec.update(options)
    return spec


def _outputs(run: dict) -> list[dict]:
    return [output for round_ in run["rounds"] for output in round_]


def _hits(run: dict) -> list[int]:
    return [output["num_cached_tokens"] for output in _outputs(run)]


def _group_index(run: dict, layer: str) -> int:
    (worker,) = run["workers"]
    (index,) = [index for index, group in enumerate(worker["groups"]) if layer in group["layers"]]
    return index


def _own_reuse(model_dir, **options) -> dict:
    return run_engine(_spec(model_dir, enable_prefix_caching=True, env=AMX_DECISION, **options))


@pytest.fixture(scope="module")
def cold(model_dir) -> dict:
    """The engine without a connector or prefix caching: every test below compares with its run
    (one engine start for all of them)."""
    return run_engine(_spec(model_dir))


@pytest.fixture(scope="module")
def own(model_dir, cold) -> dict:
    """The engine with vLLM's own prefix caching and no connector. On a CPU without AMX tiles it runs
    with the platform's AMX decision (vLLM would turn prefix caching off there); what the tests that
    compare with it rest on, that vLLM's own reuse gives the cold prefill's outputs bit for bit on this
    CPU, is asserted here, so that nothing is concluded from kernels that mishandle a cached prefix."""
    run = _own_reuse(model_dir)
    assert _hits(run) == WARM_HITS, f"vLLM's own cache supplied {_hits(run)}: the prompts no longer fit the test"
    _assert_equal_outputs(run, cold, "vLLM's own reuse")
    return run


def test_kv_cache_groups_and_control(cold):
    (worker,) = cold["workers"]
    table = [(group["block_size"], sorted(group["layers"])) for group in worker["groups"]]
    assert table == [
        (64, ["model.layers.0.attn.swa_cache", "model.layers.2.attn.swa_cache"]),
        (64, ["model.layers.1.attn.swa_cache", "model.layers.3.attn.swa_cache"]),
        (256, ["model.layers.1.attn", "model.layers.1.attn.indexer.k_cache", "model.layers.2.attn",
               "model.layers.3.attn", "model.layers.3.attn.indexer.k_cache"]),
        (4, ["model.layers.1.attn.compressor.state_cache", "model.layers.1.attn.indexer.compressor.state_cache",
             "model.layers.3.attn.compressor.state_cache", "model.layers.3.attn.indexer.compressor.state_cache"]),
        (8, ["model.layers.2.attn.compressor.state_cache"]),
    ], table
    assert [group["spec"] for group in worker["groups"]] == list(DSV4.expected_groups)
    assert _hits(cold) == [0] * len(ROUNDS)
    outputs = _outputs(cold)
    assert outputs[0]["tokens"] != outputs[1]["tokens"], "the output does not follow the prompt's first token"
    assert outputs[0] == outputs[2], "the same prompt twice, cold, gave other outputs"


def _assert_equal_outputs(got: dict, expected: dict, label: str) -> None:
    for index, (output, reference) in enumerate(zip(_outputs(got), _outputs(expected), strict=True)):
        assert output["tokens"] == reference["tokens"], f"{label}: prompt {index}: tokens differ"
        assert output["logprobs"] == reference["logprobs"], f"{label}: prompt {index}: logprobs differ"


def test_vllm_own_reuse_equals_cold(own):
    """What the tests below rest on: vLLM's own prefix reuse of every group gives the cold prefill's
    outputs bit for bit on this CPU (checked by the `own` fixture, which the LMCache tests share)."""
    assert _hits(own) == WARM_HITS


# layer whose group is skipped -> whether the warm outputs must stay those of the cold prefill
SKIPPED = {
    # the positive control: the sliding window of a cached prefix is read by the next tokens
    "model.layers.0.attn.swa_cache": False,
    "model.layers.1.attn.compressor.state_cache": False,  # ratio 4: overlapping windows
    "model.layers.2.attn.compressor.state_cache": True,  # ratio 128: a 512-token prefix closes its window
}


@pytest.mark.parametrize("layer", list(SKIPPED))
def test_group_skipped_at_a_chunk_boundary(model_dir, cold, layer):
    group = _group_index(cold, layer)
    skipped = _own_reuse(model_dir, skip_groups=[group])
    assert _hits(skipped) == WARM_HITS
    (filled,) = skipped["skipped_groups"]
    assert [cached for _, cached, _ in filled] == [512, 512] and all(count > 0 for *_, count in filled), filled
    if SKIPPED[layer]:
        _assert_equal_outputs(skipped, cold, f"group {group} skipped")
    else:
        warm = [output for output, hit in zip(_outputs(skipped), WARM_HITS) if hit]
        reference = [output for output, hit in zip(_outputs(cold), WARM_HITS) if hit]
        assert warm != reference, f"group {group} ({layer}) is never read past a chunk boundary"


def test_lmcache_where_vllm_turned_prefix_caching_off(model_dir, cold):
    """A CPU without AMX tiles, as users have it: vLLM turns its own prefix caching off for DeepSeek-V4,
    and the overlay's verdict follows it: the engine runs with LMCache in process, which supplies and
    stores nothing, and every output is the no-connector engine's."""
    if _amx_tiles():
        pytest.skip("on a CPU with AMX tiles vLLM keeps its prefix caching on for DeepSeek-V4")
    run = run_engine(_spec(model_dir, lmcache=True, env={**LMCACHE_ENV, "LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": "1"}))
    (worker,) = run["workers"]
    assert worker["kv_connector"] is not None, "the run had no KV connector: it would prove nothing"
    assert _hits(run) == [0] * len(ROUNDS)
    assert run["metrics"]["vllm:external_prefix_cache_hits"] == 0
    assert not worker["connector"]["tokens_loaded"] and not worker["connector"]["tokens_stored"], worker["connector"]
    _assert_equal_outputs(run, cold, "LMCache that supplies nothing")


def _amx_tiles() -> bool:
    import torch

    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("bundle", ["1", "0"], ids=["bundled", "exploded"])
def test_lmcache_reuse_exact_on_every_group(model_dir, cold, own, bundle):
    """LMCache in process with the overlay: warm prompts get their chunk-aligned prefixes from LMCache
    (vLLM's own caching off, so that every reused token is LMCache's, and the prefix's blocks filled with
    NaN before LMCache loads them), every output equals vLLM's own reuse's and the no-connector
    engine's, and the byte oracle checks loaded blocks of every layer of
    every group, the compressed group's ratio-4, ratio-128 and indexer layers included. The group whose
    layers compress at ratios 4 and 128 moves 64 rows of each ratio-4 layer and 2 of the ratio-128 one
    per 256-token chunk. Bundled and exploded planes (`LMCACHE_ASCEND_BUNDLE_MULTI_SPEC`) alike.

    On a CPU without AMX tiles the engine runs with the platform's AMX decision, as `own` does (which
    checked it against the cold prefill)."""
    from tests.engine.kv_oracle import loaded_blocks_checked

    decision = {} if _amx_tiles() else AMX_DECISION
    # Every block of every group below the prefix is filled with NaN before LMCache loads it (the blocks a
    # warm request gets may still hold an earlier run of the same prompt): a row LMCache leaves out shows.
    groups = list(range(len(DSV4.expected_groups)))
    spec = _spec(model_dir, lmcache=True, kv_oracle=True, skip_groups=groups,
                 env={**LMCACHE_ENV, "LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": bundle, **decision})
    run = run_engine(spec, timeout_s=600)
    (filled,) = run["skipped_groups"]
    assert sorted({group for group, cached, count in filled if cached == 512 and count}) == groups, filled
    assert _hits(run) == _hits(own) == WARM_HITS
    assert run["metrics"]["vllm:external_prefix_cache_hits"] == sum(WARM_HITS)
    _assert_equal_outputs(run, own, "LMCache against vLLM's own reuse")
    _assert_equal_outputs(run, cold, "LMCache against the cold prefill")
    (worker,) = run["workers"]
    assert worker["connector"]["connector"] == "MultiGroupGPUConnector", worker["connector"]
    rows = {}  # (KV-cache group, compress ratio) -> rows per chunk, from what the connector moves
    for layer_group in worker["connector"]["plan"]:
        for plane in layer_group["planes"]:
            rows.setdefault((plane["group"], plane["ratio"]), set()).add(plane["rows"])
    assert rows[2, 4] == {64} and rows[2, 128] == {2}, rows
    (records,) = run["kv_oracle"]
    prompts = [prompt for round_ in ROUNDS for prompt in round_]
    checked = loaded_blocks_checked(records, prompts, _hits(run))
    table = []
    for index, group in enumerate(worker["groups"]):
        per_layer = {layer: checked.get(layer, 0) for layer in group["layers"]}
        table.append((index, group["block_size"], sorted((ratio, sorted(moved)) for (g, ratio), moved in rows.items()
                                                          if g == index), per_layer))
    print(f"\nDeepSeek-V4, LMCache in process, bundle={bundle}: group, block size, (ratio, rows per chunk), "
          "oracle blocks checked per layer; outputs equal to vLLM's own reuse and to the cold prefill")
    for line in table:
        print("  ", *line)
    unchecked = [layer for *_, per_layer in table for layer, count in per_layer.items() if not count]
    assert not unchecked, f"the oracle checked no loaded block of {unchecked}: {table}"


def test_lmcache_mp_reuse_exact_on_every_group(model_dir, cold, own):
    """LMCache's MP server with LMCache's own MP connector (its LMCache-driven transfer, which a CPU
    worker needs for more than one KV-cache group): warm prompts get their chunk-aligned prefixes from
    the server, every block of every cache filled with NaN between rounds (the connector loads while a
    request waits, before its first step), every output equals vLLM's own reuse's and the cold
    prefill's, and the byte oracle checks loaded blocks of every layer."""
    from tests.engine.harness import mp_server
    from tests.engine.kv_oracle import loaded_blocks_checked

    decision = {} if _amx_tiles() else AMX_DECISION
    with mp_server(256) as port:
        spec = _spec(model_dir, lmcache=True, kv_oracle=True, poison_between_rounds="nan", wait_for_stores=True,
                     kv_connector="LMCacheMPConnector",
                     kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
                     env={"LMCACHE_MP_TRANSFER_MODE": "lmcache_driven", **decision})
        run = run_engine(spec, timeout_s=600)
    (worker,) = run["workers"]
    assert worker["kv_connector"] == "lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector"
    layers = sum(len(group["layers"]) for group in worker["groups"])
    assert run["poisoned"] == [layers] * (len(ROUNDS) - 1), run["poisoned"]
    assert _hits(run) == _hits(own) == WARM_HITS
    _assert_equal_outputs(run, own, "LMCache's MP server against vLLM's own reuse")
    _assert_equal_outputs(run, cold, "LMCache's MP server against the cold prefill")
    (records,) = run["kv_oracle"]
    prompts = [prompt for round_ in ROUNDS for prompt in round_]
    checked = loaded_blocks_checked(records, prompts, _hits(run))
    print("\nDeepSeek-V4, LMCache's MP server: oracle blocks checked per layer:", checked)
    unchecked = [layer for group in worker["groups"] for layer in group["layers"] if not checked.get(layer)]
    assert not unchecked, f"the oracle checked no loaded block of {unchecked}: {checked}"
