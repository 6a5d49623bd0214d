"""What a chat template may call besides Jinja's own, as transformers gives it.

Templates are written for transformers' ``apply_chat_template``, whose environment trims
blocks and their leading whitespace, loads loop controls and ``{% generation %}``, and adds
``tojson`` (without Jinja's HTML escaping), ``raise_exception``, ``strftime_now``,
``namespace`` (no underscore-named attributes) and ``dict`` (without the ``dict`` type). A
template renders here byte for byte as it does there only in the same environment:
:data:`OPTIONS`, :data:`FILTERS` and :data:`GLOBALS` are its settings and helpers, which the
sandbox's metered environment (:func:`~.sandbox.environment`) is built with, and so is the
unmetered reference the budget is measured against (its tests, ``bench/template_budget.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.utils import Namespace

from llamatrain.chat_template.budget import charge

__all__ = ["FILTERS", "GLOBALS", "OPTIONS", "TemplateRefused"]


class TemplateRefused(TemplateError):
    """A template's ``raise_exception(message)``: it refuses the conversation on purpose."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRefused(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as templates expect it: Jinja's own ``tojson`` escapes ``<``, ``>`` and ``&`` for
    HTML, which would change the text the model reads."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Today's date for templates that put it in the system prompt (Llama 3.1)."""
    if isinstance(format, str):
        charge(32 * len(format))  # "%c" is 24 characters
    return datetime.now().strftime(format)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' templates use to mark
    the assistant's text for ``return_assistant_tokens_mask`` (SmolLM3's): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _Namespace(Namespace):
    """``namespace(...)`` that, as transformers', refuses underscore-named attributes (a way
    towards Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the ``dict`` type itself (whose
    attributes lead to Python internals), as transformers provides them."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


OPTIONS: Mapping[str, Any] = {
    "trim_blocks": True,
    "lstrip_blocks": True,
    "extensions": (_Generation, loopcontrols),
}
"""transformers' settings of the environment a template compiles in."""
FILTERS: Mapping[str, Any] = {"tojson": _tojson}
"""Filters transformers adds to (or puts in place of) Jinja's own."""
GLOBALS: Mapping[str, Any] = {
    "raise_exception": _raise_exception,
    "strftime_now": _strftime_now,
    "dict": _Dict(),
    "namespace": _Namespace,
}
"""The functions transformers lets a template call."""
