"""The seal at the end of every chunk buffer: its length and a digest of its bytes.

A chunk that leaves the process's memory (LMCache's remote backends: Redis, LMCache's
own server, ``fs://``; its local disk backend's files) can come back short, with other
bytes, or not at all: a shared cache evicts, restarts, is written by a buggy peer; a
file is cut short or altered. A damaged chunk loaded into
vLLM's paged cache gives wrong tokens with nothing to show for it, so every chunk
buffer keeps its last `SEAL_BYTES` for a seal (`ChunkPlanner.memory_shape` reserves
them): a tag, the buffer's length and the xxHash3-64 of everything before the seal.
The backend seals a buffer as it sends or writes it and checks it as it receives or
reads it (the ``lmcache-remote-chunk-seal`` and ``lmcache-disk-chunk-seal`` patches); a
buffer whose seal does not match is a miss, never bytes in the cache.

xxHash3 hashes host memory faster than it is copied (about 28 GB/s against 1 GB/s
for a copy on a CI core), and the bytes of a remote chunk are in host memory
anyway, so the check costs a small part of the transfer it guards. LMCache's local
CPU buffer, in this process's memory, is not sealed or checked: nothing outside the
process writes it.

Pure: xxhash and the buffer protocol only.
"""

from __future__ import annotations

import struct

import xxhash

__all__ = ["SEAL_BYTES", "clear_seal", "is_sealed", "seal"]

SEAL_BYTES = 16
# tag (4 bytes), sealed length (4 bytes, little-endian), xxh3-64 of the bytes before the seal (8 bytes)
_LAYOUT = struct.Struct("<4sIQ")
_TAG = b"LMAs"
assert _LAYOUT.size == SEAL_BYTES


def _sealed_view(buffer) -> memoryview:
    view = memoryview(buffer).cast("B")
    if view.nbytes <= SEAL_BYTES:
        raise ValueError(f"a chunk buffer of {view.nbytes} bytes has no room for its {SEAL_BYTES}-byte seal")
    return view


def seal(buffer) -> None:
    """Write the seal of `buffer` (a writable byte buffer) into its last `SEAL_BYTES`."""
    view = _sealed_view(buffer)
    body = view[:-SEAL_BYTES]
    view[-SEAL_BYTES:] = _LAYOUT.pack(_TAG, body.nbytes & 0xFFFFFFFF, xxhash.xxh3_64_intdigest(body))


def clear_seal(buffer) -> None:
    """Zero the seal of `buffer`, so that a read which falls short of it cannot leave an earlier chunk's."""
    _sealed_view(buffer)[-SEAL_BYTES:] = bytes(SEAL_BYTES)


def is_sealed(buffer) -> bool:
    """Whether `buffer` ends in the seal of exactly its own bytes (a short, long or altered buffer does not)."""
    view = memoryview(buffer).cast("B")
    if view.nbytes <= SEAL_BYTES:
        return False
    tag, length, digest = _LAYOUT.unpack(view[-SEAL_BYTES:])
    body = view[:-SEAL_BYTES]
    return tag == _TAG and length == body.nbytes & 0xFFFFFFFF and digest == xxhash.xxh3_64_intdigest(body)
