"""A set ``LMCACHE_ASCEND_*`` variable that is no flag (a misspelt one) is reported, never silently ignored.

Activation warns once per process, naming the variable and the closest known names (a
warning, not an error: a flag of a newer release set across a fleet must not stop an
older engine); ``python -m lmcache_ascend.patches flags`` lists such variables too.
Every name of that namespace the project itself reads is known.
"""

from __future__ import annotations

import re
import subprocess
import sys

from lmcache_ascend import flags as flag_table
from tests.conftest import REPO_ROOT, run_fresh_python
from tests.framework.test_cli import run_cli


def test_unknown_variables_name_the_closest_flags():
    env = {
        "LMCACHE_ASCEND_BLEND_HOLE": "1",
        "LMCACHE_ASCEND_TRANSFER_BACKEND": "torch",
        "LMCACHE_ASCEND_OPS_CASES": "5",
        "LMCACHE_ASCEND_QQQQQQQQ": "",
        "LMCACHE_CHUNK_SIZE": "256",  # LMCache's own: not our namespace
    }
    unknown = flag_table.unknown_variables(env)
    assert [name for name, _ in unknown] == ["LMCACHE_ASCEND_BLEND_HOLE", "LMCACHE_ASCEND_QQQQQQQQ"]
    assert unknown[0][1][0] == "LMCACHE_ASCEND_BLEND_HOLES" and unknown[1][1] == ()
    assert flag_table.unknown_variable_text(*unknown[0]).startswith(
        "LMCACHE_ASCEND_BLEND_HOLE is not an lmcache-ascend flag and is ignored; did you mean LMCACHE_ASCEND_BLEND_HOLES"
    )
    assert "known: LMCACHE_ASCEND_AUTOLOAD, LMCACHE_ASCEND_PATCHES" in flag_table.unknown_variable_text(*unknown[1])
    assert flag_table.unknown_variables({name: "1" for name in [f.name for f in flag_table.FLAGS]}) == []


ACTIVATE_TWICE = "import lmcache_ascend\nlmcache_ascend.activate()\nlmcache_ascend.activate()\nprint('ACTIVE')\n"


def test_activation_warns_once_per_unknown_variable_and_goes_on():
    result = run_fresh_python(ACTIVATE_TWICE, env={"LMCACHE_ASCEND_SKIP_STATE_GROUP": "0"})
    assert result.returncode == 0 and "ACTIVE" in result.stdout, result.stderr
    warning = ("lmcache-ascend: LMCACHE_ASCEND_SKIP_STATE_GROUP is not an lmcache-ascend flag and is ignored; "
               "did you mean LMCACHE_ASCEND_SKIP_STATE_GROUPS")
    assert result.stderr.count(warning) == 1, result.stderr
    control = run_fresh_python(ACTIVATE_TWICE, env={"LMCACHE_ASCEND_SKIP_STATE_GROUPS": "0"})
    assert control.returncode == 0 and "not an lmcache-ascend flag" not in control.stderr, control.stderr


def test_flags_command_lists_unknown_variables():
    result = run_cli("flags", env={"LMCACHE_ASCEND_TRANSFER_BACKENDS": "torch"}, bare=True)
    assert result.returncode == 0, result.stderr
    assert "set but unknown (ignored):\nLMCACHE_ASCEND_TRANSFER_BACKENDS = torch\n" in result.stdout
    assert "did you mean LMCACHE_ASCEND_TRANSFER_BACKEND" in result.stdout
    assert "LMCACHE_ASCEND_TRANSFER_BACKEND = auto (default)" in result.stdout  # the flag itself is unset
    control = run_cli("flags", bare=True)
    assert control.returncode == 0 and "unknown" not in control.stdout


def test_every_variable_the_project_reads_is_known():
    listed = subprocess.run(["git", "ls-files", "*.py", "*.pth", "scripts/*"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    read = re.compile(r"""(?:environ\.get\(|getenv\(|environ\[|setdefault\()\s*["'](LMCACHE_ASCEND_[A-Z0-9_]+)["']""")
    names = set()
    for path in listed:
        file = REPO_ROOT / path
        if file.is_file():
            names.update(read.findall(file.read_text(errors="replace")))
    assert {"LMCACHE_ASCEND_AUTOLOAD", "LMCACHE_ASCEND_OPS_CASES", "LMCACHE_ASCEND_ENGINE_TIMEOUT"} <= names
    assert flag_table.unknown_variables({name: "1" for name in names}) == [], sys.version
