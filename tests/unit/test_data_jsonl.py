"""JSONL lines → checked examples: each shape, each kind of bad line, and skip counting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamatrain.data.jsonl import (
    BadLines,
    ChatLine,
    CompletionLine,
    TextLine,
    numbered_lines,
    parse_line,
)
from llamatrain.errors import DataError

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}


def test_each_shape_parses_and_other_keys_are_ignored():
    assert parse_line('{"text": "a b", "id": 3}', need_assistant=True) == TextLine("a b")
    line = parse_line('{"prompt": "Q: ", "completion": "A"}', need_assistant=True)
    assert line == CompletionLine("Q: ", "A")
    chat = parse_line(json.dumps({**CHAT, "source": "x"}), need_assistant=True)
    assert isinstance(chat, ChatLine) and [dict(m) for m in chat.messages] == CHAT["messages"]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"text": "a"', "invalid JSON"),
        ('["text"]', "must be a JSON object"),
        ('{"title": "a"}', "none of the keys"),
        ('{"text": 3}', '"text" must be a string, got a number'),
        ('{"prompt": "Q"}', '"completion" must be a string, got nothing'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": "hi"}', '"messages" must be a non-empty list, not a string'),
        ('{"messages": ["hi"]}', "message 0 must be an object, not a string"),
        ('{"messages": [{"role": "user"}]}', 'message 0 needs a string "content"'),
        ('{"messages": [{"role": 1, "content": "x"}]}', 'message 0 needs a string "role"'),
        ('{"messages": [{"role": "user", "content": "x"}]}', 'no "assistant" message'),
    ],
)
def test_bad_lines_say_what_is_wrong(line: str, problem: str):
    with pytest.raises(DataError, match=problem):
        parse_line(line, need_assistant=True)


def test_a_chat_without_assistant_is_fine_when_training_on_all():
    line = parse_line('{"messages": [{"role": "user", "content": "x"}]}', need_assistant=False)
    assert isinstance(line, ChatLine)


def test_lines_are_numbered_as_an_editor_shows_them_and_blank_ones_skipped(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "a"}\r\n\r\n  \n{"text": "b"}\n')
    assert list(numbered_lines(path)) == [(1, '{"text": "a"}'), (4, '{"text": "b"}')]


def test_error_policy_names_file_and_line(tmp_path: Path):
    bad = BadLines("error")
    with pytest.raises(DataError, match=r"chats\.jsonl:7: invalid JSON.*on_bad_line = 'skip'"):
        bad.bad(tmp_path / "chats.jsonl", 7, DataError("invalid JSON (x)"))


def test_skip_policy_counts_per_file_and_keeps_the_first_problem():
    bad, a, b = BadLines("skip"), Path("a.jsonl"), Path("b.jsonl")
    for _ in range(5):
        bad.line_read(a)
    bad.line_read(b)
    bad.bad(a, 2, DataError("invalid JSON"))
    bad.bad(a, 4, DataError("not an object"))
    assert bad.summaries() == ["skipped 2 of 5 lines of a.jsonl (first: line 2: invalid JSON)"]
