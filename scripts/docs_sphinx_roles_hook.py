"""mkdocs hook: the Sphinx roles of our docstrings (``:func:`load```) shown as plain code.

The docstrings cross-reference with Sphinx roles, which read well in the source and in
``help()``; mkdocstrings renders the backticked part as code but leaves the role's name in
front of it (``:func:load``). This hook drops the role names from the rendered pages, so the
API and ops references read as the docstrings mean them.
"""

from __future__ import annotations

import re

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|attr|mod|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """The page's HTML without role names before code spans."""
    return ROLE.sub("", html)
