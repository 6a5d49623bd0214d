"""A generated block inside a hand-written docs page: find it, replace it, check it is current.

The config and CLI references are rendered from the code (``gen_config_reference.py``,
``gen_cli_reference.py``) into pages whose prose stays hand-written, between the markers
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. This one module owns the markers and the
``--check`` / rewrite command line both generators share, so the suite's staleness tests
(``tests/unit/test_docs.py``) and ``make docs`` check the two references the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of the block called ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def block(text: str, name: str) -> str:
    """What stands between the markers of ``name`` in ``text`` (without the markers)."""
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise SystemExit(f"the page must contain {start} and {end} exactly once each")
    return text.split(start, 1)[1].split(end, 1)[0]


def with_block(text: str, name: str, body: str) -> str:
    """``text`` with the block called ``name`` replaced by ``body``."""
    start, end = markers(name)
    block(text, name)  # both markers present, once each
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main(name: str, render: Callable[[], str], page: Path, argv: list[str] | None) -> int:
    """Rewrite the block ``name`` of ``page`` with ``render()``, or with ``--check`` exit 1
    when it is stale (naming the command that fixes it)."""
    parser = argparse.ArgumentParser(description=f"Regenerate the {name} block of {page.name}")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--page", type=Path, default=page, help=f"default: {page}")
    args = parser.parse_args(argv)
    current = args.page.read_text(encoding="utf-8")
    wanted = with_block(current, name, render())
    script = f"scripts/gen_{name.replace('-', '_')}.py"  # each block's generator is named so
    if args.check:
        if current != wanted:
            print(f"{args.page}: {name} is out of date; run python {script}", file=sys.stderr)
            return 1
        print(f"{args.page}: {name} is up to date")
        return 0
    if current != wanted:
        args.page.write_text(wanted, encoding="utf-8")
        print(f"rewrote the {name} in {args.page}")
    else:
        print(f"{args.page}: already up to date")
    return 0
