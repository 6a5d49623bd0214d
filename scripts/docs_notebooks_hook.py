"""mkdocs hook: the example notebooks (``examples/*.ipynb``) become pages of the docs site.

The notebooks stay where users find them, in ``examples/``, and are committed without outputs
(tests/integration/test_notebooks.py). This hook adds whichever notebooks are there at build
time as pages at their own path (``examples/<name>.ipynb``), after the hand-written
``docs/examples/index.md`` in the "Notebooks" section of the nav, so a new notebook needs no
edit here or in ``mkdocs.yml``.
mkdocs-jupyter then executes and renders them; they run in their seconds-long version
(``LLAMATRAIN_QUICK=1``, unless the environment says otherwise), which writes nothing beside
them.
"""

from __future__ import annotations

import os
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


@event_priority(50)  # before mkdocs-jupyter's on_files turns .ipynb files into its pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add each notebook as a page read where it is (a file of the repository, not of docs/:
    mkdocs-jupyter's pages need a real source folder, which generated files lack)."""
    for path in notebooks():
        uri = path.relative_to(REPO).as_posix()
        files.append(File(uri, str(REPO), config.site_dir, config.use_directory_urls))
    return files
