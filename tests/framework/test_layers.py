"""The folders' import arrows point one way: kernels and layouts below the op surface, pure logic free of vLLM and LMCache.

Read from the source (every import statement, function-level ones included), so
a module that would import against the arrows fails here before it can run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lmcache_ascend"
UPSTREAM = ("vllm", "vllm_ascend", "lmcache")

# folder or module -> the lmcache_ascend modules it may import (beyond itself)
MAY_IMPORT = {
    "bounded_cache.py": (),
    "kernels": ("lmcache_ascend.bounded_cache",),
    # a layout is facts and plane cuts: torch only, read by the worker and the op surface alike
    "layouts": (),
    "op_surface": ("lmcache_ascend.bounded_cache", "lmcache_ascend.flags", "lmcache_ascend.kernels",
                   "lmcache_ascend.layouts"),
}
# pure logic: any lmcache_ascend module but the patch glue; nothing of vLLM or LMCache
PURE = ("multigroup", "kv_worker", "prefix_cache", "blend")
GLUE = ("lmcache_ascend.patches", "lmcache_ascend.connector", "lmcache_ascend.autoload")


def _imports(part: str) -> dict[str, set[str]]:
    path = PACKAGE / part
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    assert files, f"{part}: no module found"
    found: dict[str, set[str]] = {}
    for file in files:
        names = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.level:
                names.add("<relative>")
        found[str(file.relative_to(PACKAGE))] = names
    return found


def _within(name: str, prefixes) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_the_lower_layers_import_only_what_lies_below_them(part):
    own = "lmcache_ascend." + part.removesuffix(".py")
    allowed = (own, *MAY_IMPORT[part])
    wrong = {
        file: sorted(name for name in names
                     if name == "<relative>" or _within(name, UPSTREAM)
                     or (name.startswith("lmcache_ascend") and not _within(name, allowed)))
        for file, names in _imports(part).items()
    }
    assert not any(wrong.values()), f"imports against the layers: { {f: n for f, n in wrong.items() if n} }"


@pytest.mark.parametrize("part", PURE)
def test_pure_logic_imports_no_vllm_lmcache_or_patch_glue(part):
    wrong = {file: sorted(name for name in names if _within(name, UPSTREAM + GLUE) or name == "<relative>")
             for file, names in _imports(part).items()}
    assert not any(wrong.values()), f"imports against the layers: { {f: n for f, n in wrong.items() if n} }"


def test_the_check_sees_an_import_against_the_arrows(tmp_path, monkeypatch):
    module = tmp_path / "kernels" / "bad.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from lmcache_ascend.flags import flag_value\n    import lmcache.v1\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", tmp_path)
    with pytest.raises(AssertionError, match=r"lmcache_ascend\.flags.*lmcache\.v1|lmcache\.v1.*lmcache_ascend\.flags"):
        test_the_lower_layers_import_only_what_lies_below_them("kernels")
