"""JSON from a data file's text: what Python's ``json`` cannot hold is one DataError line.

A JSONL line (or a table's ``tools`` string) is untrusted text. ``json.loads`` turns three
kinds of it into something other than a ``JSONDecodeError``: nesting deeper than the
interpreter's recursion limit (``RecursionError``), an integer of more than 4,300 digits
(``ValueError``), and a ``\\ud800`` escape, which it accepts as a lone surrogate that is no
character, so the tokenizer fails on it much later (``UnicodeEncodeError``). Each is refused
here, as the line's problem, so ``data.on_bad_line`` can skip it like any other bad line.

So is a line whose values would not fit in memory: a line of many small values takes up to
~20 bytes of Python objects a character (a 100 MB line of short messages, about 1 GB), where
one long string takes one. Lines past a few MB are measured first (:func:`parsed_bytes`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llamatrain.errors import DataError, shown

__all__ = ["MAX_PARSED_BYTES", "load_json", "parsed_bytes"]

MAX_PARSED_BYTES = 1 << 28
"""The most memory one line's parsed values may take (estimated by :func:`parsed_bytes`)."""

_BYTES_PER_VALUE = 80
"""An upper bound of what one JSON value costs in Python beyond its characters (a dict entry
~50 bytes, an empty list 56 and its slot 8, a float 24 + 8)."""
_MOST_BYTES_PER_CHAR = 20
"""What any JSON text can cost a character (``[[],[],…]``: 64 bytes per 3 characters)."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
"""A ``\\uD800``–``\\uDFFF`` escape: the only way a surrogate gets into parsed JSON text
(read as UTF-8, the text itself holds none). A pair of them is a character; one alone is not."""


def load_json(text: str) -> Any:
    """``json.loads(text)``; DataError (one line, no location) for text that is not JSON or
    holds what no Python value or training text can."""
    size = parsed_bytes(text)
    if size > MAX_PARSED_BYTES:
        raise DataError(
            f"a line of {len(text):,} characters whose values would take ~{size >> 20:,} MB "
            f"in memory (at most {MAX_PARSED_BYTES >> 20} MB are read); split it into smaller "
            "lines"
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(
            "JSON that nests deeper than Python can read (thousands of [ or {); no example "
            "nests like that, so the line is broken"
        ) from None
    except ValueError as e:  # an integer past sys.get_int_max_str_digits()
        raise DataError(f"a JSON value Python cannot read ({shown(str(e))})") from None
    if _SURROGATE_ESCAPE.search(text):
        _check_no_lone_surrogate(value)
    return value


def parsed_bytes(text: str) -> int:
    """An upper estimate of the memory ``json.loads(text)`` takes: its characters, and
    :data:`_BYTES_PER_VALUE` for each value (at most one per ``,``, ``:``, ``[`` and ``{``,
    which also counts those inside strings: an overestimate, made only where it can matter);
    0 for text too short to come near :data:`MAX_PARSED_BYTES`."""
    if len(text) * _MOST_BYTES_PER_CHAR <= MAX_PARSED_BYTES:
        return 0
    return len(text) + _BYTES_PER_VALUE * sum(text.count(c) for c in ",:[{")


def _check_no_lone_surrogate(value: Any) -> None:
    """DataError for the first string (key or value) holding a lone surrogate; walked with a
    stack, not recursion, as the value may nest as deep as ``json`` allows."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(
                    f"a string holding a lone surrogate ({shown(item[e.start])}, half of a "
                    "UTF-16 pair), which is not a character; fix the line's \\u escapes"
                ) from None
