"""LMCache's engine KV formats as the op surface looks them up: by LMCache's integer code.

LMCache numbers its formats (`EngineKVFormat` in 0.5.x, `GPUKVFormat` 0..8 in
0.4.x, the same values); each is declared by the layout it names
(`lmcache_ascend.layouts`), with the ops that take it. Keyed by that integer, this
imports nothing from LMCache (LMCache imports `lmcache_ascend.ops`, which uses it).
"""

from __future__ import annotations

from lmcache_ascend.kernels.spec import TransferError
from lmcache_ascend.layouts import FormatFacts, format_by_code

__all__ = ["FORMATS", "FormatFacts", "format_facts"]

FORMATS: dict[int, FormatFacts] = format_by_code()


def format_facts(engine_kv_format: object, op: str) -> FormatFacts:
    """The facts of `engine_kv_format` if `op` takes it; else a TransferError listing what it takes."""
    raw = getattr(engine_kv_format, "value", engine_kv_format)
    try:
        value = int(raw)  # an IntEnum member (0.5.x), an Enum's value (0.4.x) or a plain int
    except (TypeError, ValueError):
        value = None
    facts = FORMATS.get(value)
    if isinstance(raw, bool) or facts is None or op not in facts.ops:
        names = ", ".join(f"{facts.name} ({code})" for code, facts in FORMATS.items() if op in facts.ops)
        raise TransferError(f"{op}: engine_kv_format={engine_kv_format!r} is not supported; allowed: {names}")
    return facts
