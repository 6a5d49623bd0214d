"""The layering rule: every module imports only from the layers below it.

The contract lives in pyproject.toml (``[tool.importlinter]``) and import-linter checks it
here, so an import that points upward (or closes a circle) fails the suite, not a review.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import llamatrain

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
PACKAGE = Path(llamatrain.__file__).parent


def _layered_modules() -> set[str]:
    contract = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"][0]
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def test_every_module_has_a_layer():
    """A module left out of the contract could import anything: none may be left out."""
    modules = {
        f"llamatrain.{p.stem}"
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
        or (p.is_dir() and (p / "__init__.py").is_file())
    }
    assert modules == _layered_modules()


def test_imports_point_downward():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--config", str(PYPROJECT)],
        capture_output=True,
        text=True,
        cwd=PYPROJECT.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout
