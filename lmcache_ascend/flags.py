"""Every environment flag lmcache-ascend reads, in one typed table.

The table is the single source of truth: activation validates all flags against
it (one clear error naming the flag, its value and what is allowed), the CLI and
the README render it, and rows with an ``lmcache_config_key`` are also
registered as LMCache configuration keys, so they can be set in LMCache's YAML
as well (the file named by ``LMCACHE_CONFIG_FILE``, read here at activation too,
so that even patches enabled by a flag follow it); as in LMCache, the
environment wins over the file.

``LMCACHE_CONFIG_FILE`` is LMCache's variable, not ours: its file is read only for
the keys of our rows, whose values only LMCache-facing code uses.  A file that
can't be read (missing, not YAML, not a mapping, no PyYAML) is a `ConfigFileError`
that names it as LMCache's configuration file; activation without it
(`values_for_activation`) goes on with the environment and the defaults, and
`lmcache_ascend.activate_on_start` raises the error where LMCache is first used.

A set but empty variable is an error naming the flag (an empty value is far more
often a broken script than a wish for the default), except for a list flag, where
it is the empty list, and for upstream's variables (``owned_by_patches``), which
follow upstream's own reading.

Standard library only: this module is imported by the start-up path.
"""

from __future__ import annotations

import enum
import functools
import os
from collections import namedtuple
from typing import Callable, Mapping

from lmcache_ascend.multigroup.spec_kinds import SpecKind, names_of_kind

__all__ = [
    "AUXILIARY_VARIABLES",
    "ConfigFileError",
    "FLAGS",
    "Flag",
    "FlagError",
    "FlagKind",
    "coerce_flag",
    "flag_origin",
    "flag_value",
    "parse_flag",
    "report_unknown_variables",
    "unknown_variables",
    "validate_all",
    "values_for_activation",
]


class FlagError(ValueError):
    """A flag has a value outside what it allows."""


class ConfigFileError(FlagError):
    """LMCache's configuration file (``LMCACHE_CONFIG_FILE``) can't be read for lmcache-ascend's keys."""


class FlagKind(enum.Enum):
    BOOL = "bool"
    CHOICE = "choice"  # one of `allowed`
    INT_CHOICE = "int-choice"  # an integer among `allowed`
    NAME_LIST = "name-list"  # comma-separated identifiers; "" = empty
    AUTO_OR_NON_NEGATIVE_INT = "auto-or-non-negative-int"


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


# A named tuple made by collections.namedtuple: a frozen dataclass, or typing.NamedTuple
# (it compiles every annotation string), costs more at import than activation may.
class Flag(
    namedtuple(
        "Flag",
        ("name", "kind", "default", "help", "allowed", "lmcache_config_key", "owned_by_patches"),
        defaults=((), None, False),
    )
):
    """One flag: ``name``, ``kind`` (a `FlagKind`), typed ``default``, ``help``; ``allowed``:
    the values of a choice (or names of a list) flag.

    ``lmcache_config_key``: the matching LMCache configuration key, if the flag is also one.
    ``owned_by_patches``: validated by the patches that read it when they apply, never at
    activation: a bad value fails those patches only, and where upstream reads the
    variable itself (the patch skips), upstream's own rules are the only ones.
    """

    __slots__ = ()

    def allowed_text(self) -> str:
        if self.kind is FlagKind.BOOL:
            return "1/0, true/false, yes/no, on/off"
        if self.kind in (FlagKind.CHOICE, FlagKind.INT_CHOICE):
            return " | ".join(self.allowed)
        if self.kind is FlagKind.NAME_LIST:
            return "comma-separated names" + (f" among {', '.join(self.allowed)}" if self.allowed else "")
        return f"'auto' or an integer 0..{_INT_MAXIMUM} (0: latest boundary only)"

    def default_text(self) -> str:
        if self.kind is FlagKind.NAME_LIST and not self.default:
            return "(empty)"
        return self.value_text(self.default)

    def value_text(self, value: object) -> str:
        """A typed value as the user writes it (a boolean as 1/0, a list comma-separated)."""
        if self.kind is FlagKind.BOOL:
            return "1" if value else "0"
        if self.kind is FlagKind.NAME_LIST:
            return ",".join(value) if value else "(empty list)"
        return str(value)

    def empty_is_default(self) -> bool:
        """Whether a set but empty variable means the default: only for upstream's variables,
        read by upstream's own rules (a list flag's empty value is the empty list)."""
        return self.owned_by_patches or not self.name.startswith(FLAG_PREFIX)


# The compressor-state spec types that may be skipped on request (`SpecKind.SKIP` in the spec table):
# the only names LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST may hold.  Any other name would leave out
# KV that reuse needs (a sliding window's, say), and the reused outputs would silently be wrong.
STATE_SPEC_NAMES: tuple[str, ...] = names_of_kind(SpecKind.SKIP)

FLAGS: tuple[Flag, ...] = (
    Flag(
        "LMCACHE_ASCEND_AUTOLOAD",
        FlagKind.BOOL,
        True,
        "Activate from the .pth start-up hook on the first import of vllm, lmcache or vllm_ascend.",
    ),
    Flag(
        "LMCACHE_ASCEND_PATCHES",
        FlagKind.BOOL,
        True,
        "Master switch: 0 leaves every upstream module untouched.",
    ),
    Flag(
        "LMCACHE_ASCEND_DISABLED_PATCHES",
        FlagKind.NAME_LIST,
        (),
        "Patch names to leave out, or '*' for all (see `python -m lmcache_ascend.patches`).",
    ),
    Flag(
        "LMCACHE_ASCEND_BUNDLE_MULTI_SPEC",
        FlagKind.BOOL,
        True,
        "Move all planes of a multi-plane layer in one kernel launch; 0 explodes planes into separate layer groups.",
        lmcache_config_key="ascend_bundle_multi_spec",
    ),
    Flag(
        "LMCACHE_ASCEND_SKIP_STATE_GROUPS",
        FlagKind.BOOL,
        False,
        "Do not store or load the DeepSeek-V4 compressor-state KV-cache groups (*State* specs). Off by default: "
        "a resumed prefill reads state rows from before the chunk boundary (ratio 4 always, its windows overlap; "
        "ratio 128 where the prefix does not end on a multiple of 128, as when LMCache recomputes a whole "
        "prompt's last token), so skipping them changes the outputs. Only for a model whose compressors read "
        "no state across a boundary.",
        lmcache_config_key="ascend_skip_state_groups",
    ),
    Flag(
        "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST",
        FlagKind.NAME_LIST,
        (),
        "State spec class names to skip as state groups, replacing the built-in set (all of them); empty keeps the built-in set.",
        allowed=STATE_SPEC_NAMES,
        lmcache_config_key="ascend_skip_state_spec_allowlist",
    ),
    Flag(
        "LMCACHE_ASCEND_TRANSFER_BACKEND",
        FlagKind.CHOICE,
        "auto",
        "Transfer kernel implementation: auto picks Triton on CUDA/NPU and the torch reference elsewhere.",
        allowed=("auto", "triton", "torch"),
        lmcache_config_key="ascend_transfer_backend",
    ),
    Flag(
        "VLLM_PREFIX_CACHE_RETENTION_INTERVAL",
        FlagKind.AUTO_OR_NON_NEGATIVE_INT,
        "auto",
        "Backport of vLLM's sparse prefix-cache checkpoints: keep every N-th token position cached (a multiple of the "
        "scheduler block size; 0 keeps only the latest boundary), or auto. Checked by the backport when it applies; "
        "vLLM >= 0.23 reads this variable itself and takes integers only: do not set auto there.",
        owned_by_patches=True,
    ),
    Flag(
        "VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",
        FlagKind.INT_CHOICE,
        128,
        "Block size in tokens of DeepSeek-V4 compressed KV caches on vllm-ascend (only where the compress ratio is 128).",
        allowed=("32", "64", "128"),
        owned_by_patches=True,
    ),
    Flag(
        "LMCACHE_ASCEND_BLEND_HOLES",
        FlagKind.BOOL,
        False,
        "Hole-mode CacheBlend: reuse cached KV across non-contiguous prefixes, recomputing only holes and deviating tokens.",
        lmcache_config_key="ascend_blend_holes",
    ),
    Flag(
        "LMCACHE_ASCEND_CHUNK_SEAL",
        FlagKind.BOOL,
        True,
        "Seal chunks sent to LMCache's remote backends and written by its local disk backend (length + xxHash3) "
        "and treat one that fails the check as a miss.",
        lmcache_config_key="ascend_chunk_seal",
    ),
)

_BY_NAME: Mapping[str, Flag] = {flag.name: flag for flag in FLAGS}

# The namespace of the flags: a variable in it that is no flag is most likely a misspelt one.
FLAG_PREFIX = "LMCACHE_ASCEND_"

# Variables of that namespace which are not flags of the overlay: the project's test suite
# reads them (never the overlay), so they are known, not reported.
AUXILIARY_VARIABLES: Mapping[str, str] = {
    "LMCACHE_ASCEND_OPS_CASES": "test suite: random cases per op in the lmcache_ascend.ops comparisons",
    "LMCACHE_ASCEND_ENGINE_TIMEOUT": "test suite: seconds an engine test's run may take",
}


def _parse_bool(flag: Flag, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise FlagError(f"{flag.name}={raw!r} is not a boolean; allowed: {flag.allowed_text()}")


def _parse_choice(flag: Flag, raw: str) -> str:
    text = raw.strip().lower()
    if text not in flag.allowed:
        raise FlagError(f"{flag.name}={raw!r} is not allowed; allowed: {flag.allowed_text()}")
    return text


def _parse_int_choice(flag: Flag, raw: str) -> int:
    text = raw.strip()
    if text not in flag.allowed:
        raise FlagError(f"{flag.name}={raw!r} is not allowed; allowed: {flag.allowed_text()}")
    return int(text)


def _parse_name_list(flag: Flag, raw: str, shown: object = None) -> tuple[str, ...]:
    """`raw` split at commas; `shown`: the value as the user gave it, for the message (`raw` by default)."""
    shown = raw if shown is None else shown
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    for name in names:
        if name != "*" and not all(ch.isalnum() or ch in "_-." for ch in name):
            raise FlagError(f"{flag.name}={shown!r}: {name!r} is not a name; allowed: {flag.allowed_text()}")
        if flag.allowed and name not in flag.allowed:
            raise FlagError(_name_not_allowed(flag, shown, name))
    return names


def _name_not_allowed(flag: Flag, shown: object, name: str) -> str:
    if flag.allowed is not STATE_SPEC_NAMES:
        return f"{flag.name}={shown!r}: {name!r} is not allowed; allowed: {flag.allowed_text()}"
    from lmcache_ascend.multigroup.spec_kinds import known_spec_names  # standard library only; on error only

    if name in known_spec_names():
        why = ("which is no state spec: its groups hold KV that reuse needs, and skipping them would "
               "silently change the outputs")
    else:
        why = "which is no known KV-cache spec type (a misspelt name would move every state group)"
    return f"{flag.name}={shown!r} names {name}, {why}; allowed: {flag.allowed_text()}"


# Integers are ASCII digits (int() also takes other scripts' digits and "_") up to
# 2**31 - 1: any larger count of tokens is a typo.
_INT_MAXIMUM = 2**31 - 1


def parse_count(text: str) -> int | None:
    """`text` (already stripped) as a non-negative integer 0.._INT_MAXIMUM, or None."""
    if not text or len(text) > 10 or not all("0" <= ch <= "9" for ch in text):
        return None
    number = int(text)
    return number if number <= _INT_MAXIMUM else None


def _parse_auto_or_non_negative_int(flag: Flag, raw: str) -> str | int:
    text = raw.strip().lower()
    if text == "auto":
        return "auto"
    number = parse_count(text)
    if number is None:
        raise FlagError(f"{flag.name}={raw!r} is not allowed; allowed: {flag.allowed_text()}")
    return number


_PARSERS: Mapping[FlagKind, Callable[[Flag, str], object]] = {
    FlagKind.BOOL: _parse_bool,
    FlagKind.CHOICE: _parse_choice,
    FlagKind.INT_CHOICE: _parse_int_choice,
    FlagKind.NAME_LIST: _parse_name_list,
    FlagKind.AUTO_OR_NON_NEGATIVE_INT: _parse_auto_or_non_negative_int,
}


def get_flag(name: str) -> Flag:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown lmcache-ascend flag {name!r}; known: {', '.join(_BY_NAME)}") from None


def parse_flag(name: str, raw: str | None) -> object:
    """The typed value of flag `name` for the raw text `raw`.

    None (unset) is the default.  Blank text is the empty list for a list flag, the default
    for upstream's variables (`Flag.empty_is_default`), and an error for every other flag.
    """
    flag = get_flag(name)
    if raw is None:
        return flag.default
    if raw.strip() == "":
        if flag.kind is FlagKind.NAME_LIST:
            return ()
        if flag.empty_is_default():
            return flag.default
        raise FlagError(
            f"{name}={raw!r} is empty; allowed: {flag.allowed_text()} (unset it for the default, {flag.default_text()})"
        )
    return _PARSERS[flag.kind](flag, raw)


CONFIG_FILE_VARIABLE = "LMCACHE_CONFIG_FILE"


def coerce_flag(name: str, value: object) -> object:
    """The typed value of flag `name` for one configured value, whatever its source.

    The one validation of every source: text (the environment, ``LMCACHE_<KEY>``), a
    value of LMCache's YAML (a boolean, a number, a list) or of an LMCache config
    object (already typed, so this is idempotent).  None is the default; text follows
    `parse_flag` (blank text is an error but for list flags).  A list is only a value
    of a list flag: anywhere else it is refused, naming the flag, the value and what
    is allowed.
    """
    flag = get_flag(name)
    if value is None:
        return flag.default
    if isinstance(value, str):
        return _parse_memoized(name, value)
    if isinstance(value, bool):
        if flag.kind is FlagKind.BOOL:
            return value
        raise FlagError(f"{name}={value!r} is a boolean, not one of its values; allowed: {flag.allowed_text()}")
    if isinstance(value, (list, tuple)):
        if flag.kind is not FlagKind.NAME_LIST:
            raise FlagError(f"{name}={value!r} is a list, but {name} takes one value; allowed: {flag.allowed_text()}")
        if not all(isinstance(item, str) for item in value):
            raise FlagError(f"{name}={value!r} holds a non-text item; allowed: {flag.allowed_text()}")
        joined = ",".join(value)
        try:
            return _parse_memoized(name, joined)  # read on every KV transfer: memoized
        except FlagError:
            return _parse_name_list(flag, joined, shown=value)  # refused again, naming the value as given
    if isinstance(value, int):  # YAML `ascend_blend_holes: 1`: the same as the text "1"
        return _parse_memoized(name, str(value))
    raise FlagError(f"{name}={value!r} is a {type(value).__name__}; allowed: {flag.allowed_text()}")


def _config_file_error(path: str, problem: str) -> ConfigFileError:
    return ConfigFileError(f"LMCache's configuration file {CONFIG_FILE_VARIABLE}={path!r} {problem}")


@functools.lru_cache(maxsize=4)
def _config_file_values(path: str, modified: float) -> dict[str, object]:
    """flag name -> the value LMCache's YAML file gives its LMCache key, as YAML typed it."""
    try:
        import yaml  # LMCache's own dependency; only needed when its config file is used
    except ImportError:
        # Silence here would run with defaults where the file may set other values.
        raise _config_file_error(
            path, "is set but PyYAML is not installed, so the lmcache-ascend keys it may hold can't be read; "
            "install it: pip install 'lmcache-ascend[yaml]'"
        ) from None
    try:
        with open(path, encoding="utf-8") as handle:
            document = yaml.safe_load(handle)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise _config_file_error(path, f"can't be read: {error}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise _config_file_error(
            path, f"holds a YAML {type(document).__name__}; LMCache's configuration is a mapping of keys to values"
        )
    return {
        flag.name: document[flag.lmcache_config_key]
        for flag in FLAGS
        if flag.lmcache_config_key and document.get(flag.lmcache_config_key) is not None
    }


@functools.lru_cache(maxsize=256)
def _parse_memoized(name: str, raw: str) -> object:
    # Parsing is pure and values are immutable; a FlagError is not memoized, so it repeats.
    return parse_flag(name, raw)


def _configured(flag: Flag, env: Mapping[str, str], lmcache_config: object) -> tuple[object, str | None]:
    """(the value LMCache's configuration gives `flag`, where it was set), or (None, None)."""
    if lmcache_config is not None:
        value = getattr(lmcache_config, flag.lmcache_config_key, None)
        if value is not None:
            return value, f"LMCache config key {flag.lmcache_config_key!r}"
    path = env.get(CONFIG_FILE_VARIABLE, "").strip()
    if not path:
        return None, None
    try:
        modified = os.stat(path).st_mtime
    except OSError as error:
        raise _config_file_error(path, f"can't be read: {error}") from None
    value = _config_file_values(path, modified).get(flag.name)
    return value, f"LMCache key {flag.lmcache_config_key!r} in {path}"


def flag_value(name: str, environ: Mapping[str, str] | None = None, lmcache_config: object = None) -> object:
    """The validated value of flag `name`: the one resolution every reader uses.

    The environment if set, else (for a flag with an LMCache key) LMCache's
    configuration: `lmcache_config` (an LMCache config object, which holds the YAML
    and the connector's extra config) when it has the key, else the file
    ``LMCACHE_CONFIG_FILE`` names; else the default.  As in LMCache, the
    environment wins.  Every value goes through `coerce_flag`.  Cheap (hot paths,
    every KV transfer, call it).
    """
    flag = get_flag(name)
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is not None:
        return _parse_memoized(name, raw)
    if flag.lmcache_config_key is None:
        return flag.default
    value, source = _configured(flag, env, lmcache_config)
    try:
        return coerce_flag(name, value)
    except FlagError as error:
        raise FlagError(f"{error} (set by {source})") from None


def flag_origin(name: str, environ: Mapping[str, str] | None = None) -> str:
    """Where flag `name`'s value comes from: ``"environment"``, ``"PATH: KEY"`` (LMCache's
    configuration file and the key in it) or ``"default"``; raises `ConfigFileError` where
    that file can't be read."""
    flag = get_flag(name)
    env = os.environ if environ is None else environ
    if env.get(name) is not None:
        return "environment"
    if flag.lmcache_config_key is not None and _configured(flag, env, None)[0] is not None:
        return f"{env[CONFIG_FILE_VARIABLE].strip()}: {flag.lmcache_config_key}"
    return "default"


DISABLED_PATCHES = "LMCACHE_ASCEND_DISABLED_PATCHES"


def _unknown_patch_names(env: Mapping[str, str], disabled: tuple[str, ...]) -> str | None:
    """The problem with names in LMCACHE_ASCEND_DISABLED_PATCHES that are no patch (a typo would
    leave the patch on), or None.  The catalogue is only read when a name is given."""
    names = [name for name in disabled if name != "*"]
    if not names:
        return None
    import difflib

    from lmcache_ascend.patches.catalogue import CATALOGUE

    known = [entry.name for entry in CATALOGUE]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return None
    hints = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
             for name in unknown for close in [difflib.get_close_matches(name, known, n=1)]]
    return (f"{DISABLED_PATCHES}={env.get(DISABLED_PATCHES)!r} names no patch {', '.join(hints)}; "
            "allowed: '*' or patch names (`lmcache-ascend-patches` lists them)")


def _validate(env: Mapping[str, str]) -> tuple[dict[str, object], list[str], ConfigFileError | None]:
    """(values, the flag problems, the problem of LMCache's configuration file or None).

    Where the file can't be read, the flags it could set take their environment value or
    their default."""
    values: dict[str, object] = {}
    problems: list[str] = []
    file_problem: ConfigFileError | None = None
    for flag in FLAGS:
        if flag.owned_by_patches:
            continue
        try:
            values[flag.name] = flag_value(flag.name, env)
        except ConfigFileError as error:
            file_problem = error
            without_file = {key: value for key, value in env.items() if key != CONFIG_FILE_VARIABLE}
            values[flag.name] = flag_value(flag.name, without_file)  # its environment value was valid
        except FlagError as error:
            problems.append(str(error))
    unknown_patches = _unknown_patch_names(env, values.get(DISABLED_PATCHES, ()))
    if unknown_patches:
        problems.append(unknown_patches)
    return values, problems, file_problem


def _flag_problems_text(problems: list[str]) -> str:
    return "invalid lmcache-ascend flag: " + "; ".join(problems)


def validate_all(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Parse every flag activation checks (all but those owned by patches); raise one FlagError
    listing every bad value, and the problem of LMCache's configuration file if any (a
    `ConfigFileError` when that is the only one)."""
    env = os.environ if environ is None else environ
    values, problems, file_problem = _validate(env)
    if problems:
        raise FlagError(_flag_problems_text(problems) + (f"; {file_problem}" if file_problem else ""))
    if file_problem is not None:
        raise ConfigFileError(str(file_problem))
    return values


def values_for_activation(environ: Mapping[str, str] | None = None) -> tuple[dict[str, object], ConfigFileError | None]:
    """(every flag activation checks, the problem of LMCache's configuration file or None).

    Raises FlagError listing every bad flag value; a configuration file that can't be read is
    returned, not raised: activation goes on without it (see the module's docstring)."""
    env = os.environ if environ is None else environ
    values, problems, file_problem = _validate(env)
    if problems:
        raise FlagError(_flag_problems_text(problems))
    return values, file_problem


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """Each set ``LMCACHE_ASCEND_*`` variable that is neither a flag nor auxiliary, with the closest known names.

    Cheap when there is none (one pass over the environment's names); difflib only runs for the
    unknown ones.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(
        name for name in env if name.startswith(FLAG_PREFIX) and name not in _BY_NAME and name not in AUXILIARY_VARIABLES
    )
    if not unknown:
        return []
    import difflib

    # Compared without the shared prefix, which would make every name look close.
    known = {name[len(FLAG_PREFIX):]: name for name in [*_BY_NAME, *AUXILIARY_VARIABLES]}
    return [
        (name, tuple(known[close] for close in difflib.get_close_matches(name[len(FLAG_PREFIX):], known, n=3, cutoff=0.6)))
        for name in unknown
    ]


def unknown_variable_text(name: str, closest: tuple[str, ...]) -> str:
    hint = f"did you mean {' or '.join(closest)}?" if closest else f"known: {', '.join(_BY_NAME)}"
    return f"{name} is not an lmcache-ascend flag and is ignored; {hint}"


_reported_unknown: set[str] = set()


def report_unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warn once per process about each unknown ``LMCACHE_ASCEND_*`` variable (see `unknown_variables`).

    A warning, not an error: a flag of a newer lmcache-ascend set for a fleet must not stop an
    engine that runs an older one.  Returns the messages logged now.
    """
    messages = []
    for name, closest in unknown_variables(environ):
        if name in _reported_unknown:
            continue
        _reported_unknown.add(name)
        messages.append(unknown_variable_text(name, closest))
    if messages:
        import logging

        log = logging.getLogger("lmcache_ascend")
        for message in messages:
            log.warning("lmcache-ascend: %s", message)
    return messages
