"""Which modules a piece of code imports, for any test module: ``from loaded_modules import
loaded_after``.

Importing a module costs memory for the rest of the process (torch._dynamo 72 MB, FSDP 42 MB);
tests that keep such imports out of a run check it in a fresh interpreter, where nothing else
has imported them first. A module beside the top ``conftest.py``, whose folder pytest puts on
``sys.path``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable


def loaded_after(code: str, modules: Iterable[str]) -> list[str]:
    """The ones of ``modules`` that a fresh Python has imported after running ``code``."""
    check = (
        f"\nimport json, sys\nprint(json.dumps([m for m in {list(modules)!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
