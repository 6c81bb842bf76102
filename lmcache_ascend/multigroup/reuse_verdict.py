"""Whether LMCache may supply a prefix to this engine at all (pure; duck-typed configs).

Two things make an external prefix wrong, whatever bytes LMCache holds:

- a KV-cache group whose spec is state without which reuse is impossible
  (`spec_kinds.SpecKind.NO_REUSE`, e.g. a Mamba layer's recurrent state): the
  model would continue from a state that never saw the supplied tokens;
- vLLM turned its own prefix caching off because its computation over a cached
  prefix is not supported for this model or backend (vLLM's CPU build does that
  for MLA). The ``vllm-prefix-reuse-off-reason`` patch records vLLM's decision in
  the KV-transfer config's extra config (`VLLM_REUSE_OFF_KEY`), which travels
  with the config to the scheduler's process.

`reuse_blocker` names the reason, or None where reuse may be exact.
"""

from __future__ import annotations

from typing import Any

from lmcache_ascend.multigroup.specs import KVGroups

__all__ = ["VLLM_REUSE_OFF_KEY", "record_vllm_reuse_off", "reuse_blocker", "vllm_reuse_off_reason"]

VLLM_REUSE_OFF_KEY = "lmcache_ascend.vllm_prefix_reuse_off"


def _extra_config(vllm_config: Any) -> dict | None:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None)
    return extra if isinstance(extra, dict) else None


def record_vllm_reuse_off(vllm_config: Any, reason: str) -> bool:
    """Note on `vllm_config` that vLLM forced its own prefix caching off; False when
    the config has no KV-transfer config to carry it (no connector: nothing to guard)."""
    extra = _extra_config(vllm_config)
    if extra is None:
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        if transfer is None or not hasattr(transfer, "kv_connector_extra_config"):
            return False
        extra = {}
        transfer.kv_connector_extra_config = extra
    extra[VLLM_REUSE_OFF_KEY] = reason
    return True


def vllm_reuse_off_reason(vllm_config: Any) -> str | None:
    extra = _extra_config(vllm_config)
    reason = extra.get(VLLM_REUSE_OFF_KEY) if extra is not None else None
    return reason if isinstance(reason, str) and reason else None


def reuse_blocker(kv_groups: KVGroups | None, vllm_config: Any) -> str | None:
    """Why no prefix may be supplied to this engine, or None."""
    reasons = []
    if kv_groups is not None and kv_groups.no_reuse_groups:
        listed = "; ".join(f"group {group.group_index} ({group.no_reuse})" for group in kv_groups.no_reuse_groups)
        reasons.append(f"KV-cache groups that make reuse impossible: {listed}")
    vllm_reason = vllm_reuse_off_reason(vllm_config)
    if vllm_reason is not None:
        reasons.append(f"vLLM turned its own prefix caching off for this model ({vllm_reason})")
    return "; ".join(reasons) or None
