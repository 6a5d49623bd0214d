"""``llamatrain``'s own entry points (``API``) agree with ``llamatrain.api`` and the docs.

``llamatrain/__init__.py`` keeps the one list of the ``llamatrain.api`` functions it offers,
loaded on first use so that ``import llamatrain`` stays light; these checks keep that list, the
module's ``__all__`` and the calls README.md and the docs pages (docs/) document from drifting
apart.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import llamatrain
from llamatrain import api

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def documented_names() -> set[str]:
    """What README.md and the docs pages call as ``llamatrain.<name>(...)`` or import with
    ``from llamatrain import ...`` (``llamatrain.<submodule>.<name>`` are not counted)."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in DOCUMENTS)
    names = set(re.findall(r"\bllamatrain\.(\w+)\(", text))
    for imported in re.findall(r"^from llamatrain import (.+)$", text, flags=re.MULTILINE):
        names.update(name.strip() for name in imported.split("#")[0].split(","))
    return names


def test_the_package_offers_exactly_the_api_modules_public_names():
    assert sorted(llamatrain.API) == sorted(api.__all__)


def test_every_entry_point_offered_is_in_api_all():
    missing = [name for name in llamatrain.API if not hasattr(api, name)]
    assert not missing, f"llamatrain offers names llamatrain.api does not define: {missing}"
    unlisted = [name for name in llamatrain.API if name not in api.__all__]
    assert not unlisted, f"llamatrain offers names missing from llamatrain.api.__all__: {unlisted}"
    for name in llamatrain.API:
        assert getattr(llamatrain, name) is getattr(api, name)
        assert name in llamatrain.__all__


def test_every_documented_call_is_offered():
    documented = documented_names()
    assert {"fit", "load", "chat", "Llama"} <= documented  # the docs' examples were found
    not_offered = sorted(name for name in documented if name not in llamatrain.__all__)
    assert not not_offered, f"the docs call llamatrain.{not_offered} but llamatrain lacks them"
    for name in documented:
        assert getattr(llamatrain, name) is not None


def test_unknown_names_are_attribute_errors():
    assert not hasattr(llamatrain, "no_such_entry_point")


def test_import_llamatrain_does_not_load_the_api():
    code = "import sys, llamatrain; print('llamatrain.api' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
