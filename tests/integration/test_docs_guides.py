"""The docs' command blocks run as written.

Every fenced block of a docs page is one of three kinds, told by its header and the line
before it:

- a **file**: a block with a title (```` ```toml title="my.toml" ````) is written, as shown, to
  that name in the page's working folder before the blocks after it run;
- **illustrative**: a block right after an ``<!-- illustrative -->`` comment (``<!--
  illustrative: why -->``) is shown, never run: it needs a GPU, a downloaded model, llama.cpp's
  programs or minutes;
- a **command**: any other ``bash`` or ``python`` block. Each page's commands run in order,
  as a reader following the page would run them, in one fresh folder (the ``bash`` blocks with
  ``set -e`` and the ``llamatrain`` of this environment on PATH), and must exit 0.

So every command block is either executed here or marked illustrative, and a TOML block that
is not illustrative must hold only real config keys. The pages whose commands take more than a
few seconds run under ``-m slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from llamatrain.config import config_reference

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
COMMAND_LANGUAGES = {"bash", "python"}
KNOWN_LANGUAGES = COMMAND_LANGUAGES | {"toml", "json", "text"}
ILLUSTRATIVE = re.compile(r"^<!-- illustrative(: .+)? -->$")
FENCE = re.compile(r'^```(?P<lang>\w*)(?: title="(?P<title>[^"]+)")?$')
FAST_PAGES = {"getting-started.md", "reference/cli.md", "reference/api.md"}
"""The pages whose commands take seconds; the guides' commands each train a small model or
more (a minute or two a page on 2 cores) and run with ``-m slow``."""


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, title (a file's name) and text."""

    page: str
    line: int
    language: str
    title: str | None
    text: str
    illustrative: bool

    @property
    def is_command(self) -> bool:
        return self.language in COMMAND_LANGUAGES and self.title is None and not self.illustrative


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``docs/<page>`` at the top level of the page, in order (the
    generated references and mkdocstrings directives hold none)."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = lines.index("```", i + 1)
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        found.append(
            Block(
                page,
                i + 1,
                opening["lang"],
                opening["title"],
                "\n".join(lines[i + 1 : end]) + "\n",
                bool(ILLUSTRATIVE.match(previous)),
            )
        )
        i = end + 1
    return found


def config_keys(table: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a parsed TOML config, sub-tables of ``train.reward_args`` as one."""
    keys = []
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and key != "train.reward_args":
            keys += config_keys(value, f"{key}.")
        else:
            keys.append(key)
    return keys


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_a_file_a_command_or_illustrative(page):
    text = (DOCS / page).read_text(encoding="utf-8")
    nested = re.search(r"^[ \t>]+```", text, flags=re.MULTILINE)
    assert not nested, (
        f"docs/{page}: a fenced block inside a list or admonition escapes these checks"
    )
    known = {key for key, _default, _help in config_reference()}
    for block in blocks(page):
        where = f"docs/{page}:{block.line}"
        assert block.language in KNOWN_LANGUAGES, f"{where}: give the block a known language"
        if block.language in COMMAND_LANGUAGES and block.title is None:
            continue  # a command: run by test_page_commands_run, or marked illustrative
        if block.language == "toml" and not block.illustrative:
            unknown = [k for k in config_keys(tomllib.loads(block.text)) if k not in known]
            assert not unknown, f"{where}: not config keys: {unknown}"


def test_the_convention_finds_blocks_of_each_kind():
    kinds = [b for page in PAGES for b in blocks(page)]
    assert any(b.is_command for b in kinds)
    assert any(b.illustrative for b in kinds)
    assert any(b.title for b in kinds)
    assert set(PAGES) >= FAST_PAGES


def run_block(block: Block, folder: Path, env: dict[str, str]) -> None:
    """Run one command block in ``folder``; a failure shows the block and its output."""
    if block.language == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    else:
        argv = [sys.executable, "-c", block.text]
    done = subprocess.run(
        argv, cwd=folder, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, (
        f"docs/{block.page}:{block.line} failed ({done.returncode}):\n{block.text}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )


def page_params() -> list:
    """Every page with command blocks; the slow ones marked."""
    params = []
    for page in PAGES:
        if any(b.is_command for b in blocks(page)):
            marks = () if page in FAST_PAGES else (pytest.mark.slow,)
            params.append(pytest.param(page, marks=marks, id=page))
    return params


@pytest.mark.parametrize("page", page_params())
def test_page_commands_run(page, tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
    }
    for block in blocks(page):
        if block.title is not None and not block.illustrative:
            (tmp_path / block.title).write_text(block.text, encoding="utf-8")
        elif block.is_command:
            run_block(block, tmp_path, env)
