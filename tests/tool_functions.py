"""Tool functions the tool tests share, for any test module: ``from tool_functions import lookup``.

Written as a user writes a tool for TRL (type hints, a Google-style docstring), with what the
parsers and the argument checks have to handle: numbers, an integer, a string of enumerated
choices, an optional list, and a name Llama 3.1 treats as a built-in. A module beside the top
``conftest.py``, whose folder pytest puts on ``sys.path``.
"""

from __future__ import annotations


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def lookup(word: str, limit: int = 3, lang: str = "en", tags: list[str] | None = None) -> str:
    """Look a word up.

    Args:
        word: The word.
        limit: How many senses.
        lang: The language (choices: ["en", "fr"])
        tags: Tags to filter by.
    """
    return word


def brave_search(query: str) -> str:
    """Search the web.

    Args:
        query: The query.
    """
    return query
