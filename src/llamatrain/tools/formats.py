"""Where the calls are in a reply, per format: the scanners :mod:`~llamatrain.tools.calls` uses.

Each scanner cuts a reply into its content (the text outside the calls), one :class:`Attempt`
per call written (its text, its JSON fields once read, or why they cannot be read), and the
reason llama.cpp's server would refuse the reply as a whole, if it would. The rules are what
the llama.cpp the tests pin does with each family's template (measured against its own
``common_chat_parse`` in tests/integration/test_tool_calls_llama_cpp.py):

- Hermes (Qwen 2.5, Qwen3): ``<tool_call>``, a new line, ``{"name": …, "arguments": {…}}``
  (those keys, in that order), optional whitespace, ``</tool_call>``; as many as written. Text
  may come before the first call; after a call only whitespace (else the server refuses the
  reply). A tag not followed by a new line is no call to the server: here a failed one.
- Llama 3.x: one ``{"name": …, "parameters": {…}}`` (``"type": "function"`` may come first),
  after any text that holds no ``{``, followed by whitespace only.
- ``<|python_tag|>name.call(key=json, …)`` and the generic ``{"tool_call": …}`` /
  ``{"tool_calls": [...]}`` / ``{"response": …}`` reply follow llama.cpp's per-format parsers
  of 2025 (common/chat-parser.cpp); the pinned server reads both as plain content.

Every scan is linear in the reply: each marker is searched for once, forward, and a call's
JSON is read within :data:`~llamatrain.tools.call_json.MAX_CALL_CHARS`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llamatrain.tools.arguments import json_type
from llamatrain.tools.call_json import MAX_CALL_CHARS, Problem, decoded, decoded_prefix

__all__ = [
    "MAX_CALLS",
    "Attempt",
    "Scan",
    "scan_generic",
    "scan_hermes",
    "scan_llama_3",
    "scan_llama_3_builtin",
    "split_reasoning",
]

MAX_CALLS = 64
"""The most calls read from one reply; text after them stays content."""

SHOWN_CHARS = 200
"""How much of a call's text an attempt keeps (what a failed call shows)."""


@dataclass(frozen=True)
class Attempt:
    """One call as written: its text (cut to SHOWN_CHARS), its JSON fields once read, the key
    its arguments are under; ``problem`` says why its fields could not be read, ``refuses``
    whether that makes the server refuse the reply (a call cut off short it reads as far as
    it goes, a tag without its new line it takes for text)."""

    text: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    arguments_key: str = "arguments"
    problem: str | None = None
    refuses: bool = False


@dataclass(frozen=True)
class Scan:
    """A reply cut apart: content, the calls' attempts in order, and why llama.cpp's server
    would refuse the reply whole for the text around the calls (None: it would not)."""

    content: str
    attempts: list[Attempt]
    refusal: str | None = None


def _attempt(text: str, fields: Mapping[str, Any] | None = None, **kwargs: Any) -> Attempt:
    return Attempt(text[:SHOWN_CHARS], fields or {}, **kwargs)


def _skip_spaces(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


# ---- thinking ------------------------------------------------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str, int]:
    """(the thinking of a reply that opens with ``<think>``, where the rest starts); a reply
    cut off inside its thinking is all thinking. A call written while thinking is thought."""
    at = _skip_spaces(text, 0)
    if not text.startswith(_THINK_OPEN, at):
        return "", 0
    inner = at + len(_THINK_OPEN)
    end = text.find(_THINK_CLOSE, inner)
    if end < 0:
        return text[inner:].lstrip("\n"), len(text)
    return text[inner:end].lstrip("\n"), _skip_spaces(text, end + len(_THINK_CLOSE))


# ---- Hermes: <tool_call>{…}</tool_call> ----------------------------------------------------------

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_KEYS = ["name", "arguments"]


def scan_hermes(text: str, start: int) -> Scan:
    """Every ``<tool_call>…</tool_call>`` from ``start``."""
    content, attempts, at, refusal = [], [], start, None
    while (opened := text.find(_HERMES_OPEN, at)) >= 0:
        if len(attempts) == MAX_CALLS:
            attempts.append(_too_many(text[opened:]))
            break
        if attempts and text[at:opened].strip():
            refusal = refusal or "text follows a call (the server takes text before calls only)"
        content.append(text[at:opened])
        body = opened + len(_HERMES_OPEN)
        closed = text.find(_HERMES_CLOSE, body)
        if closed < 0:
            attempts.append(_attempt(text[opened:], problem="no </tool_call> closes the call"))
            return Scan("".join(content), attempts, refusal)
        attempts.append(_hermes_call(text[body:closed], text[opened : closed + len(_HERMES_CLOSE)]))
        at = _skip_spaces(text, closed + len(_HERMES_CLOSE))
    if attempts and text[at:].strip():
        refusal = refusal or "text follows the last call (the server takes text before calls only)"
    content.append(text[at:])
    return Scan("".join(content), attempts, refusal)


def _hermes_call(body: str, text: str) -> Attempt:
    if not body.startswith("\n"):
        return _attempt(text, problem="write a new line after <tool_call>, as the template does")
    if len(body) > MAX_CALL_CHARS:
        return _attempt(text, problem=f"the call is longer than {MAX_CALL_CHARS:,} characters")
    return _object_call(decoded(body), text, [_HERMES_KEYS], "arguments")


# ---- Llama 3.x: {"name": …, "parameters": {…}} ---------------------------------------------------

_LLAMA_3_CALL = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:')
"""How a Llama 3.x call starts (llama.cpp's trigger): an object whose first key is "name"."""
_LLAMA_3_KEYS = [["name", "parameters"], ["type", "name", "parameters"]]
_BRACE_IN_TEXT = "a { in the text outside the call (the server refuses it as a broken call)"


def scan_llama_3(text: str, start: int) -> Scan:
    """One call, after text that holds no ``{``, before whitespace only."""
    found = _LLAMA_3_CALL.search(text, start)
    at = len(text) if found is None else found.start()
    before = text[start:at]
    refusal = _BRACE_IN_TEXT if "{" in before else None
    if found is None:
        return Scan(before, [], refusal)
    value = decoded_prefix(text[at : at + MAX_CALL_CHARS + 1])
    if isinstance(value, Problem):
        return Scan(before, [_object_call(value, text[at:], _LLAMA_3_KEYS, "parameters")], refusal)
    fields, end = value
    attempt = _object_call(fields, text[at : at + end], _LLAMA_3_KEYS, "parameters")
    after = text[_skip_spaces(text, at + end) :]
    if after:
        refusal = refusal or "text follows the call (the server reads one call, then nothing)"
    return Scan(before + after, [attempt], refusal)


# ---- Llama 3.1 built-ins: <|python_tag|>name.call(key=value, …) ----------------------------------

_PYTHON_TAG = "<|python_tag|>"
_BUILTIN_CALL = re.compile(r"\s*(\w+)\s*\.\s*call\(")
_BUILTIN_ARGUMENT = re.compile(r"\s*(\w+)\s*=\s*")


def scan_llama_3_builtin(text: str, start: int) -> Scan:
    """``<|python_tag|>name.call(key=value, …)`` where the reply has the tag, else as Llama 3.x."""
    tag = text.find(_PYTHON_TAG, start)
    if tag < 0:
        return scan_llama_3(text, start)
    head = _BUILTIN_CALL.match(text, tag + len(_PYTHON_TAG))
    if head is None:
        problem = "expected name.call(argument=value, ...) after <|python_tag|> (code is never run)"
        return Scan(text[start:tag], [_attempt(text[tag:], problem=problem)])
    arguments, end = _builtin_arguments(text, head.end())
    if isinstance(arguments, Problem):
        return Scan(text[start:tag], [_attempt(text[tag:], problem=arguments.why)])
    fields = {"name": head.group(1), "arguments": arguments}
    return Scan(
        text[start:tag] + text[_skip_spaces(text, end) :], [_attempt(text[tag:end], fields)]
    )


def _builtin_arguments(text: str, at: int) -> tuple[dict[str, Any] | Problem, int]:
    """The ``key=json, …)`` of a built-in call from ``at``: (arguments, the end past ``)``)."""
    arguments: dict[str, Any] = {}
    limit = at + MAX_CALL_CHARS
    while at < limit and (key := _BUILTIN_ARGUMENT.match(text, at)) is not None:
        value = decoded_prefix(text[key.end() : limit])
        if isinstance(value, Problem):
            return value, at
        arguments[key.group(1)] = value[0]
        at = _skip_spaces(text, key.end() + value[1])
        if not text.startswith(",", at):
            break
        at += 1
    if not text.startswith(")", at):
        return Problem("the built-in call does not end with ')'"), at
    return arguments, at + 1


# ---- generic: the whole reply one JSON object ----------------------------------------------------


def scan_generic(text: str, start: int) -> Scan:
    """The reply as one JSON object of ``tool_call``, ``tool_calls`` or ``response``."""
    body = text[start:].strip()
    if not body.startswith("{"):
        return Scan(text[start:], [])
    value = decoded(body)
    if isinstance(value, Problem):
        attempted = '"tool_call' in body[:SHOWN_CHARS]
        return (
            Scan("", [_attempt(body, problem=value.why)]) if attempted else Scan(text[start:], [])
        )
    if not isinstance(value, dict):
        return Scan(text[start:], [])
    if "tool_calls" in value:
        return Scan("", _generic_calls(value["tool_calls"], body))
    if "tool_call" in value:
        return Scan("", [_object_call(value["tool_call"], body, None, "arguments")])
    if "response" in value:
        response = value["response"]
        written = response if isinstance(response, str) else _indented(response)
        return Scan(written, [])
    return Scan(text[start:], [])


def _generic_calls(calls: Any, body: str) -> list[Attempt]:
    if not isinstance(calls, list):
        return [_attempt(body, problem='"tool_calls" must be a list of calls')]
    attempts = [_object_call(call, body, None, "arguments") for call in calls[:MAX_CALLS]]
    if len(calls) > MAX_CALLS:
        attempts.append(_too_many(body))
    return attempts


def _indented(value: Any) -> str:
    """A non-string ``response`` as llama.cpp writes it back: JSON indented by two."""
    return json.dumps(value, ensure_ascii=False, indent=2)


# ---- one call's JSON -----------------------------------------------------------------------------


def _object_call(value: Any, text: str, key_orders: list[list[str]] | None, key: str) -> Attempt:
    """The attempt of a call written as a JSON object (``value``, or the Problem reading it);
    ``key_orders``: the keys it must have, in one of these orders, for the pinned server to
    read it (None: any keys, a format that server does not read)."""
    server = key_orders is not None
    if isinstance(value, Problem):
        return _attempt(text, problem=value.why, refuses=server and not value.cut)
    if not isinstance(value, dict):
        problem = f"a call must be a JSON object, not {json_type(value)}"
        return _attempt(text, problem=problem, refuses=server)
    if server and list(value) not in key_orders:
        wanted = " or ".join(
            "{" + ", ".join(f'"{k}": …' for k in keys) + "}" for keys in key_orders
        )
        problem = f"write the call as {wanted}, these keys in this order and no others"
        return _attempt(text, problem=problem, refuses=True)
    if server and value.get("type", "function") != "function":
        return _attempt(text, problem='a call\'s "type" can only be "function"', refuses=True)
    return _attempt(text, value, arguments_key=key)


def _too_many(text: str) -> Attempt:
    return _attempt(
        text, problem=f"more than {MAX_CALLS} calls in one reply; the rest are not read"
    )
