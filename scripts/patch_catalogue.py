#!/usr/bin/env python
"""Maintainer tools for the patch declarations (not shipped: they edit this checkout).

    python scripts/patch_catalogue.py check             # exit 1 when catalogue.py is out of date
    python scripts/patch_catalogue.py write             # regenerate lmcache_ascend/patches/catalogue.py
    python scripts/patch_catalogue.py flags-table       # the README's table of the flags (Markdown)
    .venvs/stack-d/bin/python scripts/patch_catalogue.py fingerprint NAME  # for tested_fingerprints

``write`` keeps the catalogue's docstring and module order; a new patch module is appended.
``fingerprint`` prints the source fingerprint of each target attribute of patch NAME on this
stack, one ``tested_fingerprints`` line each.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lmcache_ascend.compat.source import fingerprint  # noqa: E402
from lmcache_ascend.flags import FLAGS  # noqa: E402
from lmcache_ascend.patches import catalogue  # noqa: E402
from lmcache_ascend.patches.model import MISSING, CatalogueEntry, look_up  # noqa: E402
from lmcache_ascend.patches.records import declared_in  # noqa: E402
from lmcache_ascend.patches.registry import DeclarationError, process_registry  # noqa: E402

CATALOGUE_PATH = REPO_ROOT / "lmcache_ascend" / "patches" / "catalogue.py"
WIDTH = 120
# The packages whose modules declare patches.
PATCH_PACKAGES = ("lmcache_ascend.patches.vllm", "lmcache_ascend.patches.lmcache", "lmcache_ascend.patches.vllm_ascend")
PACKAGE_PREFIX = "lmcache_ascend.patches."
CATALOGUE_HEAD = (
    "def _entry(name: str, module: str, target: str, requires: dict[str, str], **optional: object) -> CatalogueEntry:",
    '    """One row: the patch, its module under lmcache_ascend.patches, its target, requires, then the rest."""',
    f'    return CatalogueEntry(name, module="{PACKAGE_PREFIX}" + module, target=target, requires=requires, '
    '**optional)',
)


def declaration_modules() -> list[str]:
    """The patch modules: the catalogue's, in its order, then any new one in PATCH_PACKAGES."""
    found = list(catalogue.PATCH_MODULES)
    for package in PATCH_PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
            if not info.ispkg and info.name not in found:
                found.append(info.name)
    return found


def literal(value: object) -> str:
    """`value` (str, None, tuple or dict of them) as the catalogue writes it."""
    if isinstance(value, tuple):
        return f"({literal(value[0])},)" if len(value) == 1 else "(" + ", ".join(map(literal, value)) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(key)}: {literal(item)}" for key, item in value.items()) + "}"
    return "None" if value is None else json.dumps(value)  # a str in double quotes


def catalogue_row(entry: CatalogueEntry) -> list[str]:
    """The lines of one ``_entry(...)`` call, its arguments packed into 120 columns."""
    arguments = [literal(entry.name), literal(entry.module.removeprefix(PACKAGE_PREFIX)), literal(entry.target),
                 literal(entry.requires)]
    arguments += [f"{field}={literal(getattr(entry, field))}" for field in ("flags", "enabled_by", "after")
                  if getattr(entry, field) not in ((), None)]
    lines = ["    _entry("]
    for index, argument in enumerate(arguments):
        argument += ")," if index == len(arguments) - 1 else ","
        if len(lines[-1]) + len(argument) + 1 > WIDTH:
            lines.append(" " * 11)
        lines[-1] += argument if lines[-1].endswith(("(", " " * 11)) else " " + argument
    return lines


def catalogue_source() -> str:
    """The text of ``catalogue.py``: its docstring as written, one row per declared patch."""
    rows = [line for module_name in declaration_modules() for patch in declared_in(module_name)
            for line in catalogue_row(CatalogueEntry.of(patch, module_name))]
    return "\n".join([f'"""{catalogue.__doc__}"""', "", "from lmcache_ascend.patches.model import CatalogueEntry",
                      "", "", *CATALOGUE_HEAD, "", "", "CATALOGUE: tuple[CatalogueEntry, ...] = (", *rows, ")", "",
                      "# The declaration modules, in order.",
                      "PATCH_MODULES: tuple[str, ...] = tuple(dict.fromkeys(entry.module for entry in CATALOGUE))", ""])


def print_flags_table() -> int:
    print("| flag | allowed | default | LMCache key | meaning |\n|---|---|---|---|---|")
    for flag in FLAGS:
        key = f"`{flag.lmcache_config_key}`" if flag.lmcache_config_key else "-"
        print(f"| `{flag.name}` | {flag.allowed_text()} | `{flag.default_text()}` | {key} | {flag.help} |")
    return 0


def print_fingerprints(name: str) -> int:
    try:
        patch = process_registry().record(name).patch
    except (KeyError, DeclarationError) as error:
        print(error.args[0], file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(patch.target)
    except Exception as error:  # a target this environment can't import
        print(f"fingerprint {name}: {patch.target} does not import here: {type(error).__name__}: {error}",
              file=sys.stderr)
        return 2
    for path in patch.attributes:
        raw = look_up(module, path)[2]
        print(f"{path!r}: {fingerprint(raw) if raw is not MISSING else None!r},")
    return 0


def write_catalogue() -> int:
    CATALOGUE_PATH.write_text(catalogue_source())
    print(f"wrote {CATALOGUE_PATH}")
    return 0


def check_catalogue() -> int:
    if CATALOGUE_PATH.read_text() == catalogue_source():
        return 0
    print(f"{CATALOGUE_PATH} is out of date: run python scripts/patch_catalogue.py write", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    commands = {"check": check_catalogue, "write": write_catalogue, "flags-table": print_flags_table,
                "fingerprint": print_fingerprints}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=tuple(commands))
    parser.add_argument("name", nargs="?", help="patch name for 'fingerprint'")
    args = parser.parse_args(argv)
    if (args.command == "fingerprint") != bool(args.name):
        parser.error("a patch name goes with 'fingerprint', and only there")
    return commands[args.command](*filter(None, [args.name]))


if __name__ == "__main__":
    sys.exit(main())
