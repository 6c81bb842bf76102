"""The stable chunk hash keys chunks as every earlier release did: a cache shared by a fleet keeps serving
instances of mixed versions. The values below were computed by the first release's encoding."""

from __future__ import annotations

import random

import pytest

from lmcache_ascend.token_hash import CHAIN_START, stable_token_hash

TOKENS = tuple(random.Random(1).randrange(10**6) for _ in range(256))


@pytest.mark.parametrize("value, key", [
    ((CHAIN_START, tuple(range(256)), None), 18394820626913246893),
    ((123, (5, -3, 2**40), ("lora", 1.5, True, b"x")), 5410315881819225888),
    ((0, TOKENS, None), 6678341405049354119),
])
def test_keys_are_those_of_earlier_releases(value, key):
    assert stable_token_hash(value) == key


def test_a_changed_token_changes_the_key():
    changed = (*TOKENS[:100], TOKENS[100] + 1, *TOKENS[101:])
    assert stable_token_hash((0, changed, None)) != stable_token_hash((0, TOKENS, None))
    assert stable_token_hash((0, (1, 23), None)) != stable_token_hash((0, (12, 3), None))
