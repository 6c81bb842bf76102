"""Applying one patch on demand, as the tests and the benchmark scripts do.

In production a patch goes in only from the post-import hook that activation registers; here
its target is imported and the patch applied at once, with the flags the caller chooses.
"""

from __future__ import annotations

from typing import Mapping

from lmcache_ascend import flags as flag_table
from lmcache_ascend.patches import gates
from lmcache_ascend.patches.model import State
from lmcache_ascend.patches.registry import Registry


def apply_now(registry: Registry, name: str, flag_values: Mapping[str, object] | None = None) -> State:
    """Import the target of patch `name` and apply it now, its prerequisites first; returns its state.
    A patch decided earlier (disabled, reverted) is decided again with `flag_values`
    (by default the flags of the environment)."""
    record = registry.record(name)
    values = flag_table.validate_all() if flag_values is None else flag_values
    if record.state is State.APPLIED:
        return record.state
    if record.state is not State.PENDING:
        record.set(State.PENDING, "")
    early = gates.before_import(record.entry, values)
    if early is not None:
        record.settle(early)
        return record.state
    for prerequisite in record.entry.after:
        if prerequisite in registry.names() and registry.record(prerequisite).state is not State.APPLIED:
            apply_now(registry, prerequisite, values)
    module = registry.import_target(record)
    if module is not None:
        registry.apply_to_module(name, module)
    return record.state
