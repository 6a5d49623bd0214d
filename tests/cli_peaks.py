"""The CLI run in a child process, and its peak resident memory: for any test module that
bounds what a command costs (``from cli_peaks import run_child``).

A child process, so the figure is the command's own, not the test process's (which holds
whatever the tests before it loaded); ``VmHWM`` counts every page the process touched,
a mapped file's pages included, as a machine's memory must hold them. A module beside the
top ``conftest.py``, whose folder pytest puts on ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import sys
from llamatrain.cli import main
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
print("VmHWM", int(status.split("VmHWM:")[1].split()[0]) * 1024, file=sys.stderr)
sys.exit(code)
"""


def run_child(*args: str) -> int:
    """Run ``llamatrain *args`` in a child; its peak RSS in bytes (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=3600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stderr.rsplit("VmHWM", 1)[1].split()[0])
