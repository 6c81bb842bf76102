"""The reference CacheBlend (tests/blend/reference) stays out of the shipped package."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_ascend

PACKAGE_DIR = Path(lmcache_ascend.__file__).resolve().parent
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_package_module_imports_test_or_benchmark_code():
    offenders = {
        str(path.relative_to(PACKAGE_DIR)): sorted(
            name for name in _imported_modules(path) if name.split(".")[0] in ("tests", "scripts")
        )
        for path in PACKAGE_DIR.rglob("*.py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_reference_modules_are_not_shipped():
    reference = {path.name for path in REFERENCE_DIR.glob("*.py")} - {"__init__.py"}
    assert reference >= {"model.py", "scenarios.py", "plan.py", "rope.py", "documents.py"}
    shipped = {path.name for path in (PACKAGE_DIR / "blend").glob("*.py")}
    assert shipped & {"reference_model.py", "evaluation.py", "plan.py", "rope.py", "documents.py"} == set()
