"""Per-KV-cache-group plan of LMCache 0.4.x's MP server and the wire agreement (pure logic, every stack)."""

from __future__ import annotations

import pytest

from lmcache_ascend.multigroup.mp_server import (
    HINT_CLIENT,
    HINT_GROUP_BLOCK_SIZES,
    HINT_LAYER_GROUPS,
    block_ids_format,
    check_request_format,
    chunk_block_ids,
    client_hints,
    layer_kv_groups,
    plan_from_hints,
    server_answer,
    server_format_from_answer,
    skip_blocks,
)
from lmcache_ascend.multigroup.mp_wire import (
    FLAT,
    NEGOTIATED,
    PER_GROUP,
    WireFormatMismatch,
    encode_block_ids,
    encode_for_server,
)

DSV4_SIZES = (256, 64, 64, 4, 8)  # vLLM's CUDA DeepSeek-V4 groups against vLLM block size 4
CHUNK = 256
TOKENS = 4096


def _tables(counts):
    return [[1000 * (g + 1) + i for i in range(n)] for g, n in enumerate(counts)]


def test_dsv4_blocks_per_chunk_and_every_chunk_slice():
    hints = client_hints([0, 1, 2, 3, 4, 0, 1, 2, 3, 4], DSV4_SIZES, "test client")
    plan = plan_from_hints(hints, 10)
    assert plan.layers_of(3) == [3, 8] and plan.client == "test client"
    per_chunk = plan.blocks_per_chunk(CHUNK)
    assert per_chunk == (1, 4, 4, 64, 32)
    counts = [TOKENS // size for size in DSV4_SIZES]
    assert counts == [16, 64, 64, 1024, 512]
    tables = _tables(counts)
    chunks = chunk_block_ids(tables, per_chunk, TOKENS // CHUNK)
    assert len(chunks) == 16
    for chunk, groups in enumerate(chunks):
        for g, ids in enumerate(groups):
            assert ids == [1000 * (g + 1) + chunk * per_chunk[g] + i for i in range(per_chunk[g])]


def test_a_missing_or_short_group_is_refused_naming_it():
    tables = _tables([16, 64, 64, 1024, 512])
    missing = tables[:4] + [[]]
    with pytest.raises(ValueError, match=r"group 4: 0 ids, 512 needed"):
        chunk_block_ids(missing, (1, 4, 4, 64, 32), 16)
    with pytest.raises(ValueError, match="block ids of 4 KV-cache groups for a registration of 5"):
        chunk_block_ids(tables[:4], (1, 4, 4, 64, 32), 16)
    tables[1] = tables[1][:-1]
    with pytest.raises(ValueError, match="group 1: 63 ids, 64 needed"):
        chunk_block_ids(tables, (1, 4, 4, 64, 32), 16)


def test_chunk_must_be_a_multiple_of_every_block_size():
    plan = plan_from_hints(client_hints([0, 1], (256, 96), "c"), 2)
    with pytest.raises(ValueError, match=r"group\(s\) 1 \(96 tokens\)"):
        plan.blocks_per_chunk(CHUNK)


def test_hints_checked_with_key_value_and_what_is_allowed():
    assert plan_from_hints(None, 3) is None
    assert plan_from_hints({"kv_layout": "NHD"}, 3) is None  # a flat registration
    good = client_hints([0, 1, 1], (16, 32), "c")
    for key, value, pattern in (
        (HINT_LAYER_GROUPS, [0, 1], "one KV-cache group id per registered layer"),
        (HINT_LAYER_GROUPS, [0, 2, 1], r"names group\(s\) \[2\]"),
        (HINT_LAYER_GROUPS, [0, 0, 0], r"leaves group\(s\) \[1\] without a layer"),
        (HINT_GROUP_BLOCK_SIZES, [16, 0], "block sizes > 0"),
        (HINT_GROUP_BLOCK_SIZES, [16, True], "block sizes > 0"),
        (HINT_CLIENT, "", "non-empty string"),
    ):
        with pytest.raises(ValueError, match=pattern) as error:
            plan_from_hints({**good, key: value}, 3)
        assert key in str(error.value)


def test_layer_groups_from_vllm_group_layer_names():
    names = ["l0", "l1", "l2", "l3"]
    assert layer_kv_groups(names, [["l1", "l3"], ["l0", "l2"]]) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match=r"\['l3'\] belong to no KV-cache group"):
        layer_kv_groups(names, [["l1"], ["l0", "l2"]])


def test_registration_answer_round_trip():
    assert server_format_from_answer(None) == (FLAT, None)
    answer = server_answer("lmcache-ascend 0.1 on LMCache 0.4.5")
    assert server_format_from_answer(answer) == (PER_GROUP, "lmcache-ascend 0.1 on LMCache 0.4.5")
    with pytest.raises(ValueError, match="answered a registration with 'ok'"):
        server_format_from_answer("ok")


def test_block_id_layouts_and_request_format_check():
    assert block_ids_format([1, 2, 3]) == FLAT
    assert block_ids_format([[1], [2, 3], []]) == PER_GROUP
    with pytest.raises(ValueError, match="mix ints and lists"):
        block_ids_format([1, [2]])
    check_request_format(PER_GROUP, PER_GROUP, {})
    with pytest.raises(WireFormatMismatch) as error:
        check_request_format(FLAT, PER_GROUP, {"client": "vLLM 0.18.1 side", "server": "LMCache 0.4.5 side"})
    assert "vLLM 0.18.1 side" in str(error.value) and "LMCache 0.4.5 side" in str(error.value)


def test_negotiated_ops_single_group_flat_multi_group_per_group():
    assert encode_block_ids([[4, 5]], NEGOTIATED, {}) == [4, 5]  # byte for byte as before
    assert encode_block_ids([[4, 5], [6]], NEGOTIATED, {}) == [[4, 5], [6]]
    versions = {"connector": "lmcache-ascend on vLLM 0.18.1", "server": "LMCache 0.4.5 MP server"}
    assert encode_for_server([4, 5], FLAT, versions) == [4, 5]
    assert encode_for_server([[4, 5], [6]], PER_GROUP, versions) == [[4, 5], [6]]
    assert encode_for_server([[4, 5]], FLAT, versions) == [4, 5]
    with pytest.raises(WireFormatMismatch) as error:
        encode_for_server([[4, 5], [6]], FLAT, versions)
    assert "vLLM 0.18.1" in str(error.value) and "LMCache 0.4.5" in str(error.value)


def test_skip_blocks_whole_blocks_only():
    assert [skip_blocks(t, 64) for t in (0, 63, 64, 200)] == [0, 0, 1, 3]
    with pytest.raises(ValueError, match="skip_tokens=-1"):
        skip_blocks(-1, 64)
