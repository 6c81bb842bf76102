"""The byte oracle's check on hand-made records: it accepts computed bytes and names any other."""

from __future__ import annotations

import pytest

from tests.engine.kv_oracle import _prompt_key, assert_loaded_blocks_were_computed

PROMPT = list(range(10, 30))  # 20 tokens: blocks of 4 -> 5 whole blocks


def _record(digests: list[str | None]) -> dict:
    return {"prompt": _prompt_key(PROMPT), "blocks": {"layer": {"block_size": 4, "digests": digests}}}


def test_loaded_blocks_equal_to_computed_ones_pass():
    cold = _record(["a", "b", "c", "d", "e"])
    warm = _record(["a", None, "c", "d", "e"])  # block 1 outside a window: not filled
    assert assert_loaded_blocks_were_computed([cold, warm], [PROMPT, PROMPT], [0, 16]) == 3


def test_a_loaded_block_with_other_bytes_is_named():
    cold = _record(["a", "b", "c", "d", "e"])
    warm = _record(["a", "b", "X", "d", "e"])
    with pytest.raises(AssertionError, match=r"prompt 1 \(16 tokens supplied\), layer, block 2 \(tokens \[8, 12\)\)"):
        assert_loaded_blocks_were_computed([cold, warm], [PROMPT, PROMPT], [0, 16])


def test_bytes_vllm_only_loaded_are_no_reference():
    """Blocks below a hit were loaded, not computed: they cannot vouch for another load."""
    first = _record(["a", "b", "c", "d", "e"])
    with pytest.raises(AssertionError, match="never computed this prefix"):
        assert_loaded_blocks_were_computed([first, first], [PROMPT, PROMPT], [8, 8])
