"""How patch modules are written: thin module-level wrappers, described once, layered one way.

- no function in ``lmcache_ascend`` is longer than 60 lines (a Triton kernel body, compiled
  whole, excepted);
- no module imports another module's underscore names;
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


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(decorator).split("(")[0] in ("triton.jit", "jit") for decorator in node.decorator_list)


def _long_functions(root: pathlib.Path) -> list[str]:
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(root.rglob("*.py"))
        for node in _functions(path)
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not _is_triton_kernel(node)
    ]


def test_no_function_is_longer_than_60_lines():
    long = _long_functions(PACKAGE)
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def _private_imports(root: pathlib.Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmcache_ascend")):
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} from {node.module} import {alias.name}"
                      for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_underscore_names():
    found = _private_imports(PACKAGE)
    assert not found, "underscore names imported from another module:\n" + "\n".join(found)


def test_the_length_check_can_fail(tmp_path):
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n@triton.jit\ndef kernel():\n{body}")
    assert [line.split()[1] for line in _long_functions(tmp_path)] == ["f"]


def test_the_import_check_can_fail(tmp_path):
    (tmp_path / "user.py").write_text("from lmcache_ascend.kernels.spec import _align, TransferError\n"
                                      "from lmcache_ascend import __version__\n")
    assert _private_imports(tmp_path) == ["user.py:1 from lmcache_ascend.kernels.spec import _align"]


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
