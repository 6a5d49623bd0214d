"""JSONL instruction and chat data: lines → checked examples, and what to do with bad lines.

Each non-blank line of a ``data.format = "jsonl"`` file is one JSON object of one of three
shapes: ``{"text": …}`` (trained on whole), ``{"prompt": …, "completion": …}`` (raw text, the
completion trained on) or ``{"messages": [{"role": …, "content": …}, …]}`` (a conversation,
rendered with a chat template). :func:`parse_line` checks one line and says in one line what is
wrong; :class:`BadLines` applies ``data.on_bad_line`` to such problems (those found here and
those found later, when a line is rendered and tokenized), so every error names ``file:line``
and skipped lines are counted per file. Other keys on a line are ignored (datasets often carry
ids or sources).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamatrain.data.sources import read_text
from llamatrain.errors import DataError

__all__ = [
    "BadLines",
    "ChatLine",
    "CompletionLine",
    "JsonlLine",
    "TextLine",
    "numbered_lines",
    "parse_line",
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
    """``{"messages": […]}``: a conversation, each message a ``{"role", "content"}`` dict."""

    messages: tuple[Mapping[str, str], ...]


JsonlLine = TextLine | CompletionLine | ChatLine
"""One checked line of a JSONL file."""

_SHAPES = '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}'


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for every non-blank line of ``path``, numbered from 1 as an
    editor shows them (line endings normalised by :func:`~llamatrain.data.sources.read_text`)."""
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        if line.strip():
            yield number, line


def parse_line(line: str, *, need_assistant: bool) -> JsonlLine:
    """The example one line holds; DataError saying what is wrong (without a location).

    ``need_assistant``: a conversation must have an assistant turn (``data.train_on =
    "completion"`` trains on nothing else, so a chat without one would teach nothing).
    """
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise DataError(f"a line must be a JSON object ({_SHAPES}), not {_json_type(value)}")
    if "messages" in value:
        return _chat_line(value["messages"], need_assistant)
    if "prompt" in value or "completion" in value:
        return CompletionLine(_string(value, "prompt"), _string(value, "completion"))
    if "text" in value:
        return TextLine(_string(value, "text"))
    raise DataError(f"an object with none of the keys of {_SHAPES}")


def _chat_line(messages: Any, need_assistant: bool) -> ChatLine:
    if not isinstance(messages, list) or not messages:
        raise DataError(f'"messages" must be a non-empty list, not {_json_type(messages)}')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"message {i} must be an object, not {_json_type(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(
                    f'message {i} needs a string "{key}", got {_json_type(message.get(key))}'
                )
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            'a conversation with no "assistant" message, which data.train_on = "completion" '
            'has nothing to train on (set data.train_on = "all" to train on it whole)'
        )
    return ChatLine(tuple({"role": m["role"], "content": m["content"]} for m in messages))


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

    def summaries(self) -> list[str]:
        """One line per file with skipped lines, e.g. "skipped 2 of 120 lines of chats.jsonl
        (first: line 7: invalid JSON …)"."""
        return [
            f"skipped {t.skipped} of {t.lines} lines of {path} (first: {t.first})"
            for path, t in self._files.items()
            if t.skipped
        ]
