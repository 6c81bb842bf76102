"""How patch modules are written: thin module-level wrappers, described once, layered one way.

- no function in ``lmcache_ascend/patches/`` is longer than 60 lines;
- a patch's What / Why / Mirrors / Delete when live in its `Patch` fields only
  (the CLI's ``show`` reads them): the module docstring says how, never restates them;
- no patch module imports another patch module, and nothing below the patch
  layer (compat, the pure packages) imports from ``lmcache_ascend.patches``;
- a module's probe is a real capability test, never a stand-in that can't tell.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from lmcache_ascend.patches.catalogue import PATCH_MODULES

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "lmcache_ascend"
MAX_FUNCTION_LINES = 60
LABELS = ("What:", "Why:", "Mirrors:", "Delete when:")
PATCH_PACKAGES = ("lmcache_ascend.patches.vllm", "lmcache_ascend.patches.lmcache", "lmcache_ascend.patches.vllm_ascend")


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_function_in_patches_is_longer_than_60_lines():
    long = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((PACKAGE / "patches").rglob("*.py"))
        for node in _functions(path)
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_the_length_check_can_fail(tmp_path):
    source = tmp_path / "long.py"
    source.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    (node,) = _functions(source)
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES


@pytest.mark.parametrize("module_name", PATCH_MODULES)
def test_description_is_written_once(module_name):
    module = importlib.import_module(module_name)
    patches = getattr(module, "PATCHES", None) or (module.PATCH,)
    for patch in patches:
        for field in ("summary", "why", "mirrors", "delete_when"):
            assert getattr(patch, field).strip(), f"{patch.name}: {field} is empty"
    restated = [label for label in LABELS if label in (module.__doc__ or "")]
    assert not restated, f"{module_name}'s docstring restates {restated}: the Patch fields are the one place"


@pytest.mark.parametrize("module_name", PATCH_MODULES)
def test_patch_modules_import_no_other_patch_module(module_name):
    path = PACKAGE.parent / (module_name.replace(".", "/") + ".py")
    others = {name for name in _imported_modules(path) if name.startswith(PATCH_PACKAGES) and name != module_name}
    assert not others, f"{module_name} imports patch modules {sorted(others)}: shared logic belongs in a pure package"


def test_nothing_below_the_patches_imports_them():
    upward = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in _imported_modules(path) if name.startswith("lmcache_ascend.patches")
        )
        for package in ("compat", "multigroup", "prefix_cache", "blend", "kv_worker", "kernels")
        for path in (PACKAGE / package).rglob("*.py")
    }
    assert not {path: names for path, names in upward.items() if names}


@pytest.mark.parametrize("module_name", PATCH_MODULES)
def test_no_probe_that_cannot_tell(module_name):
    module = importlib.import_module(module_name)
    for patch in getattr(module, "PATCHES", None) or (module.PATCH,):
        probe = patch.guard.probe
        if probe is None or getattr(probe, "__name__", "") != "<lambda>":
            continue
        code = probe.__code__
        assert not (code.co_code and code.co_consts == (None,) and not code.co_names), (
            f"{patch.name}: a probe that always answers None says nothing"
        )
