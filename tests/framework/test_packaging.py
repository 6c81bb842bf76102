"""What a fresh machine and a user's pip see: requirement files pinned by name and version from the
registry, and the package's own metadata (dependencies, extras, Python versions, PyPI description)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest

from tests.conftest import REPO_ROOT

REQUIREMENTS = REPO_ROOT / "requirements"
# name[extras]==version[; marker]: nothing else installs the same on every machine.
PINNED = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!_-]+(\s*;.+)?$")


def _requirement_lines(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            yield number, line


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_sets():
    """Each list of files scripts/test-env installs together for one stack."""
    for stack_file in sorted(REQUIREMENTS.glob("stack-*.txt")):
        standalone = stack_file.read_text().startswith("# standalone")
        yield stack_file.stem, ([stack_file] if standalone else [REQUIREMENTS / "common.txt", stack_file])


@pytest.mark.parametrize("path", sorted(REQUIREMENTS.glob("*.txt")), ids=lambda path: path.name)
def test_every_requirement_is_a_name_and_version_from_the_registry(path):
    for number, line in _requirement_lines(path):
        assert PINNED.match(line), (
            f"{path.name}:{number}: {line!r} is not 'name==version': a path, a file URL, a wheel or an "
            "option names what only one machine has"
        )


@pytest.mark.parametrize("stack, files", list(_installed_sets()), ids=lambda value: value if isinstance(value, str) else "")
def test_no_package_is_pinned_twice_in_one_stack(stack, files):
    seen: dict[str, str] = {}
    for path in files:
        for number, line in _requirement_lines(path):
            name = _normalized(PINNED.match(line)["name"]) if PINNED.match(line) else line
            assert name not in seen, f"stack {stack}: {name} pinned at {seen[name]} and at {path.name}:{number}"
            seen[name] = f"{path.name}:{number}"


def test_pyproject_declares_what_the_code_imports_and_what_is_tested():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalized(re.split(r"[<>=!~ ;\[]", spec, 1)[0]) for spec in project["dependencies"]}
    assert {"packaging", "numpy", "torch"} <= declared
    extras = project["optional-dependencies"]
    assert {"triton", "yaml"} <= set(extras)
    for spec in [*project["dependencies"], *(item for items in extras.values() for item in items)]:
        assert "@" not in spec and "://" not in spec, f"{spec!r} installs from a URL or path"
    assert project["requires-python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]


def test_the_installed_metadata_is_what_pyproject_says():
    try:
        metadata = importlib.metadata.metadata("lmcache-ascend")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lmcache-ascend is not installed here (scripts/test-env installs it in every stack)")
    requires = metadata.get_all("Requires-Dist") or []
    assert any(line.startswith("torch") for line in requires), requires
    assert any(line.lower().startswith("pyyaml") and "extra ==" in line and "yaml" in line.split("extra")[1] for line in requires), requires
    assert metadata["Requires-Python"] == ">=3.11"
    description = metadata.get_payload() if hasattr(metadata, "get_payload") else metadata["Description"]
    first = description.strip().splitlines()[0]
    # A user reading PyPI meets the product first, not the developers' build commands.
    assert first.startswith("# lmcache-ascend"), first
    if "scripts/test" in description:
        assert description.index("pip install lmcache-ascend") < description.index("scripts/test")
