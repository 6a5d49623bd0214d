"""JSON a model wrote in a tool call, read as data: strictly, and within bounds.

Python's ``json`` reads ``NaN`` and ``Infinity`` (no JSON has them, and llama.cpp refuses them),
turns ``1e999`` into infinity and ``"\\ud800"`` into a lone surrogate (no character: it breaks
the tokenizer when the call is rendered back), and has no bound of its own on size or nesting
(past the interpreter's recursion limit it raises ``RecursionError``). Each of these is refused
here as a :class:`Problem` — a value, not an exception, since what a model writes is never an
error of the run: a call is read only within :data:`MAX_CALL_CHARS` characters and
:data:`MAX_NESTING` levels of arrays and objects.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llamatrain.errors import shown

__all__ = ["MAX_CALL_CHARS", "MAX_NESTING", "Problem", "decoded", "decoded_prefix"]

MAX_CALL_CHARS = 1 << 18
"""The longest call read (262,144 characters, ~65k tokens); a longer one is a failed call."""

MAX_NESTING = 32
"""The deepest nesting of arrays and objects a call's JSON may have."""


@dataclass(frozen=True)
class Problem:
    """Why a text is not a JSON value that may be used, in one line; ``cut``: the text ends
    (or is cut at MAX_CALL_CHARS) before the value does, rather than being wrong."""

    why: str
    cut: bool = False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is too large for a number")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
"""Strict JSON: ``NaN``, ``Infinity`` and numbers past a float's range are refused."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
"""A ``\\uD800``–``\\uDFFF`` escape: the only way a surrogate gets into parsed text."""


def decoded(text: str) -> Any:
    """``text`` (stripped) as one JSON value, or the Problem with it."""
    found = decoded_prefix(text.strip(), whole=True)
    return found if isinstance(found, Problem) else found[0]


def decoded_prefix(text: str, whole: bool = False) -> tuple[Any, int] | Problem:
    """(the JSON value ``text`` starts with, the index where it ends), or the Problem; ``whole``:
    nothing but whitespace may follow it."""
    window = text[:MAX_CALL_CHARS]
    try:
        value, end = _DECODER.raw_decode(window)
    except json.JSONDecodeError as e:
        if len(text) > MAX_CALL_CHARS:
            return Problem(f"the call is longer than {MAX_CALL_CHARS:,} characters", cut=True)
        ended = e.pos >= len(window.rstrip()) or e.msg.startswith("Unterminated string")
        return Problem(f"not valid JSON: {e.msg} at character {e.pos}", cut=ended)
    except RecursionError:
        return Problem(f"the JSON nests deeper than {MAX_NESTING} levels")
    except ValueError as e:  # a constant or number refused above, or too many digits
        return Problem(f"not valid JSON: {shown(str(e), 80)}")
    if whole and text[end:].strip():
        return Problem(f"not valid JSON: text follows the value at character {end}")
    if _nesting(value) > MAX_NESTING:
        return Problem(f"the JSON nests deeper than {MAX_NESTING} levels")
    if _SURROGATE_ESCAPE.search(window, 0, end) and _has_lone_surrogate(value):
        return Problem("the JSON holds a lone surrogate (a \\uD800-\\uDFFF escape alone)")
    return value, end


def _nesting(value: Any) -> int:
    """How deep arrays and objects nest in ``value``, counted up to MAX_NESTING + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
