"""Register every lmcache-ascend flag that names an LMCache config key in LMCache's config.

Adds one definition per flag-table row with ``lmcache_config_key`` (e.g.
``ascend_skip_state_groups``) to ``lmcache.v1.config._CONFIG_DEFINITIONS`` and
rebuilds ``LMCacheEngineConfig`` from the enlarged table *in place*: the class
object stays the same and takes the rebuilt dataclass members and loaders, so
every module that bound it before activation (``from lmcache.v1.config import
LMCacheEngineConfig``; some 35 of them, ``lmcache.integration.vllm.utils``
among them) and every existing instance's class see the keys. The keys can be
set in LMCache's YAML, in ``kv_connector_extra_config`` (``lmcache.<key>``) or
as ``LMCACHE_<KEY>`` in the environment, which (as always in LMCache) wins.
LMCache's env name for ``ascend_x`` is ``LMCACHE_ASCEND_X``: the flag itself.
Values are validated by the flag table (`coerce_flag`, as at activation); a bad one raises `ConfigKeyError`
naming key, value and what is allowed (LMCache would only log a ValueError).
"""

from __future__ import annotations

from lmcache_ascend.compat.source import NO_SOURCE
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

# What create_config_class and @dataclass build from the definitions table (closures
# over it, or derived from its fields): copied from a class built on the enlarged
# table onto LMCache's own class. Everything else of the class is left as it is.
REBUILT_MEMBERS = (
    "__init__",
    "__repr__",
    "__eq__",
    "__str__",
    "__annotations__",
    "__dataclass_fields__",
    "__dataclass_params__",
    "__match_args__",
    "__post_init__",
    "_config_definitions",
    "from_defaults",
    "from_dict",
    "from_env",
    "from_file",
    "to_dict",
)


class ConfigKeyError(Exception):
    """An lmcache-ascend key in LMCache's config has a value it does not allow.

    Deliberately not a ValueError: LMCache logs and drops those, and a bad
    value must stop start-up instead of silently becoming None.
    """


def config_definitions() -> dict[str, dict[str, object]]:
    """LMCache config definitions for every flag row with an LMCache key."""
    from lmcache_ascend.flags import FLAGS, FlagError, FlagKind, coerce_flag

    definitions: dict[str, dict[str, object]] = {}
    for flag in FLAGS:
        key = flag.lmcache_config_key
        if key is None:
            continue

        def convert(value, flag=flag, key=key):
            try:
                return coerce_flag(flag.name, value)
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
    table = dict(module._CONFIG_DEFINITIONS)
    table.update(config_definitions())
    rebuilt = create_config_class(
        config_name=module.LMCacheEngineConfig.__name__,
        config_definitions=table,
        config_aliases=getattr(module, "_CONFIG_ALIASES", {}),
        deprecated_configs=getattr(module, "_DEPRECATED_CONFIGS", {}),
    )
    members = {f"LMCacheEngineConfig.{name}": vars(rebuilt)[name] for name in REBUILT_MEMBERS}
    return {"_CONFIG_DEFINITIONS": table, **members}


def _keys_present(module) -> bool | None:
    table = getattr(module, "_CONFIG_DEFINITIONS", None)
    if not isinstance(table, dict):
        return None
    return all(key in table for key in config_definitions())


PATCH = Patch(
    name="lmcache-config-flag-keys",
    target="lmcache.v1.config",
    attributes=("_CONFIG_DEFINITIONS",) + tuple(f"LMCacheEngineConfig.{name}" for name in REBUILT_MEMBERS),
    kind=PatchKind.REPLACE,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(probe=_keys_present, fixed_if_source_contains=('"ascend_skip_state_groups"',)),
    build=_build,
    summary="registers lmcache-ascend flags as LMCache config keys (YAML/extra config; env wins)",
    why="Ascend switches must be settable where LMCache users set everything else, validated",
    mirrors="LMCache-Ascend #246 review: ascend_* keys in lmcache.v1.config._CONFIG_DEFINITIONS",
    delete_when="never while flags carry LMCache keys; the in-place rebuild goes if LMCache allows late keys",
    # LMCache 0.4.5 and 0.5.6 build these members from the same source; the
    # dataclass-made ones have none.
    tested_fingerprints={
        "LMCacheEngineConfig.__init__": (NO_SOURCE,),
        "LMCacheEngineConfig.__repr__": (NO_SOURCE,),
        "LMCacheEngineConfig.__eq__": (NO_SOURCE,),
        "LMCacheEngineConfig.__str__": ("16b6436b5360",),
        "LMCacheEngineConfig.__post_init__": ("8580bd30b261",),
        "LMCacheEngineConfig.from_defaults": ("85caac355d3f",),
        "LMCacheEngineConfig.from_dict": ("0afadc43fd6c",),
        "LMCacheEngineConfig.from_env": ("0525e8dbc117",),
        "LMCacheEngineConfig.from_file": ("0ba9895911ed",),
        "LMCacheEngineConfig.to_dict": ("4e5ef321c45b",),
    },
)
