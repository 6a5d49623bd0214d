"""Preference pairs: JSONL lines of ``{"prompt", "chosen", "rejected"}`` → rows of whole pairs.

A line holds a prompt and two replies to it, the preferred (``chosen``) and the other
(``rejected``), as raw text — ``{"prompt": "2+2=", "chosen": "4", "rejected": "5"}``, encoded
as a ``{"prompt", "completion"}`` line is (the reply and EOS scored) — or as conversations:
``"prompt"`` a list of messages and each reply a list of messages (usually one assistant
turn) or a string (one assistant turn), rendered with the chat template as a ``{"messages"}``
line is. Either way only the reply is scored: a conversation's assistant turns inside the
prompt are context, not trained.

Each pair becomes two examples, chosen then rejected, laid into one ``n_ctx + 1`` row as two
documents (each attends only to itself, positions from 0): in every row document ``2k`` is
pair ``k``'s chosen reply and ``2k + 1`` its rejected one, and the padding after them is the
last document, which scores nothing. ``data.packing`` puts several whole pairs into a row;
unpacked, each pair has a row of its own. A pair never spans two rows, so batches, micro-batches
and ranks (all cut by rows) never split one. A pair too long for a row is cut: each reply
keeps at least half the row; a pair whose cut leaves a reply nothing scored is left out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamatrain.data.chat_template import Segment
from llamatrain.data.examples import Example, ExampleRows, LineEncoder, _rows
from llamatrain.data.jsonl import BadLines, _chat_line, _json_type, numbered_lines
from llamatrain.errors import DataError

__all__ = [
    "Pair",
    "PairEncoder",
    "PairLine",
    "cut_pairs",
    "pair_rows",
    "parse_pair",
    "read_pairs",
]

Messages = tuple[Mapping[str, str], ...]

_KEYS = ("prompt", "chosen", "rejected")
_SHAPE = '{"prompt": ..., "chosen": ..., "rejected": ...}'


@dataclass(frozen=True)
class PairLine:
    """One checked line: all three raw text, or a conversation prompt and replies as
    messages (a string reply already made one assistant message)."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages


@dataclass(frozen=True)
class Pair:
    """The two examples of one line, scored only on their replies."""

    chosen: Example
    rejected: Example

    def __len__(self) -> int:
        return len(self.chosen.ids) + len(self.rejected.ids)


def parse_pair(line: str) -> PairLine:
    """The pair one line holds; DataError saying in one line what is wrong."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise DataError(f"a line must be a JSON object {_SHAPE}, not {_json_type(value)}")
    missing = [key for key in _KEYS if key not in value]
    if missing:
        raise DataError(
            f'a preference pair needs "prompt", "chosen" and "rejected"; this line has no '
            f'"{missing[0]}"'
        )
    prompt = value["prompt"]
    if isinstance(prompt, str):
        for key in ("chosen", "rejected"):
            if not isinstance(value[key], str):
                raise DataError(
                    f'"prompt" is text, so "{key}" must be text too, not {_json_type(value[key])}'
                )
        return PairLine(prompt, value["chosen"], value["rejected"])
    if not isinstance(prompt, list):
        raise DataError(f'"prompt" must be text or a list of messages, not {_json_type(prompt)}')
    messages = _messages("prompt", prompt)
    return PairLine(messages, _reply(value, "chosen"), _reply(value, "rejected"))


def _messages(key: str, value: Any) -> Messages:
    try:
        return _chat_line(value, need_assistant=False).messages
    except DataError as problem:
        raise DataError(f'"{key}": {problem}') from None


def _reply(value: dict, key: str) -> Messages:
    reply = value[key]
    if isinstance(reply, str):
        return ({"role": "assistant", "content": reply},)
    if not isinstance(reply, list) or not reply:
        raise DataError(
            f'"{key}" must be text or a non-empty list of messages, not {_json_type(reply)}'
        )
    messages = _messages(key, reply)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f'"{key}" has no "assistant" message: nothing of it would be scored')
    return messages


class PairEncoder:
    """Pairs encoded as :class:`~llamatrain.data.examples.LineEncoder` encodes a
    ``{"prompt", "completion"}`` line (text) or a conversation (messages), scored on the
    reply alone."""

    def __init__(self, encoder: LineEncoder) -> None:
        self.encoder = encoder

    def encode(self, line: PairLine) -> Pair:
        return Pair(self._reply(line.prompt, line.chosen), self._reply(line.prompt, line.rejected))

    def _reply(self, prompt: str | Messages, reply: str | Messages) -> Example:
        if isinstance(prompt, str):
            assert isinstance(reply, str)
            segments = [Segment(prompt, False), Segment(reply, True)]
            return self.encoder.encode_segments(segments, special=False, eos=True)
        assert not isinstance(reply, str)
        template = self.encoder.chat_template()
        segments = template.segments([*prompt, *reply])
        context = template.render(prompt) if prompt else ""
        whole = "".join(s.text for s in segments)
        if not whole.startswith(context):
            raise DataError(
                f"{template.name} renders the prompt differently once a reply follows it, so "
                "the reply's tokens cannot be told apart; use a template that renders turn by "
                "turn"
            )
        example = self.encoder.encode_segments(_after(segments, len(context)), special=True)
        if not example.scored.any():
            raise DataError("a reply with nothing to score (an empty assistant turn)")
        return example


def _after(segments: Sequence[Segment], cut: int) -> list[Segment]:
    """``segments`` with everything before character ``cut`` (the prompt) untrained."""
    out, start = [], 0
    for s in segments:
        end = start + len(s.text)
        if end <= cut or not s.trained:
            out.append(Segment(s.text, False))
        elif start >= cut:
            out.append(s)
        else:  # a trained piece the prompt reaches into: only its part after the prompt
            out += [Segment(s.text[: cut - start], False), Segment(s.text[cut - start :], True)]
        start = end
    return out


def read_pairs(paths: Sequence[Path], encoder: PairEncoder, bad: BadLines) -> list[Pair]:
    """Every usable line of ``paths`` as a pair, in order; ``bad`` decides about the others."""
    pairs = []
    for path in paths:
        for number, line in numbered_lines(path):
            bad.line_read(path)
            try:
                pairs.append(encoder.encode(parse_pair(line)))
            except DataError as problem:
                bad.bad(path, number, problem)
    if not pairs:
        names = ", ".join(str(p) for p in paths)
        raise DataError(f"no usable preference pair in {names}; see the lines skipped above")
    return pairs


def cut_pairs(pairs: Sequence[Pair], span: int) -> tuple[list[Pair], int, int]:
    """Pairs made to fit a row of ``span`` tokens (each reply keeping at least half of it,
    the longer one cut first); also how many were cut, and how many of those were left out
    because a reply lost every scored token."""
    kept, cut, dropped = [], 0, 0
    for pair in pairs:
        if len(pair) <= span:
            kept.append(pair)
            continue
        cut += 1
        n_c, n_r = len(pair.chosen.ids), len(pair.rejected.ids)
        keep_c = min(n_c, max(span // 2, span - n_r))
        keep_r = min(n_r, span - keep_c)
        chosen, rejected = _head(pair.chosen, keep_c), _head(pair.rejected, keep_r)
        if not (chosen.scored.any() and rejected.scored.any()):
            dropped += 1
            continue
        kept.append(Pair(chosen, rejected))
    return kept, cut, dropped


def _head(example: Example, n: int) -> Example:
    return Example(example.ids[:n], example.scored[:n], example.inexact)


def pair_rows(pairs: Sequence[Pair], span: int, pad_id: int, *, packing: bool) -> ExampleRows:
    """Rows of ``span`` tokens holding whole pairs (each at most ``span``), chosen then
    rejected, each its own document: several pairs a row in order when ``packing``, else
    one."""
    groups: list[list[Example]] = [[]]
    used = 0
    for pair in pairs:
        if groups[-1] and (not packing or used + len(pair) > span):
            groups.append([])
            used = 0
        groups[-1] += [pair.chosen, pair.rejected]
        used += len(pair)
    return _rows(groups, span, pad_id, with_documents=True)
