"""Instruction and chat rows: JSONL lines or table rows → checked examples, and what to do
with bad ones.

Each non-blank line of a ``data.format = "jsonl"`` file, and each row of a Parquet file or HF
``datasets`` folder (``data.format = "parquet" | "hf"``, read by
:func:`~llamatrain.data.sources.table_rows`), is one object of one of three shapes: ``{"text":
…}`` (trained on whole), ``{"prompt": …, "completion": …}`` (raw text, the completion trained
on) or ``{"messages": [{"role": …, "content": …}, …], "tools": [...]?}`` (a conversation,
rendered with a chat template; a message may carry the keys the template reads:
``tool_calls``, ``reasoning_content``, ``name``, ``tool_call_id``). Alpaca and ShareGPT rows
are mapped onto these first (:mod:`~llamatrain.data.layouts`, ``data.layout``).
:func:`parse_line` checks one line or row and says in one line what is wrong; :class:`BadLines`
applies ``data.on_bad_line`` to such problems (those found here and those found later, when a
line is rendered and tokenized), so every error names ``file:line`` (a table's row number,
from 1) and skipped lines are counted per file. Other keys on a line are ignored (datasets
often carry ids or sources); in a table row a null is a missing key (a table's columns are the
union of its rows' keys).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from llamatrain.data.json_text import load_json
from llamatrain.data.layouts import decode_tools, to_native
from llamatrain.data.sources import open_text, table_rows
from llamatrain.errors import DataError

__all__ = [
    "BadLines",
    "ChatLine",
    "CompletionLine",
    "JsonlLine",
    "MAX_LINE_CHARS",
    "TextLine",
    "numbered_lines",
    "numbered_rows",
    "parse_line",
    "row_of",
]


@dataclass(frozen=True)
class TextLine:
    """``{"text": …}``: a document trained on whole."""

    text: str


@dataclass(frozen=True)
class CompletionLine:
    """``{"prompt": …, "completion": …}``: raw text whose completion part is trained on."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class ChatLine:
    """``{"messages": […], "tools": […]?}``: a conversation, each message a ``{"role",
    "content"}`` dict with the optional keys its role may have, and the tools it may call."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None


JsonlLine = TextLine | CompletionLine | ChatLine
"""One checked line of a JSONL file."""

_SHAPES = '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}'

MESSAGE_KEYS = ("tool_calls", "reasoning_content", "name", "tool_call_id")
"""Message keys besides ``role`` and ``content`` passed on to the chat template (which checks
that the message's role may have them)."""


MAX_LINE_CHARS = 1 << 27
"""The longest line read (134M characters, e.g. a 100 MB line): a line is parsed whole, so
this bounds what one line can hold in memory. No example needs more: a row holds
``data.n_ctx + 1`` tokens, and the text beyond what fills it is cut before tokenizing
(:class:`~llamatrain.data.examples.LineEncoder`)."""

_SKIP_CHARS = 1 << 20
"""Characters read at a time while skipping the rest of a line longer than MAX_LINE_CHARS."""


def numbered_lines(
    path: Path, bad: BadLines | None = None, *, max_chars: int = MAX_LINE_CHARS
) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for every non-blank line of ``path``, numbered from 1 as an
    editor shows them (line endings normalised as
    :func:`~llamatrain.data.sources.read_text` normalises them), read one line at a time.

    A line longer than ``max_chars`` is never held whole: it is skipped as it is read, and
    ``bad`` told about it (its line counted and its policy applied); without ``bad`` it is a
    DataError naming ``file:line``.
    """
    with open_text(path) as f:
        number = 0
        while line := f.readline(max_chars + 1):
            number += 1
            if len(line) > max_chars and not line.endswith("\n"):
                _skip_rest_of_line(f)
                problem = DataError(
                    f"a line of more than {max_chars:,} characters, more than any row can "
                    "hold; split it, or leave it out"
                )
                if bad is None:
                    raise DataError(f"{path}:{number}: {problem}")
                bad.line_read(path)
                bad.bad(path, number, problem)
                continue
            line = line.removesuffix("\n")
            if line.strip():
                yield number, line


def _skip_rest_of_line(f: TextIO) -> None:
    while (part := f.readline(_SKIP_CHARS)) and not part.endswith("\n"):
        pass


def numbered_rows(
    path: Path, format: str = "jsonl", bad: BadLines | None = None
) -> Iterator[tuple[int, str | dict]]:
    """``(number, line or row)`` of one ``data.path`` input: JSONL lines as
    :func:`numbered_lines` gives them (``bad`` told about over-long ones), table rows
    (``format`` ``"parquet"`` or ``"hf"``) as dicts numbered from 1."""
    if format == "jsonl":
        return numbered_lines(path, bad)
    return enumerate(table_rows(path, format), start=1)


def parse_line(
    line: str | Mapping[str, Any], *, need_assistant: bool, layout: str = "auto"
) -> JsonlLine:
    """The example one line (JSON text) or table row (a dict, its nulls missing keys) holds;
    DataError saying what is wrong (without a location).

    ``need_assistant``: a conversation must have an assistant turn (``data.train_on =
    "completion"`` trains on nothing else, so a chat without one would teach nothing).
    ``layout``: ``data.layout`` (:mod:`~llamatrain.data.layouts`).
    """
    value = to_native(row_of(line), layout)
    if "messages" in value:
        tools = _tools(value.get("tools"))
        return _chat_line(value["messages"], need_assistant, tools)
    if "prompt" in value or "completion" in value:
        return CompletionLine(_string(value, "prompt"), _string(value, "completion"))
    if "text" in value:
        return TextLine(_string(value, "text"))
    raise DataError(f"an object with none of the keys of {_SHAPES}")


def row_of(line: str | Mapping[str, Any]) -> dict[str, Any]:
    """The object one line (JSON text) or table row holds, a table's nulls left out (its
    columns are the union of its rows' keys); DataError unless a line is a JSON object."""
    if isinstance(line, str):
        value = load_json(line)
        if not isinstance(value, dict):
            raise DataError(f"a line must be a JSON object ({_SHAPES}), not {_json_type(value)}")
        return value
    return {key: item for key, item in line.items() if item is not None}


def _tools(tools: Any) -> tuple[Mapping[str, Any], ...] | None:
    """A line's ``tools``: the JSON schemas of the functions its conversation may call (a list
    of objects, or that list as a JSON string, as tables often store it); None if absent."""
    tools = decode_tools(tools)
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f'"tools" must be a list of objects, not {_json_type(tools)}')
    return tuple(tools)


def _chat_line(
    messages: Any,
    need_assistant: bool,
    tools: tuple[Mapping[str, Any], ...] | None = None,
    field: str = "messages",
) -> ChatLine:
    """A conversation, checked; ``field`` is the key it was read from, as errors name it."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else _json_type(messages)
        raise DataError(f'"{field}" must be a non-empty list, not {got}')
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"message {i} must be an object, not {_json_type(message)}")
        if message.get("content") is None and message.get("tool_calls"):
            message = {**message, "content": ""}  # a turn that only calls tools
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(
                    f'message {i} needs a string "{key}", got {_json_type(message.get(key))}'
                )
        extra = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
        checked.append({"role": message["role"], "content": message["content"], **extra})
    if need_assistant and not any(m["role"] == "assistant" for m in checked):
        raise DataError(
            'a conversation with no "assistant" message, which data.train_on = "completion" '
            'has nothing to train on (set data.train_on = "all" to train on it whole)'
        )
    return ChatLine(tuple(checked), tools)


def _string(value: dict, key: str) -> str:
    if not isinstance(value.get(key), str):
        raise DataError(f'"{key}" must be a string, got {_json_type(value.get(key))}')
    return value[key]


def _json_type(value: Any) -> str:
    """How JSON would name ``value``'s type (``None`` = the key is missing)."""
    if value is None:
        return "nothing (missing or null)"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    names |= {list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


@dataclass
class _FileTally:
    lines: int = 0
    skipped: int = 0
    first: str = ""  # the first skipped line's location and problem


@dataclass
class BadLines:
    """``data.on_bad_line`` applied: ``"error"`` raises at the first bad line, naming
    ``file:line`` and the problem; ``"skip"`` counts it, and :meth:`summaries` says so."""

    policy: str
    _files: dict[Path, _FileTally] = field(default_factory=dict)

    def line_read(self, path: Path) -> None:
        """Count one line of ``path`` (good or bad) for the summary's "of N lines"."""
        self._files.setdefault(path, _FileTally()).lines += 1

    def bad(self, path: Path, number: int, problem: DataError) -> None:
        """Line ``number`` of ``path`` is unusable: raise (``"error"``) or count it."""
        if self.policy == "error":
            raise DataError(
                f"{path}:{number}: {problem}; fix the line, or set data.on_bad_line = 'skip'"
            )
        tally = self._files.setdefault(path, _FileTally())
        tally.skipped += 1
        tally.first = tally.first or f"line {number}: {problem}"

    def tallies(self, paths: list[Path]) -> list[list[Any]]:
        """``[lines, skipped, first]`` for each of ``paths``, in order: what a cache keeps to
        report the same skipped lines again (:meth:`restore`)."""
        found = [self._files.get(p, _FileTally()) for p in paths]
        return [[t.lines, t.skipped, t.first] for t in found]

    def restore(self, paths: list[Path], tallies: list[list[Any]]) -> None:
        """Count what :meth:`tallies` gave, as if ``paths`` had been read again."""
        for path, (lines, skipped, first) in zip(paths, tallies, strict=True):
            self._files[path] = _FileTally(lines, skipped, first)

    def summaries(self) -> list[str]:
        """One line per file with skipped lines, e.g. "skipped 2 of 120 lines of chats.jsonl
        (first: line 7: invalid JSON …)"."""
        return [
            f"skipped {t.skipped} of {t.lines} lines of {path} (first: {t.first})"
            for path, t in self._files.items()
            if t.skipped
        ]
