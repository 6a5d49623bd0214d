"""Tool calls in a model's reply, found the way llama.cpp's server finds them, as data.

A GRPO rollout hands each sampled reply to :func:`parse_reply`: the calls it holds come back in
the order written, as :class:`ToolCall` (name, arguments as a dict, id) or, when a call cannot
run, :class:`FailedCall` (unparseable, an unknown tool, arguments its schema refuses), beside
the reply's text outside the calls (``content``) and its thinking (``reasoning``). Nothing the
model wrote is ever evaluated: a call is JSON read as data (:mod:`~llamatrain.tools.call_json`:
strict, at most 256 KiB and 32 levels deep), its arguments checked against the tool's schema
(:mod:`~llamatrain.tools.arguments`). Hostile text — a truncated call, nested tags, megabytes of
arguments, JSON nested thousands deep, a tool that does not exist — ends as failed calls, in a
scan linear in the text, never as an exception.

The format comes from the chat template (:func:`call_syntax`), and the rules are what the
llama.cpp the tests pin does with it (:mod:`~llamatrain.tools.formats`, checked against its own
parser), so a model trained on these calls writes calls ``llama-server --jinja`` runs:

- ``HERMES`` (Qwen 2.5, Qwen3, Hermes 2/3, SmolLM3: the template holds ``<tool_call>``):
  ``<tool_call>`` + new line + ``{"name": …, "arguments": {…}}`` + ``</tool_call>``, as many
  as written, text before them only.
- ``LLAMA_3`` (Llama 3.1–3.3: the template has an ``ipython`` role): one
  ``{"name": …, "parameters": {…}}``, after text holding no ``{``, nothing after it.
- ``LLAMA_3_BUILTIN``: also Llama 3.1's ``<|python_tag|>name.call(key=json, …)`` (raw code
  after the tag is a failed call: it is never run); ``GENERIC``: the reply one JSON object,
  ``{"tool_call": …}``, ``{"tool_calls": [...]}`` or ``{"response": …}``. These two follow
  llama.cpp's per-format parsers of 2025: the pinned server reads both as plain content.

Where the pinned server refuses a reply whole (text after a call, a ``{`` beside a Llama call, a
call to a tool that does not exist), :attr:`Reply.refused` says why and every call in it fails:
served, it would run none. Where the server is looser, this is stricter: a truncated call fails
(the server runs what it read), and arguments are checked against the schema (the server checks
names only). A template with ``<think>`` gets a leading ``<think>…</think>`` taken as
reasoning; a call written while thinking is thought, not made.

Ids: llama.cpp leaves them empty (its server makes random ones); here a call's id is the ``id``
a generic call carries, else ``call_<k>``, k its place in the reply.

SmolLM3's template describes tools only through its own ``xml_tools`` variable and does not
render calls, so the pinned server parses no call from a SmolLM3 reply with it; its model writes
Hermes calls, which are read here, and a server needs a template that renders ``tools``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llamatrain.errors import ConfigError, shown
from llamatrain.tools.arguments import argument_problem, json_type
from llamatrain.tools.call_json import Problem, decoded
from llamatrain.tools.formats import (
    Attempt,
    Scan,
    scan_generic,
    scan_hermes,
    scan_llama_3,
    scan_llama_3_builtin,
    split_reasoning,
)

__all__ = [
    "CallFormat",
    "CallSyntax",
    "FailedCall",
    "Reply",
    "ToolCall",
    "call_syntax",
    "parse_reply",
]

UNPARSEABLE = "unparseable"
UNKNOWN_TOOL = "unknown_tool"
WRONG_ARGUMENTS = "wrong_arguments"


class CallFormat(enum.Enum):
    """How a model writes tool calls; the values are llama.cpp's names of the formats."""

    HERMES = "Hermes 2 Pro"
    LLAMA_3 = "Llama 3.x"
    LLAMA_3_BUILTIN = "Llama 3.x with builtin tools"
    GENERIC = "Generic"


@dataclass(frozen=True)
class CallSyntax:
    """What a template's model writes: its call format, and whether it thinks first."""

    format: CallFormat
    thinking: bool = False


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
    """A reply taken apart: its text outside the calls, its thinking, its calls in order, and
    why llama.cpp's server would refuse it whole (None: it would serve it)."""

    content: str
    reasoning: str = ""
    calls: tuple[ToolCall | FailedCall, ...] = ()
    refused: str | None = None

    @property
    def valid(self) -> list[ToolCall]:
        return [call for call in self.calls if isinstance(call, ToolCall)]

    @property
    def failed(self) -> list[FailedCall]:
        return [call for call in self.calls if isinstance(call, FailedCall)]


def call_syntax(template: str) -> CallSyntax:
    """How the model of the chat template ``template`` (its source) writes calls, found by the
    markers llama.cpp looks for. ConfigError for Qwen3-Coder's XML arguments, not parsed here."""
    thinking = "<think>" in template
    if "<tool_call>" in template:
        if "<function=" in template and "<parameter=" in template:
            raise ConfigError(
                "the chat template writes tool calls as XML parameters (Qwen3-Coder's "
                "<function=…><parameter=…> form), which llamatrain does not parse; use a "
                "template whose calls are JSON (<tool_call>{...}</tool_call>)"
            )
        return CallSyntax(CallFormat.HERMES, thinking)
    if "<|start_header_id|>ipython<|end_header_id|>" in template:
        return CallSyntax(CallFormat.LLAMA_3, thinking)
    return CallSyntax(CallFormat.GENERIC, thinking)


def parse_reply(text: str, syntax: CallSyntax, tools: Sequence[Mapping[str, Any]]) -> Reply:
    """``text`` (a decoded reply, without its end-of-turn token) taken apart as ``syntax``
    says; ``tools`` are the tools' schemas (:func:`~llamatrain.tools.schema.json_schema`'s, or
    their ``function`` part), against which names and arguments are checked. Never raises on
    what the model wrote."""
    parameters = _parameters_by_name(tools)
    reasoning, start = split_reasoning(text) if syntax.thinking else ("", 0)
    scan = _SCANNERS[syntax.format](text, start)
    calls = [_checked(attempt, k, parameters) for k, attempt in enumerate(scan.attempts)]
    refused = scan.refusal or _unreadable(scan.attempts) or _unknown_tool(calls, syntax.format)
    if refused is not None:
        calls = [_refused(c, a, refused) for c, a in zip(calls, scan.attempts, strict=True)]
    return Reply(scan.content.lstrip(), reasoning, tuple(calls), refused)


def _parameters_by_name(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    functions = [tool.get("function", tool) for tool in tools]
    return {f["name"]: f.get("parameters", {}) for f in functions}


def _checked(attempt: Attempt, k: int, parameters: Mapping[str, Any]) -> ToolCall | FailedCall:
    """The attempt as a call that may run, or as the first reason it may not."""
    if attempt.problem is not None:
        return FailedCall(UNPARSEABLE, attempt.problem, text=attempt.text)
    name = attempt.fields.get("name")
    if not isinstance(name, str) or not name:
        return FailedCall(UNPARSEABLE, 'the call has no "name" string', text=attempt.text)
    if name not in parameters:
        known = shown(", ".join(map(repr, parameters)), 200) or "none"
        error = f"there is no tool named {shown(name, 80)!r} (the tools are {known})"
        return FailedCall(UNKNOWN_TOOL, error, name, attempt.text)
    arguments = _arguments(attempt)
    if isinstance(arguments, str):
        return FailedCall(UNPARSEABLE, arguments, name, attempt.text)
    problem = argument_problem(arguments, parameters[name])
    if problem is not None:
        return FailedCall(WRONG_ARGUMENTS, f"{name}: {problem}", name, attempt.text)
    given_id = attempt.fields.get("id")
    return ToolCall(
        name, arguments, given_id if isinstance(given_id, str) and given_id else f"call_{k}"
    )


def _arguments(attempt: Attempt) -> dict[str, Any] | str:
    """The call's arguments as a dict (a JSON object, or a string holding one, as OpenAI's
    API writes them; none given: no arguments), or why they are not one."""
    key = attempt.arguments_key
    value = attempt.fields.get(key, {})
    if isinstance(value, str):
        value = decoded(value)
        if isinstance(value, Problem):
            return f'"{key}" is a string that is not JSON ({value.why})'
    if not isinstance(value, dict):
        return f'"{key}" must be a JSON object of the arguments, not {json_type(value)}'
    return value


def _unreadable(attempts: list[Attempt]) -> str | None:
    """The server refuses a reply holding a call it cannot read (one cut off, it reads)."""
    for attempt in attempts:
        if attempt.refuses:
            return f"it holds a call the server cannot read ({attempt.problem})"
    return None


def _unknown_tool(calls: list[ToolCall | FailedCall], fmt: CallFormat) -> str | None:
    """The pinned server refuses a Hermes or Llama 3.x reply that calls a tool it lacks."""
    if fmt in (CallFormat.HERMES, CallFormat.LLAMA_3):
        for call in calls:
            if isinstance(call, FailedCall) and call.kind == UNKNOWN_TOOL:
                return f"it calls {shown(call.name or '', 80)!r}, which is no tool"
    return None


def _refused(call: ToolCall | FailedCall, attempt: Attempt, why: str) -> FailedCall:
    """A call of a reply the server refuses: it would not run."""
    if isinstance(call, FailedCall):
        return call
    return FailedCall(
        UNPARSEABLE, f"llama.cpp's server refuses this reply: {why}", call.name, attempt.text
    )


_SCANNERS: dict[CallFormat, Callable[[str, int], Scan]] = {
    CallFormat.HERMES: scan_hermes,
    CallFormat.LLAMA_3: scan_llama_3,
    CallFormat.LLAMA_3_BUILTIN: scan_llama_3_builtin,
    CallFormat.GENERIC: scan_generic,
}
