"""The flag table: parsing, defaults and the errors a user sees."""

from __future__ import annotations

import pytest

from lmcache_ascend import flags as flag_table
from lmcache_ascend.flags import FlagError, flag_value, parse_flag, validate_all


def test_defaults_when_unset_or_blank():
    values = validate_all({})
    assert values["LMCACHE_ASCEND_BUNDLE_MULTI_SPEC"] is True
    assert values["LMCACHE_ASCEND_BLEND_HOLES"] is False
    assert values["LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"] == ()
    assert flag_value("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", {}) == 128
    assert flag_value("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", {}) == "auto"


ONE_VALUE_FLAGS = [f for f in flag_table.FLAGS if f.name.startswith("LMCACHE_ASCEND_") and f.kind.value != "name-list"]


@pytest.mark.parametrize("flag", ONE_VALUE_FLAGS, ids=[f.name for f in ONE_VALUE_FLAGS])
@pytest.mark.parametrize("raw", ["", "  "], ids=["empty", "blank"])
def test_an_empty_value_is_an_error_naming_the_flag_and_what_is_allowed(flag, raw):
    """`LMCACHE_ASCEND_BUNDLE_MULTI_SPEC=` is a broken script far more often than a wish for the default."""
    with pytest.raises(FlagError) as caught:
        validate_all({flag.name: raw})
    assert f"{flag.name}={raw!r} is empty; allowed: {flag.allowed_text()}" in str(caught.value)
    with pytest.raises(FlagError, match=f"{flag.name}={raw!r} is empty"):
        flag_value(flag.name, {flag.name: raw})


def test_an_empty_name_list_is_the_empty_list_and_upstream_variables_keep_their_reading(tmp_path):
    for name in ("LMCACHE_ASCEND_DISABLED_PATCHES", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"):
        assert validate_all({name: ""})[name] == ()
    # Set, it is a value like any other: it wins over LMCache's file.
    config = tmp_path / "lmcache.yaml"
    config.write_text("ascend_skip_state_spec_allowlist: [C4AttnKVState]\n")
    environ = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST": ""}
    assert flag_value("LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST", environ) == ()
    # vLLM reads VLLM_PREFIX_CACHE_RETENTION_INTERVAL itself: its empty value stays the default here.
    assert flag_value("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", {"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": ""}) == "auto"


@pytest.mark.parametrize("raw, expected", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False)])
def test_bool_spellings(raw, expected):
    assert parse_flag("LMCACHE_ASCEND_SKIP_STATE_GROUPS", raw) is expected


@pytest.mark.parametrize(
    "name, raw, message",
    [
        ("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "2", "LMCACHE_ASCEND_SKIP_STATE_GROUPS='2' is not a boolean; allowed: 1/0"),
        ("LMCACHE_ASCEND_TRANSFER_BACKEND", "cuda", "LMCACHE_ASCEND_TRANSFER_BACKEND='cuda' is not allowed; allowed: auto | triton | torch"),
        ("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", "48", "VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE='48' is not allowed; allowed: 32 | 64 | 128"),
        ("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "-16", "VLLM_PREFIX_CACHE_RETENTION_INTERVAL='-16' is not allowed; allowed: 'auto' or an integer 0..2147483647"),
        ("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "often", "'often' is not allowed"),
        ("LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST", "C4AttnKVState,bad name", "'bad name' is not a name"),
    ],
)
def test_bad_values_name_flag_value_and_what_is_allowed(name, raw, message):
    with pytest.raises(FlagError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        parse_flag(name, raw)


def test_validate_all_reports_every_bad_flag_at_once():
    with pytest.raises(FlagError) as caught:
        validate_all({"LMCACHE_ASCEND_PATCHES": "x", "LMCACHE_ASCEND_TRANSFER_BACKEND": "y"})
    assert "LMCACHE_ASCEND_PATCHES='x'" in str(caught.value)
    assert "LMCACHE_ASCEND_TRANSFER_BACKEND='y'" in str(caught.value)


def test_name_lists_and_star():
    assert parse_flag("LMCACHE_ASCEND_DISABLED_PATCHES", " a-b , c.d ,,") == ("a-b", "c.d")
    assert parse_flag("LMCACHE_ASCEND_DISABLED_PATCHES", "*") == ("*",)


def test_retention_interval_values():
    assert parse_flag("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "AUTO") == "auto"
    assert parse_flag("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "512") == 512
    assert parse_flag("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", " 0 ") == 0  # vLLM 0.23: latest boundary only


@pytest.mark.parametrize("raw", ["\u0664\u0660", "1_0", str(10**29), "+5", "0x10"])
def test_integers_are_ascii_digits_in_a_sane_range(raw):
    for name in ("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE"):
        with pytest.raises(FlagError, match=f"{name}="):
            parse_flag(name, raw)


def test_flags_owned_by_patches_are_not_checked_at_activation():
    """vLLM >= 0.23 reads the retention interval itself: activation never refuses it."""
    environ = {"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "often", "VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE": "48"}
    values = validate_all(environ)
    assert "VLLM_PREFIX_CACHE_RETENTION_INTERVAL" not in values
    with pytest.raises(FlagError, match="VLLM_PREFIX_CACHE_RETENTION_INTERVAL='often'"):
        flag_value("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", environ)


def test_unknown_flag_name_is_a_key_error():
    with pytest.raises(KeyError, match="unknown lmcache-ascend flag"):
        flag_value("LMCACHE_ASCEND_NOPE", {})


def test_table_is_consistent():
    names = [flag.name for flag in flag_table.FLAGS]
    assert len(names) == len(set(names))
    keys = [flag.lmcache_config_key for flag in flag_table.FLAGS if flag.lmcache_config_key]
    assert len(keys) == len(set(keys))
    for flag in flag_table.FLAGS:
        assert parse_flag(flag.name, None) == flag.default
        assert flag.help.strip()


def test_lmcache_config_file_sets_flags_and_the_environment_wins(tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text(
        "chunk_size: 256\n"
        "ascend_blend_holes: true\n"
        "ascend_skip_state_spec_allowlist: [C4AttnKVState, C128AttnScoreState]\n"
        "ascend_transfer_backend: torch\n"
    )
    environ = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_ASCEND_TRANSFER_BACKEND": "triton"}
    values = validate_all(environ)
    assert values["LMCACHE_ASCEND_BLEND_HOLES"] is True
    assert values["LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"] == ("C4AttnKVState", "C128AttnScoreState")
    assert values["LMCACHE_ASCEND_TRANSFER_BACKEND"] == "triton"  # env wins
    assert flag_value("LMCACHE_ASCEND_BLEND_HOLES", environ) is True
    # Flags without an LMCache key are never read from the file.
    config.write_text("LMCACHE_ASCEND_PATCHES: 0\n")
    assert validate_all({"LMCACHE_CONFIG_FILE": str(config)})["LMCACHE_ASCEND_PATCHES"] is True


def test_bad_value_in_the_config_file_names_the_key_and_the_file(tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text("ascend_transfer_backend: cuda\n")
    with pytest.raises(FlagError, match=r"LMCACHE_ASCEND_TRANSFER_BACKEND='cuda' is not allowed.*LMCache key 'ascend_transfer_backend' in .*lmcache.yaml"):
        validate_all({"LMCACHE_CONFIG_FILE": str(config)})
    with pytest.raises(FlagError, match="LMCACHE_CONFIG_FILE=.*can't be read"):
        validate_all({"LMCACHE_CONFIG_FILE": str(tmp_path / "missing.yaml")})


def test_an_unreadable_config_file_is_named_as_lmcaches_not_as_a_flag(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    with pytest.raises(flag_table.ConfigFileError) as caught:
        validate_all({"LMCACHE_CONFIG_FILE": missing})
    message = str(caught.value)
    assert message.startswith(f"LMCache's configuration file LMCACHE_CONFIG_FILE={missing!r} can't be read: ")
    assert "No such file" in message and "invalid lmcache-ascend flag" not in message
    # Activation goes on without it: the environment and the defaults, and the problem for later.
    values, problem = flag_table.values_for_activation({"LMCACHE_CONFIG_FILE": missing, "LMCACHE_ASCEND_BLEND_HOLES": "1"})
    assert values["LMCACHE_ASCEND_BLEND_HOLES"] is True and values["LMCACHE_ASCEND_TRANSFER_BACKEND"] == "auto"
    assert str(problem) == message
    # A bad flag beside it is still refused, and both are named.
    with pytest.raises(FlagError) as both:
        validate_all({"LMCACHE_CONFIG_FILE": missing, "LMCACHE_ASCEND_BLEND_HOLES": "2"})
    assert "LMCACHE_ASCEND_BLEND_HOLES='2' is not a boolean" in str(both.value) and missing in str(both.value)
    with pytest.raises(FlagError, match="LMCACHE_ASCEND_BLEND_HOLES='2'"):
        flag_table.values_for_activation({"LMCACHE_CONFIG_FILE": missing, "LMCACHE_ASCEND_BLEND_HOLES": "2"})


def test_where_a_value_comes_from(tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text("ascend_blend_holes: true\n")
    environ = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_ASCEND_TRANSFER_BACKEND": "torch"}
    assert flag_table.flag_origin("LMCACHE_ASCEND_BLEND_HOLES", environ) == f"{config}: ascend_blend_holes"
    assert flag_table.flag_origin("LMCACHE_ASCEND_TRANSFER_BACKEND", environ) == "environment"
    assert flag_table.flag_origin("LMCACHE_ASCEND_BUNDLE_MULTI_SPEC", environ) == "default"


@pytest.mark.parametrize("raw, unknown, close", [
    ("vllm-free-queue-prepen", "vllm-free-queue-prepen", "vllm-free-queue-prepend"),
    ("lmcache-reuse-guard, no-such-thing", "no-such-thing", None),
])
def test_a_disabled_patch_that_is_no_patch_is_refused(raw, unknown, close):
    """A typo would leave the patch on: refused by the flag check itself, so every command sees it."""
    with pytest.raises(FlagError) as caught:
        validate_all({"LMCACHE_ASCEND_DISABLED_PATCHES": raw})
    message = str(caught.value)
    assert f"LMCACHE_ASCEND_DISABLED_PATCHES={raw!r} names no patch {unknown!r}" in message
    assert ("did you mean" in message) is (close is not None) and (close is None or repr(close) in message)
    assert "allowed: '*' or patch names" in message
    assert validate_all({"LMCACHE_ASCEND_DISABLED_PATCHES": "*, lmcache-reuse-guard"})["LMCACHE_ASCEND_DISABLED_PATCHES"] == (
        "*", "lmcache-reuse-guard")


def test_the_state_spec_names_are_those_the_state_skip_treats_as_state():
    from lmcache_ascend.multigroup.spec_kinds import SPEC_KINDS, SpecKind
    from lmcache_ascend.multigroup.state_skip import DEFAULT_STATE_SPEC_CLASS_NAMES

    assert set(flag_table.STATE_SPEC_NAMES) == set(DEFAULT_STATE_SPEC_CLASS_NAMES)
    assert set(flag_table.STATE_SPEC_NAMES) == {name for name, (kind, _) in SPEC_KINDS.items() if kind is SpecKind.SKIP}
    allowlist = next(f for f in flag_table.FLAGS if f.name == "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST")
    assert allowlist.allowed == flag_table.STATE_SPEC_NAMES


@pytest.mark.parametrize(("name", "why"), [
    ("SlidingWindowSpec", "which is no state spec: its groups hold KV that reuse needs"),
    ("FullAttentionSpec", "which is no state spec"),
    ("MLAAttentionSpec", "which is no state spec"),
    ("MambaSpec", "which is no state spec"),
    ("C4AttnKVStat", "which is no known KV-cache spec type (a misspelt name would move every state group)"),
])
def test_the_state_allowlist_refuses_every_name_that_is_no_state_spec(tmp_path, name, why):
    """Skipping a sliding window's groups silently breaks the reused outputs."""
    raw = f"C4AttnKVState,{name}"
    with pytest.raises(FlagError) as caught:
        validate_all({"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST": raw})
    message = str(caught.value)
    assert f"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST={raw!r} names {name}, {why}" in message
    assert "allowed: comma-separated names among " + ", ".join(flag_table.STATE_SPEC_NAMES) in message
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"ascend_skip_state_spec_allowlist: [C4AttnKVState, {name}]\n")
    with pytest.raises(FlagError, match=rf"=\['C4AttnKVState', '{name}'\] names {name}, which is no"):
        validate_all({"LMCACHE_CONFIG_FILE": str(config)})


def test_the_state_allowlist_takes_every_state_spec():
    raw = ",".join(flag_table.STATE_SPEC_NAMES)
    assert validate_all({"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST": raw})[
        "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"] == flag_table.STATE_SPEC_NAMES


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"ascend_blend_holes: \xff\xfe\n", "can't be read"), (b"- a\n- b\n", "holds a YAML list"), (b"just text\n", "holds a YAML str")],
    ids=["not-utf8", "list", "scalar"],
)
def test_unusable_config_file_names_the_variable_and_the_file(tmp_path, content, message):
    config = tmp_path / "lmcache.yaml"
    config.write_bytes(content)
    with pytest.raises(FlagError, match=f"LMCACHE_CONFIG_FILE=.*lmcache.yaml.*{message}"):
        validate_all({"LMCACHE_CONFIG_FILE": str(config)})


@pytest.mark.parametrize(("line", "shown"), [("ascend_transfer_backend: [torch]", "['torch']"), ("ascend_blend_holes: [1, 0]", "[1, 0]")])
def test_a_list_for_a_one_value_flag_is_refused_at_activation(tmp_path, line, shown):
    """Not joined into text (which LMCache's own loader would then refuse)."""
    config = tmp_path / "lmcache.yaml"
    config.write_text(line + "\n")
    flag = next(f for f in flag_table.FLAGS if f.lmcache_config_key == line.split(":")[0])
    with pytest.raises(FlagError) as caught:
        validate_all({"LMCACHE_CONFIG_FILE": str(config)})
    message = str(caught.value)
    assert f"{flag.name}={shown} is a list" in message
    assert f"allowed: {flag.allowed_text()}" in message and str(config) in message
