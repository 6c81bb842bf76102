"""The chunk seal: a buffer passes its check exactly when it holds the bytes it was sealed with."""

from __future__ import annotations

import numpy as np
import pytest

from lmcache_ascend.kv_worker.chunk_seal import SEAL_BYTES, clear_seal, is_sealed, seal


def _sealed(size: int, seed: int = 0) -> np.ndarray:
    buffer = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    seal(buffer)
    return buffer


def test_a_sealed_buffer_passes_and_keeps_its_bytes():
    original = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    buffer = original.copy()
    seal(buffer)
    assert is_sealed(buffer)
    assert np.array_equal(buffer[:-SEAL_BYTES], original[:-SEAL_BYTES]), "the seal wrote outside its tail"


@pytest.mark.parametrize("position", [0, 1, 2047, 4096 - SEAL_BYTES - 1, 4096 - SEAL_BYTES, 4095])
def test_any_flipped_byte_fails(position):
    buffer = _sealed(4096)
    buffer[position] ^= 0x01
    assert not is_sealed(buffer)


def test_every_single_byte_change_of_a_small_buffer_fails():
    buffer = _sealed(SEAL_BYTES + 40)
    for position in range(buffer.size):
        for flip in (0x01, 0x80, 0xFF):
            buffer[position] ^= flip
            assert not is_sealed(buffer), f"byte {position} ^ {flip:#x} passed"
            buffer[position] ^= flip
    assert is_sealed(buffer)


@pytest.mark.parametrize("cut", [1, SEAL_BYTES, 1000, 4096 - SEAL_BYTES])
def test_a_short_buffer_fails(cut):
    buffer = _sealed(4096)
    assert not is_sealed(buffer[:-cut])
    assert not is_sealed(buffer[cut:])


def test_a_longer_buffer_fails_and_zeros_never_pass():
    buffer = _sealed(4096)
    assert not is_sealed(np.concatenate([buffer, np.zeros(64, np.uint8)]))
    assert not is_sealed(np.zeros(4096, np.uint8))
    assert not is_sealed(np.zeros(SEAL_BYTES, np.uint8))


def test_a_buffer_with_no_room_for_a_seal_is_refused():
    with pytest.raises(ValueError, match=f"has no room for its {SEAL_BYTES}-byte seal"):
        seal(np.zeros(SEAL_BYTES, np.uint8))


def test_a_seal_moved_to_other_bytes_fails():
    first, second = _sealed(4096, seed=1), _sealed(4096, seed=2)
    second[-SEAL_BYTES:] = first[-SEAL_BYTES:]
    assert not is_sealed(second)


def test_a_cleared_seal_fails_and_only_the_seal_is_cleared():
    """A buffer about to be filled has its seal zeroed: a read that falls short cannot leave one that passes."""
    buffer = _sealed(4096, seed=3)
    before = buffer.copy()
    clear_seal(buffer)
    assert not is_sealed(buffer)
    assert np.array_equal(buffer[:-SEAL_BYTES], before[:-SEAL_BYTES])
    assert not buffer[-SEAL_BYTES:].any()
    with pytest.raises(ValueError, match="has no room"):
        clear_seal(np.zeros(SEAL_BYTES, np.uint8))
