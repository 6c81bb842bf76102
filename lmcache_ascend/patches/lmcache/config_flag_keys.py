"""Register every lmcache-ascend flag that names an LMCache config key in LMCache's config.

What: adds one definition per flag-table row with ``lmcache_config_key`` (e.g.
``ascend_skip_state_groups``) to ``lmcache.v1.config._CONFIG_DEFINITIONS`` and
rebuilds ``LMCacheEngineConfig`` from the enlarged table, so the keys can be
set in LMCache's YAML, in ``kv_connector_extra_config`` (``lmcache.<key>``) or
as ``LMCACHE_<KEY>`` in the environment, which (as always in LMCache) wins.
LMCache's env name for ``ascend_x`` is ``LMCACHE_ASCEND_X``: the flag itself.
Values are validated by the flag table; a bad one raises `ConfigKeyError`
naming key, value and what is allowed (LMCache would only log a ValueError).
Why: LMCache-Ascend #246 review: the Ascend switches belong in LMCache's config
definitions, not only in ad-hoc environment reads.
Mirrors: LMCache-Ascend #246 (``_CONFIG_DEFINITIONS["ascend_bundle_multi_spec"]``).
Delete when: never while lmcache-ascend has LMCache-configurable flags; the
rebuild can go if LMCache's config class accepts keys added after import.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

# Attributes that create_config_class builds itself (closures over the table):
# taking them from the old class would tie the new class to the old table.
_REBUILT_BY_LMCACHE = frozenset(
    {"from_defaults", "from_file", "from_env", "from_dict", "to_dict", "to_json", "from_json"}
)


class ConfigKeyError(Exception):
    """An lmcache-ascend key in LMCache's config has a value it does not allow.

    Deliberately not a ValueError: LMCache logs and drops those, and a bad
    value must stop start-up instead of silently becoming None.
    """


def config_definitions() -> dict[str, dict[str, object]]:
    """LMCache config definitions for every flag row with an LMCache key."""
    from lmcache_ascend.flags import FLAGS, FlagError, FlagKind, parse_flag

    definitions: dict[str, dict[str, object]] = {}
    for flag in FLAGS:
        key = flag.lmcache_config_key
        if key is None:
            continue

        def convert(value, flag=flag, key=key):
            if isinstance(value, (list, tuple)) and flag.kind is FlagKind.NAME_LIST:
                value = ",".join(str(item) for item in value)
            elif isinstance(value, bool):
                value = "1" if value else "0"
            try:
                return parse_flag(flag.name, str(value))
            except FlagError as error:
                raise ConfigKeyError(f"LMCache config key {key}={value!r}: {error}") from None

        value_type = {
            FlagKind.BOOL: bool,
            FlagKind.NAME_LIST: tuple,
            FlagKind.INT_CHOICE: int,
        }.get(flag.kind, str)
        definitions[key] = {
            "type": value_type,
            "default": flag.default,
            "env_converter": convert,
            "description": f"{flag.help} (lmcache-ascend flag {flag.name})",
        }
    return definitions


def _build(ctx: PatchContext) -> dict[str, object]:
    from lmcache.v1.config_base import create_config_class

    module = ctx.module
    old_class = module.LMCacheEngineConfig
    table = dict(module._CONFIG_DEFINITIONS)
    table.update(config_definitions())
    field_names = set(getattr(old_class, "__dataclass_fields__", {}))
    extras = {}
    for name, value in vars(old_class).items():
        if name.startswith("__") or name in field_names or name in _REBUILT_BY_LMCACHE:
            continue
        function = getattr(value, "__func__", value)
        if callable(function) and getattr(function, "__module__", None) == module.__name__:
            extras[name] = value
    new_class = create_config_class(
        config_name=old_class.__name__,
        config_definitions=table,
        config_aliases=getattr(module, "_CONFIG_ALIASES", {}),
        deprecated_configs=getattr(module, "_DEPRECATED_CONFIGS", {}),
        namespace_extras=extras,
    )
    new_class.__module__ = module.__name__
    new_class.__qualname__ = old_class.__qualname__
    return {"_CONFIG_DEFINITIONS": table, "LMCacheEngineConfig": new_class}


def _keys_present(module) -> bool | None:
    table = getattr(module, "_CONFIG_DEFINITIONS", None)
    if not isinstance(table, dict):
        return None
    return all(key in table for key in config_definitions())


PATCH = Patch(
    name="lmcache-config-flag-keys",
    target="lmcache.v1.config",
    attributes=("_CONFIG_DEFINITIONS", "LMCacheEngineConfig"),
    kind=PatchKind.REPLACE,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(probe=_keys_present, fixed_if_source_contains=('"ascend_skip_state_groups"',)),
    build=_build,
    summary="registers lmcache-ascend flags as LMCache config keys (YAML/extra config; env wins)",
    why="Ascend switches must be settable where LMCache users set everything else, validated",
    mirrors="LMCache-Ascend #246 review: ascend_* keys in lmcache.v1.config._CONFIG_DEFINITIONS",
    delete_when="never while flags carry LMCache keys; the class rebuild goes if LMCache allows late keys",
)
