"""The docs site builds as ``make docs`` builds it: ``mkdocs build --strict`` (a broken link,
a missing anchor, a page left out of the nav or a docstring mkdocstrings cannot render fails
it), the example notebooks executed in their seconds-long version and rendered with their
outputs, the API and ops pages rendered from the docstrings. One build, shared by the checks;
most of its time is the notebooks' kernels, so the default suite checks what they compute
here, from the SUMMARY lines the pages show (tests/notebook_checks.py; the slow
tests/integration/test_notebooks.py runs each again from a folder of its own)."""

from __future__ import annotations

import html as html_lib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mkdocs.config import load_config
from notebook_checks import CHECKS

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "examples").glob("*.ipynb"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built strictly into a temporary folder (the checkout's site/ is left alone)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "LLAMATRAIN_QUICK": "1", "NO_MKDOCS_2_WARNING": "1"}
    env.pop("LLAMATRAIN_DOCS_EXECUTE", None)  # executed, as make docs does
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    problems = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not problems, done.stderr[-4000:]
    return out


def nav_pages(entries) -> list[str]:
    """Every Markdown page the nav of mkdocs.yml lists, in order."""
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def built(site: Path, page: str) -> str:
    """The HTML a docs page (``guides/lora-chat.md``) was built into."""
    stem = page.removesuffix(".md").removesuffix(".ipynb")
    path = site / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")
    return path.read_text(encoding="utf-8")


def test_every_page_of_the_nav_is_built(site):
    pages = nav_pages(load_config(str(REPO / "mkdocs.yml"))["nav"])
    assert "getting-started.md" in pages and "reference/config.md" in pages
    for page in pages:
        html = built(site, page)
        assert "<h1" in html, page
        assert "\\|" not in html, f"{page}: a table's code span shows its escaped pipe"
    in_docs = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert in_docs <= set(pages), f"pages missing from the nav: {sorted(in_docs - set(pages))}"


def rendered_summary(html: str, name: str) -> dict:
    """The notebook's ``SUMMARY {json}`` line as the page shows it (one line of its last
    cell's output, HTML-escaped)."""
    lines = re.findall(r"^SUMMARY (\{.*\})$", html_lib.unescape(html), flags=re.MULTILINE)
    assert lines, f"{name}: its SUMMARY output is missing"
    return json.loads(lines[-1])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_rendered_with_their_outputs_and_pass_their_checks(site, path):
    """The build executed each notebook (quick version): its page shows the outputs, and its
    SUMMARY passes the checks tests/integration/test_notebooks.py applies (which, slow,
    executes each again from a folder of its own)."""
    html = built(site, f"examples/{path.name}")
    assert "jp-OutputArea-output" in html
    CHECKS[path.name](rendered_summary(html, path.name))
    assert (site / "examples" / path.stem / path.name).is_file()  # offered for download


def test_notebooks_section_lists_every_notebook(site):
    home = built(site, "index.md")
    for path in NOTEBOOKS:
        assert f'href="examples/{path.stem}/"' in home, path.name


def test_api_and_ops_pages_render_the_docstrings(site):
    from llamatrain import api, ops

    html = built(site, "reference/api.md")
    for name in ("fit", "load", "export_gguf", "FitResult"):
        assert f'id="llamatrain.api.{name}"' in html, name
    assert api.fit.__doc__.split(".")[0].split()[-1] in html
    assert ":func:" not in html and ":class:" not in html  # Sphinx roles shown as plain code
    html = built(site, "reference/ops.md")
    for name in ("norm.rms_norm", "rope.rope", "attention.flash_attn", "matmul.mul_mat"):
        assert f'id="llamatrain.ops.{name}"' in html, name
    assert ops.rms_norm.__doc__.split()[0] in html


def test_generated_references_are_on_the_site(site):
    assert "<code>train.n_batch</code>" in built(site, "reference/config.md")
    assert "<code>--resume PATH|latest</code>" in built(site, "reference/cli.md")
