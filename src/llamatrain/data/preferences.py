"""Preference pairs: JSONL lines of ``{"prompt", "chosen", "rejected"}`` → rows of whole pairs.

A line holds a prompt and two replies to it, the preferred (``chosen``) and the other
(``rejected``), as raw text — ``{"prompt": "2+2=", "chosen": "4", "rejected": "5"}``, encoded
as a ``{"prompt", "completion"}`` line is (the reply and EOS scored) — or as conversations:
``"prompt"`` a list of messages and each reply a list of messages (usually one assistant
turn) or a string (one assistant turn), rendered with the chat template as a ``{"messages"}``
line is. Either way only the reply is scored: a conversation's assistant turns inside the
prompt are context, not trained.

Each pair becomes two examples, chosen then rejected, which share their prompt. A pair is laid
into one ``n_ctx + 1`` row as one document with branches (``llamatrain.ops.attention``): its
prompt but the last token once (the trunk, branch 0), then the chosen branch (1) — the last
prompt token and the chosen reply — then the rejected branch (2), the last prompt token and the
rejected reply. Each branch attends to the trunk and itself and takes the positions it has
unshared, so a reply's log-probs are those of prompt + reply run alone, while the prompt is
computed once instead of twice (only its last token twice: its output predicts each reply's
first token). The row's documents array is (rows, n_ctx + 1, 2): pair ``k`` of a row is
document ``k``, and each padding token after the pairs a document of its own, which scores
nothing and whose attention, seeing only itself, costs the flash op no columns beyond the
diagonal (one padding document would attend to all of it: quadratic in the padding).
The prompt is the longest run of tokens both examples begin with and neither scores.

``data.packing`` puts several whole pairs into a row; unpacked, each pair has a row of its own.
A pair never spans two rows, so batches, micro-batches and ranks (all cut by rows) never split
one. A pair too long for a row is cut: each reply's branch keeps at least half of what the
shared prompt leaves of the row; a pair whose cut leaves a reply nothing scored is left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llamatrain.chat_template import Segment
from llamatrain.data.examples import Example, ExampleRows, LineEncoder
from llamatrain.data.json_text import load_json
from llamatrain.data.jsonl import BadLines, _chat_line, _json_type, numbered_lines
from llamatrain.errors import DataError

__all__ = [
    "CHOSEN",
    "REJECTED",
    "TRUNK",
    "DegeneratePairs",
    "Pair",
    "PairEncoder",
    "PairLine",
    "cut_pairs",
    "pair_rows",
    "parse_pair",
    "read_pairs",
]

Messages = tuple[Mapping[str, str], ...]

TRUNK, CHOSEN, REJECTED = 0, 1, 2
"""Branch ids of a pair's tokens in a row: its shared prompt, its chosen and rejected branch."""

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
        """The tokens the pair takes in a row, its trunk laid once."""
        return len(self.chosen.ids) + len(self.rejected.ids) - self.trunk

    @property
    def trunk(self) -> int:
        """Tokens laid once for both replies: those both examples begin with and neither
        scores (the prompt), but the last, whose output predicts each reply's first token."""
        c, r = self.chosen, self.rejected
        n = min(len(c.ids), len(r.ids))
        same = (c.ids[:n] == r.ids[:n]) & ~c.scored[:n] & ~r.scored[:n]
        shared = n if same.all() else int(np.argmin(same))
        return max(shared - 1, 0)

    def branches(self) -> tuple[tuple[int, Example], ...]:
        """(branch id, tokens) in row order: the trunk, the chosen and the rejected branch."""
        t = self.trunk
        return (
            (TRUNK, _slice(self.chosen, 0, t)),
            (CHOSEN, _slice(self.chosen, t, None)),
            (REJECTED, _slice(self.rejected, t, None)),
        )


def parse_pair(line: str) -> PairLine:
    """The pair one line holds; DataError saying in one line what is wrong."""
    value = load_json(line)
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
        return _chat_line(value, need_assistant=False, field=key).messages
    except DataError as problem:
        named = str(problem).startswith(f'"{key}"')  # an empty list says which field itself
        raise DataError(str(problem) if named else f'"{key}": {problem}') from None


def _reply(value: dict, key: str) -> Messages:
    reply = value[key]
    if isinstance(reply, str):
        return ({"role": "assistant", "content": reply},)
    if not isinstance(reply, list) or not reply:
        got = "an empty list" if reply == [] else _json_type(reply)
        raise DataError(f'"{key}" must be text or a non-empty list of messages, not {got}')
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
        prompt, reply = self._bounded(prompt, reply)
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

    def _bounded(self, prompt: Messages, reply: Messages) -> tuple[Messages, Messages]:
        """Prompt and reply cut as a conversation is before its template renders it
        (``LineEncoder.bounded_chat``): the prompt comes first, so both replies of a pair keep
        the same prompt, and a prompt that fills the budget leaves no reply to score."""
        messages, _ = self.encoder.bounded_chat([*prompt, *reply], None)
        return tuple(messages[: len(prompt)]), tuple(messages[len(prompt) :])


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


@dataclass
class DegeneratePairs:
    """Pairs that can teach nothing, counted for one warning: identical replies (their
    log-ratios cancel, so the loss stays at ln 2 with no gradient) or an empty one."""

    identical: int = 0
    empty: int = 0
    first: str = ""

    def check(self, line: PairLine, where: str) -> None:
        """Count ``line`` (read at ``where``, ``file:line``) if it is degenerate."""
        if line.chosen == line.rejected:
            self.identical += 1
        elif not (_said(line.chosen) and _said(line.rejected)):
            self.empty += 1
        else:
            return
        self.first = self.first or where

    def note(self) -> str | None:
        """The warning, or None when every pair has two different, non-empty replies."""
        if not self.identical + self.empty:
            return None
        return (
            f"{self.identical} preference pairs have identical replies and {self.empty} an "
            f"empty one (first: {self.first}); they teach nothing (the loss stays at ln 2): "
            "fix or remove them"
        )


def _said(reply: str | Messages) -> bool:
    """Whether a reply holds any text (a string, or its messages' contents)."""
    if isinstance(reply, str):
        return bool(reply.strip())
    return any(str(m.get("content") or "").strip() for m in reply)


def read_pairs(
    paths: Sequence[Path],
    encoder: PairEncoder,
    bad: BadLines,
    degenerate: DegeneratePairs | None = None,
) -> list[Pair]:
    """Every usable line of ``paths`` as a pair, in order; ``bad`` decides about the others,
    ``degenerate`` counts the pairs that teach nothing."""
    pairs = []
    for path in paths:
        for number, line in numbered_lines(path, bad):
            bad.line_read(path)
            try:
                parsed = parse_pair(line)
                pairs.append(encoder.encode(parsed))
            except DataError as problem:
                bad.bad(path, number, problem)
                continue
            if degenerate is not None:
                degenerate.check(parsed, f"{path}:{number}")
    if not pairs:
        names = ", ".join(str(p) for p in paths)
        raise DataError(f"no usable preference pair in {names}; see the lines skipped above")
    return pairs


def cut_pairs(pairs: Sequence[Pair], span: int) -> tuple[list[Pair], int, int]:
    """Pairs made to fit a row of ``span`` tokens as :func:`pair_rows` lays them, their
    trunk once (each reply's branch keeping at least half of the room the trunk leaves, the
    longer one cut first); also how many were cut, and how many of those were left out because
    a reply lost every scored token (a trunk longer than the row leaves none)."""
    kept, cut, dropped = [], 0, 0
    for pair in pairs:
        if len(pair) <= span:
            kept.append(pair)
            continue
        cut += 1
        trunk = pair.trunk
        room = max(span - trunk, 0)  # for the two branches
        n_c, n_r = len(pair.chosen.ids) - trunk, len(pair.rejected.ids) - trunk
        keep_c = min(n_c, max(room // 2, room - n_r))
        keep_r = min(n_r, room - keep_c)
        chosen = _slice(pair.chosen, 0, trunk + keep_c)
        rejected = _slice(pair.rejected, 0, trunk + keep_r)
        if not (chosen.scored.any() and rejected.scored.any()):
            dropped += 1
            continue
        kept.append(Pair(chosen, rejected))
    return kept, cut, dropped


def _slice(example: Example, start: int, stop: int | None) -> Example:
    return Example(example.ids[start:stop], example.scored[start:stop], example.inexact)


def pair_rows(pairs: Sequence[Pair], span: int, pad_id: int, *, packing: bool) -> ExampleRows:
    """Rows of ``span`` tokens holding whole pairs (each at most ``span``), each pair one
    document of three branches (trunk, chosen, rejected; see the module docstring): several
    pairs a row in order when ``packing``, else one."""
    groups: list[list[Pair]] = [[]]
    used = 0
    for pair in pairs:
        if groups[-1] and (not packing or used + len(pair) > span):
            groups.append([])
            used = 0
        groups[-1].append(pair)
        used += len(pair)
    tokens = np.full((len(groups), span), pad_id, dtype=np.int64)
    scored = np.zeros((len(groups), span), dtype=bool)
    filled = np.zeros((len(groups), span), dtype=bool)
    documents = np.zeros((len(groups), span, 2), dtype=np.int64)  # (document, branch) ids
    for r, group in enumerate(groups):
        start = 0
        for doc, pair in enumerate(group):
            for branch, piece in pair.branches():
                end = start + len(piece.ids)
                tokens[r, start:end], scored[r, start:end] = piece.ids, piece.scored
                filled[r, start:end], documents[r, start:end] = True, (doc, branch)
                start = end
        documents[r, start:, 0] = len(group) + np.arange(span - start)  # padding: see above
    return ExampleRows(tokens, scored, filled, documents)
