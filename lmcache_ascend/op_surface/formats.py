"""LMCache's engine KV formats as the transfer kernel sees them: which paged planes, which chunk layout.

LMCache numbers its formats (`EngineKVFormat` in 0.5.x, `GPUKVFormat` 0..8 in
0.4.x, the same values); this module keys everything by that integer so it
imports nothing from LMCache (LMCache imports `lmcache_ascend.ops`, which uses
it). The facts are LMCache 0.5.6's (`gpu_connector/kv_format/specs/`): the
structural shape and the modifiers its torch baseline dispatches on.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_ascend.kernels.spec import TransferError

__all__ = ["FORMATS", "FormatFacts", "format_facts", "paged_layer_shape"]


@dataclass(frozen=True)
class FormatFacts:
    """One engine KV format: its name (LMCache's enum member) and layout facts."""

    value: int
    name: str
    cross_layer: bool = False  # one tensor holds every layer: [NB, NL, 2, ...]
    kv_list: bool = False  # two lists [K layers], [V layers] (SGLang MHA)
    mla: bool = False  # one latent plane, no K/V split
    hnd: bool = False  # heads before block tokens
    fused: bool = False  # K and V packed into the last dim: one plane
    two_major: bool = False  # [2, NB, ...]: K and V are two leading planes
    pbs_fused: bool = False  # blocks and block tokens folded into one axis
    kv_tuple: bool = False  # per layer a (K, V) tuple, or MLA planes (DSv4 bundled)
    single_kv: bool = False  # each entry is one K or V tensor

    @property
    def single_plane(self) -> bool:
        """The chunk holds one plane per layer ([NL, T, H]) rather than K and V ([2, NL, T, H])."""
        return self.mla or self.fused or self.single_kv


FORMATS: dict[int, FormatFacts] = {
    facts.value: facts
    for facts in (
        FormatFacts(0, "NB_NL_TWO_BS_NH_HS", cross_layer=True),
        FormatFacts(1, "NL_X_TWO_NB_BS_NH_HS", two_major=True),
        FormatFacts(2, "NL_X_NB_TWO_BS_NH_HS"),
        FormatFacts(3, "NL_X_NB_BS_HS", mla=True),
        FormatFacts(4, "TWO_X_NL_X_NBBS_NH_HS", kv_list=True, pbs_fused=True),
        FormatFacts(5, "NL_X_NBBS_ONE_HS", mla=True, pbs_fused=True),
        FormatFacts(6, "NL_X_TWO_NB_NH_BS_HS", hnd=True, two_major=True),
        FormatFacts(7, "NL_X_NB_TWO_NH_BS_HS", hnd=True),
        FormatFacts(8, "NB_NL_TWO_NH_BS_HS", cross_layer=True, hnd=True),
        FormatFacts(9, "TWO_X_NL_X_NB_BS_NH_HS", kv_list=True),
        FormatFacts(10, "NL_X_NB_NH_BS_TWO_HS", hnd=True, fused=True),
        FormatFacts(11, "NL_X_NB_BS_NH_TWO_HS", fused=True),
        FormatFacts(12, "NL_X_NB_NH_BS_CS", hnd=True, fused=True),
        FormatFacts(13, "NL_X_NB_BS_NH_CS", fused=True),
        FormatFacts(14, "NL_X_NB_BSV_BSS", mla=True),
        FormatFacts(15, "NL_X_TWO_NB_NH_ONE_BS_HS", hnd=True, two_major=True),
        FormatFacts(16, "NL_X_TWO_X_NB_BS_NH_HS", kv_tuple=True),
        FormatFacts(17, "NL_X_NP_X_NB_BS_ONE_HS", mla=True, kv_tuple=True),
        FormatFacts(18, "NL_X_NB_BS_NH_HS", single_kv=True),
    )
}


def format_facts(engine_kv_format: object, op: str, allowed: tuple[int, ...]) -> FormatFacts:
    """The facts of `engine_kv_format` if `op` supports it; else a TransferError listing what is allowed."""
    raw = getattr(engine_kv_format, "value", engine_kv_format)
    try:
        value = int(raw)  # an IntEnum member (0.5.x), an Enum's value (0.4.x) or a plain int
    except (TypeError, ValueError):
        value = None
    if isinstance(raw, bool) or value not in allowed:
        names = ", ".join(f"{FORMATS[v].name} ({v})" for v in allowed)
        raise TransferError(f"{op}: engine_kv_format={engine_kv_format!r} is not supported; allowed: {names}")
    return FORMATS[value]


def paged_layer_shape(facts: FormatFacts, nb: int, bs: int, nh: int, hs: int) -> tuple[int, ...]:
    """The shape of one layer's paged tensor of a per-layer format (LMCache's `paged_layer_shape`)."""
    if facts.pbs_fused:
        return (nb * bs, 1, hs)
    if facts.mla:
        return (nb, bs, hs)
    if facts.fused and facts.hnd:
        return (nb, nh, bs, hs)
    if facts.fused or facts.single_kv:
        return (nb, bs, nh, hs)
    if facts.two_major:
        return (2, nb, nh, bs, hs) if facts.hnd else (2, nb, bs, nh, hs)
    return (nb, 2, nh, bs, hs) if facts.hnd else (nb, 2, bs, nh, hs)
