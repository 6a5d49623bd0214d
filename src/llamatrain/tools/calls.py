"""Tool calls in a model's reply, found the way llama.cpp's server finds them, as data.

A GRPO rollout hands each sampled reply here: the calls it holds come back in the order written
as :class:`ToolCall` (name, arguments as a dict, id) or, when a call cannot run,
:class:`FailedCall` (unparseable, an unknown tool, arguments its schema refuses), beside the
reply's text outside the calls (``content``) and its thinking (``reasoning``). Nothing the model
wrote is ever evaluated: a call is JSON parsed as data (Python's ``json``, no ``NaN`` or
``Infinity``), its arguments checked against the tool's schema
(:func:`~llamatrain.tools.arguments.argument_problem`). Hostile text — a truncated call, nested
tags, megabytes of arguments, JSON nested thousands deep, a tool that does not exist — ends as a
failed call: the scan is linear in the text (each marker is searched for once, forward), a call
is read only within :data:`MAX_CALL_CHARS`, nesting is bounded by :data:`MAX_NESTING` and a
reply by :data:`MAX_CALLS`.

The formats follow llama.cpp's ``common/chat.cpp`` (its per-format parsers, before the
template-derived parser of late 2025), chosen by :func:`call_format` from the chat template's
source as llama.cpp chooses them:

- ``HERMES`` (Qwen 2.5, Qwen3, SmolLM3, Hermes 2/3: the template holds ``<tool_call>``): each
  call is ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, anywhere in the reply, as
  many as written; whitespace after a call is dropped from the content.
- ``LLAMA_3`` (Llama 3.1–3.3: the template has an ``ipython`` role): one call, the reply's
  start, ``{"name": …, "parameters": {…}}`` (optionally ``"type": "function"`` first); what
  follows is content.
- ``LLAMA_3_BUILTIN`` (the template knows ``<|python_tag|>`` and a tool bears a built-in's name:
  ``brave_search``, ``code_interpreter`` …): also ``<|python_tag|>name.call(key=json, …)``.
  Raw code after the tag is a failed call: it is never run.
- ``GENERIC`` (any other template): the whole reply is one JSON object —
  ``{"tool_call": {"name", "arguments"}}``, ``{"tool_calls": [...]}`` or ``{"response": …}``
  (its text is the content), as llama.cpp's generic format asks the model for in a system
  message.

HERMES and the LLAMA_3 forms first take a leading ``<think>…</think>`` as reasoning (a call
written inside it is thought, not made), as llama.cpp does.

Only the form the template teaches is a call. llama.cpp's older Hermes parser also took
``<function=…>`` tags, fenced or bare JSON; the llama.cpp the tests pin derives its parser
from the template, and a model trained on looser forms would write calls its server ignores.
Ids: llama.cpp leaves them empty for these formats (its server makes random ones); here a
call's id is the ``id`` a generic call carries, else ``call_<k>``, k its place in the reply.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamatrain.errors import ConfigError, shown
from llamatrain.tools.arguments import argument_problem, json_type

__all__ = [
    "MAX_CALLS",
    "MAX_CALL_CHARS",
    "MAX_NESTING",
    "CallFormat",
    "FailedCall",
    "Reply",
    "ToolCall",
    "call_format",
    "parse_reply",
]

MAX_CALL_CHARS = 1 << 18
"""The longest call read (262,144 characters, ~65k tokens); a longer one is a failed call."""

MAX_NESTING = 32
"""The deepest nesting of arrays and objects a call's JSON may have."""

MAX_CALLS = 64
"""The most calls read from one reply; text after them stays content."""

SHOWN_CHARS = 200
"""How much of a failed call's text :attr:`FailedCall.text` keeps."""

UNPARSEABLE = "unparseable"
UNKNOWN_TOOL = "unknown_tool"
WRONG_ARGUMENTS = "wrong_arguments"


class CallFormat(enum.Enum):
    """How a model writes tool calls; the values are llama.cpp's names of the formats."""

    HERMES = "Hermes 2 Pro"
    LLAMA_3 = "Llama 3.x"
    LLAMA_3_BUILTIN = "Llama 3.x with builtin tools"
    GENERIC = "Generic"


LLAMA_3_BUILTINS = ("wolfram_alpha", "web_search", "brave_search", "python", "code_interpreter")
"""Tool names Llama 3.1's template calls through ``<|python_tag|>`` (llama.cpp's list)."""


@dataclass(frozen=True)
class ToolCall:
    """A call that may run: a known tool, arguments its schema accepts."""

    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class FailedCall:
    """A call that cannot run: ``kind`` is ``unparseable``, ``unknown_tool`` or
    ``wrong_arguments``; ``error`` says why in one line (what the model is told); ``name``
    the tool it named, if it named one; ``text`` the start of what it wrote."""

    kind: str
    error: str
    name: str | None = None
    text: str = ""


@dataclass(frozen=True)
class Reply:
    """A reply taken apart: its text outside the calls, its thinking, its calls in order."""

    content: str
    reasoning: str = ""
    calls: tuple[ToolCall | FailedCall, ...] = ()

    @property
    def valid(self) -> list[ToolCall]:
        return [call for call in self.calls if isinstance(call, ToolCall)]

    @property
    def failed(self) -> list[FailedCall]:
        return [call for call in self.calls if isinstance(call, FailedCall)]


def call_format(template: str, tool_names: Iterable[str] = ()) -> CallFormat:
    """The format a model whose chat template has the source ``template`` writes calls in,
    found by the markers llama.cpp looks for; ``tool_names`` decide whether Llama 3.1's
    built-in form is on. ConfigError for Qwen3-Coder's XML arguments, which are not parsed."""
    if "<tool_call>" in template:
        if "<function=" in template and "<parameter=" in template:
            raise ConfigError(
                "the chat template writes tool calls as XML parameters (Qwen3-Coder's "
                "<function=…><parameter=…> form), which llamatrain does not parse; use a "
                "template whose calls are JSON (<tool_call>{...}</tool_call>)"
            )
        return CallFormat.HERMES
    if "<|start_header_id|>ipython<|end_header_id|>" in template:
        builtin = any(name in LLAMA_3_BUILTINS for name in tool_names)
        if builtin and "<|python_tag|>" in template:
            return CallFormat.LLAMA_3_BUILTIN
        return CallFormat.LLAMA_3
    return CallFormat.GENERIC


def parse_reply(text: str, fmt: CallFormat, tools: Sequence[Mapping[str, Any]]) -> Reply:
    """``text`` (a decoded reply) taken apart in format ``fmt``; ``tools`` are the tools'
    schemas (:func:`~llamatrain.tools.schema.json_schema`'s, or their ``function`` part),
    against which names and arguments are checked. Never raises on what the model wrote."""
    parameters = _parameters_by_name(tools)
    reasoning, start = ("", 0) if fmt is CallFormat.GENERIC else _reasoning(text)
    content, attempts = _FORMATS[fmt](text, start)
    calls = tuple(_checked(attempt, k, parameters) for k, attempt in enumerate(attempts))
    return Reply(content, reasoning, calls)


def _parameters_by_name(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    functions = [tool.get("function", tool) for tool in tools]
    return {f["name"]: f.get("parameters", {}) for f in functions}


# ---- what one call holds, before it is checked ---------------------------------------------------


@dataclass(frozen=True)
class _Attempt:
    """What the model wrote for one call: its text, and its fields once parsed (``problem``
    says why they could not be)."""

    text: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    arguments_key: str = "arguments"
    problem: str | None = None


def _checked(attempt: _Attempt, k: int, parameters: Mapping[str, Any]) -> ToolCall | FailedCall:
    """The attempt as a call that may run, or as the first reason it may not."""
    text = attempt.text[:SHOWN_CHARS]
    if attempt.problem is not None:
        return FailedCall(UNPARSEABLE, attempt.problem, text=text)
    name = attempt.fields.get("name")
    if not isinstance(name, str) or not name:
        return FailedCall(UNPARSEABLE, 'the call has no "name" string', text=text)
    if name not in parameters:
        known = shown(", ".join(map(repr, parameters)), 200) or "none"
        error = f"there is no tool named {shown(name, 80)!r} (the tools are {known})"
        return FailedCall(UNKNOWN_TOOL, error, name, text)
    arguments = _arguments(attempt)
    if isinstance(arguments, str):
        return FailedCall(UNPARSEABLE, arguments, name, text)
    problem = argument_problem(arguments, parameters[name])
    if problem is not None:
        return FailedCall(WRONG_ARGUMENTS, f"{name}: {problem}", name, text)
    given_id = attempt.fields.get("id")
    return ToolCall(
        name, arguments, given_id if isinstance(given_id, str) and given_id else f"call_{k}"
    )


def _arguments(attempt: _Attempt) -> dict[str, Any] | str:
    """The call's arguments as a dict (a JSON object, or a string holding one, as OpenAI's
    API writes them; none given: no arguments), or why they are not one."""
    key = attempt.arguments_key
    value = attempt.fields.get(key, {})
    if isinstance(value, str):
        value = _decoded(value)
        if isinstance(value, _Problem):
            return f'"{key}" is a string that is not JSON ({value.why})'
    if not isinstance(value, dict):
        return f'"{key}" must be a JSON object of the arguments, not {json_type(value)}'
    return value


# ---- bounded JSON --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    why: str


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


def _decoded(text: str) -> Any:
    """``text`` (stripped) as one JSON value, or the _Problem with it."""
    found = _decoded_prefix(text.strip(), whole=True)
    return found if isinstance(found, _Problem) else found[0]


def _decoded_prefix(text: str, whole: bool = False) -> tuple[Any, int] | _Problem:
    """(the JSON value ``text`` starts with, where it ends), read within MAX_CALL_CHARS and
    MAX_NESTING, holding no lone surrogate; ``whole``: nothing may follow it."""
    window = text[:MAX_CALL_CHARS]
    try:
        value, end = _DECODER.raw_decode(window)
    except json.JSONDecodeError as e:
        if len(text) > MAX_CALL_CHARS:
            return _Problem(f"the call is longer than {MAX_CALL_CHARS:,} characters")
        return _Problem(f"not valid JSON: {e.msg} at character {e.pos}")
    except RecursionError:
        return _Problem(f"the JSON nests deeper than {MAX_NESTING} levels")
    except ValueError as e:  # a constant or number refused above, or too many digits
        return _Problem(f"not valid JSON: {shown(str(e), 80)}")
    if whole and text[end:].strip():
        return _Problem(f"not valid JSON: text follows the value at character {end}")
    if _nesting(value) > MAX_NESTING:
        return _Problem(f"the JSON nests deeper than {MAX_NESTING} levels")
    if _SURROGATE_ESCAPE.search(window, 0, end) and _has_lone_surrogate(value):
        return _Problem(
            "the JSON holds a lone surrogate (a \\uD800-\\uDFFF escape alone), no character"
        )
    return value, end


def _nesting(value: Any) -> int:
    """How deep arrays and objects nest in ``value``, counted up to MAX_NESTING + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---- the formats ---------------------------------------------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"

_LLAMA_3_CALL = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:')
"""How a Llama 3.x call starts (llama.cpp's trigger): an object whose first key is "name"."""

_BUILTIN_CALL = re.compile(r"\s*(\w+)\s*\.\s*call\(")
_BUILTIN_ARGUMENT = re.compile(r"\s*(\w+)\s*=\s*")

_Parsed = tuple[str, list[_Attempt]]
"""(content, the calls' attempts) of one reply."""


def _reasoning(text: str) -> tuple[str, int]:
    """(the thinking of a reply that opens with ``<think>``, where the rest starts); a reply
    cut off inside its thinking is all thinking."""
    at = _skip_spaces(text, 0)
    if not text.startswith(_THINK_OPEN, at):
        return "", 0
    end = text.find(_THINK_CLOSE, at + len(_THINK_OPEN))
    if end < 0:
        return text[at + len(_THINK_OPEN) :].strip(), len(text)
    return text[at + len(_THINK_OPEN) : end].strip(), _skip_spaces(text, end + len(_THINK_CLOSE))


def _skip_spaces(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _hermes(text: str, start: int) -> _Parsed:
    """Every ``<tool_call>…</tool_call>``; the text between them is content."""
    content, attempts, at = [], [], start
    while (opened := text.find(_HERMES_OPEN, at)) >= 0:
        if len(attempts) == MAX_CALLS:
            attempts.append(_too_many(text[opened:]))
            break
        content.append(text[at:opened])
        body = opened + len(_HERMES_OPEN)
        closed = text.find(_HERMES_CLOSE, body)
        if closed < 0:
            attempts.append(_Attempt(text[opened:], problem="no </tool_call> closes the call"))
            return "".join(content), attempts
        attempts.append(_json_object(text[body:closed], text[opened:closed], "arguments"))
        at = _skip_spaces(text, closed + len(_HERMES_CLOSE))
    content.append(text[at:])
    return "".join(content), attempts


def _llama_3(text: str, start: int) -> _Parsed:
    """A call at the reply's start, the rest content."""
    at = _skip_spaces(text, start)
    if not _LLAMA_3_CALL.match(text, at):
        return text[start:], []
    found = _decoded_prefix(text[at:])
    if isinstance(found, _Problem):
        return "", [_Attempt(text[at:], problem=found.why)]
    value, end = found
    attempt = _Attempt(text[at : at + end], value, "parameters")
    if "parameters" not in value:
        attempt = _Attempt(
            attempt.text, problem='a Llama 3.x call gives its arguments as "parameters"'
        )
    return text[_skip_spaces(text, at + end) :], [attempt]


def _llama_3_builtin(text: str, start: int) -> _Parsed:
    """``<|python_tag|>name.call(key=value, …)`` where the reply has the tag, else as LLAMA_3."""
    tag = text.find(_PYTHON_TAG, start)
    if tag < 0:
        return _llama_3(text, start)
    at = tag + len(_PYTHON_TAG)
    head = _BUILTIN_CALL.match(text, at)
    if head is None:
        problem = "expected name.call(argument=value, ...) after <|python_tag|> (code is never run)"
        return text[start:tag], [_Attempt(text[tag:], problem=problem)]
    arguments, end = _builtin_arguments(text, head.end())
    if isinstance(arguments, _Problem):
        return text[start:tag], [_Attempt(text[tag:], problem=arguments.why)]
    fields = {"name": head.group(1), "arguments": arguments}
    return text[start:tag] + text[_skip_spaces(text, end) :], [_Attempt(text[tag:end], fields)]


def _builtin_arguments(text: str, at: int) -> tuple[dict[str, Any] | _Problem, int]:
    """The ``key=json, …)`` of a built-in call from ``at``: (arguments, the end past ``)``)."""
    arguments: dict[str, Any] = {}
    limit = at + MAX_CALL_CHARS
    while at < limit and (key := _BUILTIN_ARGUMENT.match(text, at)) is not None:
        found = _decoded_prefix(text[key.end() : limit])
        if isinstance(found, _Problem):
            return found, at
        arguments[key.group(1)] = found[0]
        at = _skip_spaces(text, key.end() + found[1])
        if not text.startswith(",", at):
            break
        at += 1
    if not text.startswith(")", at):
        return _Problem("the built-in call does not end with ')'"), at
    return arguments, at + 1


def _generic(text: str, start: int) -> _Parsed:
    """The reply as one JSON object of ``tool_call``, ``tool_calls`` or ``response``."""
    body = text[start:].strip()
    if not body.startswith("{"):
        return text[start:], []
    value = _decoded(body)
    if isinstance(value, _Problem):
        attempted = '"tool_call' in body[:SHOWN_CHARS]
        return ("", [_Attempt(body, problem=value.why)]) if attempted else (text[start:], [])
    if not isinstance(value, dict):
        return text[start:], []
    if "tool_calls" in value:
        return "", _generic_calls(value["tool_calls"], body)
    if "tool_call" in value:
        return "", [_json_fields(value["tool_call"], body, "arguments")]
    if "response" in value:
        response = value["response"]
        return (response if isinstance(response, str) else _dumped(response)), []
    return text[start:], []


def _generic_calls(calls: Any, body: str) -> list[_Attempt]:
    if not isinstance(calls, list):
        return [_Attempt(body, problem='"tool_calls" must be a list of calls')]
    attempts = [_json_fields(call, body, "arguments") for call in calls[:MAX_CALLS]]
    if len(calls) > MAX_CALLS:
        attempts.append(_too_many(body))
    return attempts


def _json_object(body: str, text: str, arguments_key: str) -> _Attempt:
    """A call written as a JSON object."""
    value = (
        _decoded(body)
        if len(body) <= MAX_CALL_CHARS
        else _Problem(f"the call is longer than {MAX_CALL_CHARS:,} characters")
    )
    if isinstance(value, _Problem):
        return _Attempt(text, problem=value.why)
    return _json_fields(value, text, arguments_key)


def _json_fields(value: Any, text: str, arguments_key: str) -> _Attempt:
    if not isinstance(value, dict):
        return _Attempt(text, problem=f"a call must be a JSON object, not {json_type(value)}")
    return _Attempt(text, value, arguments_key)


def _too_many(text: str) -> _Attempt:
    return _Attempt(
        text, problem=f"more than {MAX_CALLS} calls in one reply; the rest are not read"
    )


def _dumped(value: Any) -> str:
    """A non-string ``response`` as llama.cpp writes it back: JSON indented by two."""
    return json.dumps(value, ensure_ascii=False, indent=2)


_FORMATS: dict[CallFormat, Callable[[str, int], _Parsed]] = {
    CallFormat.HERMES: _hermes,
    CallFormat.LLAMA_3: _llama_3,
    CallFormat.LLAMA_3_BUILTIN: _llama_3_builtin,
    CallFormat.GENERIC: _generic,
}
