"""A token-chunk hash that is the same in every process, for LMCache's chunk keys.

LMCache keys chunks by a prefix-hash chain.  Its default algorithm ("builtin")
is a vLLM hash function that no vLLM release defines, so LMCache falls back to
Python's ``hash()``, which is salted per process unless ``PYTHONHASHSEED`` is
fixed: vLLM's scheduler process and its workers then key the same tokens
differently and no lookup ever hits.  The chain also starts from vLLM's
``NONE_HASH``, drawn from ``os.urandom`` in the same situation.

`stable_token_hash` is SHA-256 over a type-tagged encoding of the values LMCache
hashes (the previous hash, a tuple of token ids, extra keys), folded to an
unsigned 64-bit int as LMCache folds digests.  Pure logic: no vLLM / LMCache.
"""

from __future__ import annotations

import builtins
import hashlib
from typing import Mapping

__all__ = [
    "CHAIN_START",
    "STABLE_HASH_NAME",
    "HeldRecords",
    "describe_chunk_hash",
    "is_seed_advice",
    "needs_process_stable_hash",
    "stable_token_hash",
]

STABLE_HASH_NAME = "lmcache-stable-token-hash"


def needs_process_stable_hash(hash_func: object, environ: Mapping[str, str]) -> bool:
    """True when `hash_func` is Python's salted ``hash`` and no fixed seed is set."""
    seed = environ.get("PYTHONHASHSEED")
    return hash_func is builtins.hash and (seed is None or seed == "random")


def _encode(value: object, out: list[bytes]) -> None:
    # Tag every value with its type so that (1, "1") and ("1", 1) differ, and
    # length-prefix containers so that nesting is unambiguous.
    kind = type(value)
    if kind is int or kind is bool:
        out.append(b"b" if kind is bool else b"i")
        out.append(str(int(value)).encode())
        out.append(b";")
    elif value is None:
        out.append(b"n;")
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s%d:" % len(data))
        out.append(data)
    elif kind is bytes:
        out.append(b"y%d:" % len(value))
        out.append(value)
    elif kind is float:
        out.append(b"f" + float.hex(value).encode() + b";")
    elif kind is tuple or kind is list:
        out.append(b"t%d:" % len(value))
        if all(type(item) is int for item in value):  # token ids: one join, not one call each
            out.append(",".join(map(str, value)).encode())
            out.append(b";")
        else:
            for item in value:
                _encode(item, out)
    else:
        raise TypeError(
            f"stable_token_hash: a value of type {kind.__name__} ({value!r:.60}) has no process-independent "
            "encoding; allowed: int, bool, None, str, bytes, float and tuples / lists of them"
        )


def stable_token_hash(value: object) -> int:
    """Unsigned 64-bit hash of `value`, equal in every process and on every host."""
    parts: list[bytes] = []
    _encode(value, parts)
    return int.from_bytes(hashlib.sha256(b"".join(parts)).digest()[:8], "big")


# Where the prefix-hash chain starts (LMCache's NONE_HASH) under the stable hash.
CHAIN_START = stable_token_hash("lmcache-ascend token chain start")


def describe_chunk_hash(hash_func: object, environ: Mapping[str, str]) -> str:
    """What keys LMCache's chunks in this process, for the start log."""
    if hash_func is stable_token_hash:
        return f"{STABLE_HASH_NAME} (SHA-256, the same in every process)"
    if hash_func is builtins.hash:
        return f"Python's hash() with PYTHONHASHSEED={environ.get('PYTHONHASHSEED')}"
    name = getattr(hash_func, "__qualname__", None) or type(hash_func).__name__
    return f"LMCache's own ({getattr(hash_func, '__module__', '?')}.{name})"


# LMCache's messages about its fallback to hash(): the PYTHONHASHSEED advice and the per-process
# chain start. Stale where the stable hash is in force: following the advice on some instances
# only would split a fleet into groups that never share.
_SEED_ADVICE_MARKS = ("PYTHONHASHSEED", "Using builtin hash", "NONE_HASH")


def is_seed_advice(message: str) -> bool:
    return any(mark in message for mark in _SEED_ADVICE_MARKS)


class HeldRecords:
    """A logging filter that holds back a logger's records about the hash fallback while attached.

    `release(drop)` detaches it and hands the held records back to the logger, leaving out the
    seed advice when `drop` (the stable hash is in force).
    """

    def __init__(self, logger) -> None:
        self.logger = logger
        self.records: list = []
        logger.addFilter(self)

    def filter(self, record) -> bool:
        if is_seed_advice(record.getMessage()):
            self.records.append(record)
            return False
        return True

    def release(self, drop: bool) -> None:
        self.logger.removeFilter(self)
        if not drop:
            for record in self.records:
                self.logger.handle(record)
        self.records = []
