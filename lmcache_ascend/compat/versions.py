"""Installed distribution versions and PEP 440 specifier checks."""

from __future__ import annotations

import functools

# The distributions the overlay acts on or reports, in the order the CLI shows them.
REPORTED_DISTRIBUTIONS: tuple[str, ...] = (
    "vllm",
    "vllm-ascend",
    "lmcache",
    "torch",
    "torch-npu",
    "triton",
    "triton-ascend",
)


@functools.lru_cache(maxsize=None)
def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None when it is not installed."""
    from importlib import metadata  # lazily: it costs more than all of activation

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_versions(distributions: tuple[str, ...] = REPORTED_DISTRIBUTIONS) -> dict[str, str | None]:
    return {name: installed_version(name) for name in distributions}


def specifier_error(specifier: str) -> str | None:
    """Why `specifier` is not a valid PEP 440 specifier set, or None when it is (or can't be checked)."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:
        return None
    try:
        SpecifierSet(specifier)
    except InvalidSpecifier as error:
        return str(error)
    return None


def version_satisfies(version: str, specifier: str) -> bool | None:
    """Whether `version` is in `specifier` (pre-releases allowed); None if undecidable here."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # a bare interpreter: the listing CLI still works, the gate says "unknown"
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    # Local labels such as "+cpu" must not keep "2.13.0+cpu" out of ">=2.13".
    return SpecifierSet(specifier, prereleases=True).contains(parsed.public, prereleases=True)
