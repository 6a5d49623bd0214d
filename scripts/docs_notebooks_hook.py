"""mkdocs hook: the example notebooks (``examples/*.ipynb``) become pages of the docs site.

The notebooks stay where users find them, in ``examples/``, and are committed without outputs
(tests/integration/test_notebooks.py). This hook adds whichever notebooks are there at build
time as pages at their own path (``examples/<name>.ipynb``), after the hand-written
``docs/examples/index.md`` in the "Notebooks" section of the nav, so a new notebook needs no
edit here or in ``mkdocs.yml``.
mkdocs-jupyter then executes and renders them; they run in their seconds-long version
(``LLAMATRAIN_QUICK=1``, unless the environment says otherwise). A notebook writes its runs
under ``runs/`` beside itself (as it does for a user), and mkdocs-jupyter executes it in its
own folder: so each build reads copies of the notebooks in a scratch folder, removed after
the build, and never writes into the checkout.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SECTION = "Notebooks"


def notebooks() -> list[Path]:
    """The example notebooks, in name order."""
    return sorted(EXAMPLES.glob("*.ipynb"))


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Run the notebooks quickly and list them in the nav's Notebooks section."""
    os.environ.setdefault("LLAMATRAIN_QUICK", "1")  # the executing kernel inherits it
    section = next(entry[SECTION] for entry in config.nav if SECTION in entry)
    section += [path.relative_to(REPO).as_posix() for path in notebooks()]
    return config


_scratch: list[Path] = []
"""This build's scratch folder, which holds the notebooks' copies and their runs."""


@event_priority(50)  # before mkdocs-jupyter's on_files turns .ipynb files into its pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add each notebook as a page read from its copy in a scratch folder (mkdocs-jupyter's
    pages need a real source folder, which generated files lack; it executes a notebook
    there, so its runs land in the scratch folder, not in ``examples/``)."""
    scratch = Path(tempfile.mkdtemp(prefix="llamatrain-docs-"))
    _scratch.append(scratch)
    for path in notebooks():
        uri = path.relative_to(REPO).as_posix()
        (scratch / uri).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, scratch / uri)
        files.append(File(uri, str(scratch), config.site_dir, config.use_directory_urls))
    return files


def on_post_build(config: MkDocsConfig | None) -> None:
    """Remove the scratch folders of this build (and of any before it in this process)."""
    while _scratch:
        shutil.rmtree(_scratch.pop(), ignore_errors=True)


def on_build_error(error: Exception) -> None:
    """A failed build removes its scratch folder too."""
    on_post_build(None)
