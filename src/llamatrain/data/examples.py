"""JSONL examples → token ids with a trained mask → packed or padded training rows.

Tokenization follows llama.cpp's prompt path: a conversation is rendered with its chat template
and the whole text tokenized at once with control tokens parsed (``<|im_start|>`` becomes its
id); BOS is put first when the tokenizer adds BOS and the text does not already start with it
(llama-3's template writes ``<|begin_of_text|>`` itself). ``{"text"}`` and ``{"prompt",
"completion"}`` lines are raw text, tokenized like the text corpus (control tokens not parsed),
and end with EOS. Which tokens are trained follows from token boundaries: the tokens of
``text[:c]`` at each boundary ``c`` between trained and untrained text are a prefix of the
whole text's tokens; where a token straddles ``c`` they are not, the token goes to the later
piece, and :attr:`Example.inexact` counts it. A token is *scored* (a training target) when it is
trained and is not its example's first token.

Rows are ``n_ctx + 1`` tokens (inputs ``row[:-1]``, targets ``row[1:]``, -100 where not
scored). Packed, several whole examples share a row, in order, each its own document (its
attention and rope positions start afresh, see ``Llama.forward(documents=...)``); unpacked,
each example has a row of its own. Either way the rest of a row is padding, never scored. An
example longer than a row is cut to it. The encoded examples are cached before that cut
(:mod:`~llamatrain.data.example_cache`), so a restart reads them back instead of re-tokenizing
(and a resume checks the row count is unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llamatrain.chat_template import ChatTemplate, Segment, TemplateFault, needs_bos
from llamatrain.data.jsonl import (
    BadLines,
    ChatLine,
    CompletionLine,
    JsonlLine,
    TextLine,
    numbered_rows,
    parse_line,
    row_of,
)
from llamatrain.data.layouts import MixedRows
from llamatrain.data.windows import Batch
from llamatrain.errors import ConfigError, DataError
from llamatrain.ops.sets import IGNORE_INDEX

if TYPE_CHECKING:
    from llamatrain.tokenizer import Tokenizer

__all__ = [
    "CHARS_PER_TOKEN",
    "MIN_CUT_CHARS",
    "Example",
    "ExampleRows",
    "LineEncoder",
    "pack_rows",
    "pad_rows",
    "read_examples",
    "require_trainable",
    "split_examples",
    "trained_tokens",
    "cut_chars",
    "truncate",
]


@dataclass(frozen=True)
class Example:
    """One line's tokens and which of them are training targets."""

    ids: np.ndarray
    """int64 token ids."""
    scored: np.ndarray
    """bool, one per id: a target of the loss (trained, and not the first token)."""
    inexact: int = 0
    """Trained/untrained boundaries a token straddled (see the module docstring)."""


CHARS_PER_TOKEN = 64
"""Characters of text allowed per token of a row before a line is cut (:func:`cut_chars`).
Text averages 3–5 characters a token and code's whitespace runs at most a few dozen, so a cut
line still has far more tokens than its row holds, and every row is filled as if the line had
been tokenized whole."""

MIN_CUT_CHARS = 1 << 18
"""The fewest characters a line is cut to (a quarter of a second of tokenizing at most)."""


def cut_chars(span: int) -> int:
    """How many characters of a line can reach a row of ``span`` tokens: at least
    :data:`CHARS_PER_TOKEN` a token, rounded up to a power of two (from
    :data:`MIN_CUT_CHARS`), so the limit, and the examples encoded under it, change only when
    ``data.n_ctx`` crosses one (every ``n_ctx`` below 4,096 cuts at 262,144 characters).

    Text past it cannot be trained (a row keeps its first ``span`` tokens), so it is cut
    before tokenizing: a 100 MB line costs reading and parsing it, not 100 MB of tokenizing
    (about 48 bytes of memory a character). Lines within it are tokenized exactly as before.
    """
    return max(MIN_CUT_CHARS, 1 << (CHARS_PER_TOKEN * span - 1).bit_length())


class LineEncoder:
    """Turns checked JSONL lines into :class:`Example` s as ``data.train_on`` says:
    ``"completion"`` trains assistant turns (with their end-of-turn marker), completions (with
    EOS) and whole ``{"text"}`` lines; ``"all"`` trains every token.

    ``max_chars`` (:func:`cut_chars` of the row; None: no limit) bounds what is rendered and
    tokenized: a line holding more text is cut to that many characters first — a
    conversation's strings before its template renders them, then the rendered (or raw) text
    — and ends without EOS, since its text did not end there. :attr:`cut` counts such lines.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        *,
        train_on: str,
        max_chars: int | None = None,
    ) -> None:
        self.tokenizer, self.template, self.train_all = tokenizer, template, train_on == "all"
        self.max_chars = max_chars
        self.cut = 0
        """Lines cut to ``max_chars`` before tokenizing, so far."""
        self._chat_was_cut = False  # by bounded_chat, for the next example to count

    def encode(self, line: JsonlLine) -> Example:
        """The tokens of one line; DataError (from the template) for a conversation it cannot
        render."""
        if isinstance(line, ChatLine):
            messages, tools = self.bounded_chat(line.messages, line.tools)
            segments = self._chat_template().segments(messages, tools=tools)
            return self._example(segments, special=True)
        if isinstance(line, CompletionLine):
            segments = [Segment(line.prompt, False), Segment(line.completion, True)]
        else:
            assert isinstance(line, TextLine)
            segments = [Segment(line.text, True)]
        return self._example(segments, special=False, eos=True)

    def encode_segments(
        self, segments: Sequence[Segment], *, special: bool, eos: bool = False
    ) -> Example:
        """The :class:`Example` of pieces of text marked trained or not: ``special`` parses
        control tokens (a rendered chat); ``eos`` ends it with EOS, trained as the last piece
        is (a raw-text completion)."""
        return self._example(segments, special=special, eos=eos)

    def bounded_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]] | None]:
        """A conversation cut so that its tools and messages, in that order, cost at most
        ``max_chars`` (:class:`_Budget`): what a template renders first can fill the row,
        what comes after that cannot. Each string is cut to what is left and later messages
        are left out (the first always stays). A conversation within it is returned as is."""
        conversation = [None if tools is None else list(tools), list(messages)]
        if self.max_chars is None or _Budget(self.max_chars).fits(conversation):
            return conversation[1], conversation[0]
        self._chat_was_cut = True
        budget = _Budget(self.max_chars)
        cut_tools = None if tools is None else budget.take(list(tools))
        kept = [budget.message(messages[0])]
        kept += [budget.message(m) for m in messages[1:] if budget.left > 0]
        return kept, cut_tools

    def chat_template(self) -> ChatTemplate:
        """The template conversations are rendered with; ConfigError if there is none."""
        return self._chat_template()

    def _chat_template(self) -> ChatTemplate:
        if self.template is None:
            raise ConfigError(
                "data.chat_template = 'auto' but the model has no chat template "
                "(tokenizer.chat_template) to render the conversations with; set "
                "data.chat_template to one of chatml, llama-3, llama-2"
            )
        return self.template

    def _example(self, segments: Sequence[Segment], *, special: bool, eos: bool = False) -> Example:
        over = self.max_chars is not None and sum(len(s.text) for s in segments) > self.max_chars
        if over:
            segments = _cut_segments(segments, self.max_chars)
        if over or self._chat_was_cut:
            self.cut, self._chat_was_cut, eos = self.cut + 1, False, False
        ids, trained, inexact = trained_tokens(self.tokenizer, segments, special=special)
        tok = self.tokenizer
        if needs_bos(tok, ids):
            ids, trained = [tok.bos_id, *ids], [False, *trained]
        if eos:  # the end of a text or completion is learned, so generation stops there
            ids, trained = [*ids, tok.eos_id], [*trained, segments[-1].trained]
        scored = np.array(trained, dtype=bool) | self.train_all
        scored[:1] = False  # the first token is nobody's target
        return Example(np.array(ids, dtype=np.int64), scored, inexact)


def _cut_segments(segments: Sequence[Segment], max_chars: int) -> list[Segment]:
    """The segments' first ``max_chars`` characters, each piece keeping its class."""
    out, left = [], max_chars
    for s in segments:
        if left <= 0:
            break
        out.append(Segment(s.text[:left], s.trained))
        left -= len(s.text)
    return out


class _Budget:
    """What a conversation may still spend: the characters of its strings, and one for each
    value (so a million empty messages cost a million)."""

    _DEPTH = 64
    """Nesting kept by :meth:`take`; deeper values become empty (no template looks so deep,
    and the walk stays far inside the recursion limit)."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def fits(self, value: Any) -> bool:
        """Whether ``value`` costs at most what is left; walks no further than that."""
        stack = [value]
        while stack:
            item = stack.pop()
            self.left -= 1 + (len(item) if isinstance(item, str) else 0)
            if self.left < 0:
                return False
            if isinstance(item, Mapping):
                stack += item.values()
            elif isinstance(item, list | tuple):
                stack += item
        return True

    def message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """A message spent as :meth:`take` spends it, keeping every key (role, content)."""
        self.left -= 1
        return {key: self.take(item, 1) for key, item in message.items()}

    def take(self, value: Any, depth: int = 0) -> Any:
        """``value`` spent in order: each string cut to what is left, and the items of a list
        or an object left out once nothing is."""
        self.left -= 1
        if isinstance(value, str):
            kept = value[: max(self.left, 0)]
            self.left -= len(kept)
            return kept
        if isinstance(value, Mapping):
            items = value.items() if depth < self._DEPTH else ()
            return {k: self.take(v, depth + 1) for k, v in items if self.left > 0}
        if isinstance(value, list | tuple):
            items = value if depth < self._DEPTH else ()
            return [self.take(item, depth + 1) for item in items if self.left > 0]
        return value


def trained_tokens(
    tokenizer: Tokenizer, segments: Sequence[Segment], *, special: bool
) -> tuple[list[int], list[bool], int]:
    """The tokens of the joined segments, whether each is trained, and how many class
    boundaries a token straddled (the boundary rule of the module docstring)."""
    text = "".join(s.text for s in segments)
    ends, classes, offset = [], [], 0
    for s in segments:
        offset += len(s.text)
        if classes and classes[-1] == s.trained:
            ends[-1] = offset  # the same class goes on: one run
        else:
            ends.append(offset)
            classes.append(s.trained)
    *prefixes, ids = tokenizer.encode_batch([text[:c] for c in ends[:-1]] + [text], special=special)
    trained, start, inexact = [False] * len(ids), 0, 0
    for prefix, cls in zip([*prefixes, ids], classes, strict=True):
        end = max(_common_prefix(prefix, ids), start)
        inexact += end != len(prefix)
        trained[start:end] = [cls] * (end - start)
        start = end
    return ids, trained, inexact


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def read_examples(
    paths: Sequence[Path],
    encoder: LineEncoder,
    bad: BadLines,
    *,
    format: str = "jsonl",
    layout: str = "auto",
    mixed: MixedRows | None = None,
) -> list[Example]:
    """Every usable line (or table row: ``format``) of ``paths`` encoded, in order; ``bad``
    decides about the others (a line that does not parse, or that its template cannot
    render). ``layout``: ``data.layout``; ``mixed`` counts the rows read that fit several
    layouts. A template at fault whatever the line (:class:`TemplateFault`: over its budget,
    unsafe, or failing on a plain conversation too) stops the reading at the first line it
    failed on, whatever ``data.on_bad_line`` says: skipping would skip every conversation."""
    examples = []
    for path in paths:
        for number, line in numbered_rows(path, format, bad):
            bad.line_read(path)
            try:
                row = row_of(line)
                parsed = parse_line(row, need_assistant=not encoder.train_all, layout=layout)
                examples.append(encoder.encode(parsed))
            except TemplateFault as fault:
                raise TemplateFault(f"{path}:{number}: {fault}") from None
            except DataError as problem:
                bad.bad(path, number, problem)
                continue
            if mixed is not None:
                mixed.check(row, layout, f"{path}:{number}")
    if not examples:
        names = ", ".join(str(p) for p in paths)
        raise DataError(f"no usable example in {names}; see the lines skipped above")
    return examples


def split_examples(
    examples: Sequence[Example], val_fraction: float
) -> tuple[list[Example], list[Example]]:
    """Training examples and the last ``val_fraction`` of them (whole examples) held out."""
    n_val = round(len(examples) * val_fraction)
    if val_fraction > 0 and not 0 < n_val < len(examples):
        raise DataError(
            f"data.val_fraction = {val_fraction:g} of {len(examples)} examples holds out "
            f"{n_val}, leaving {len(examples) - n_val} to train on; both need at least one: "
            "change val_fraction (0 = no validation) or add examples"
        )
    return list(examples[: len(examples) - n_val]), list(examples[len(examples) - n_val :])


def truncate(examples: Sequence[Example], span: int) -> tuple[list[Example], int, int]:
    """Examples cut to ``span`` tokens; also how many were cut, and how many were left out
    because they score no token once cut — those the cut left nothing trained, and those
    that had none (a one-token text): a row that scores nothing teaches nothing, and a batch
    of such rows has no loss to average."""
    kept, cut, unscored = [], 0, 0
    for ex in examples:
        if len(ex.ids) > span:
            cut += 1
            ex = Example(ex.ids[:span], ex.scored[:span], ex.inexact)
        if not ex.scored.any():
            unscored += 1
            continue
        kept.append(ex)
    return kept, cut, unscored


def require_trainable(kept: Sized, span: int, what: str) -> None:
    """Refuse a run that has nothing to train on before it starts: when every example (or
    preference pair: ``what``) was left out for scoring no token within a row of ``span``
    tokens, the first step would divide a loss by no targets after the model was built."""
    if not len(kept):
        raise DataError(
            f"no {what} keeps a trained token within data.n_ctx + 1 = {span} tokens, so "
            "there is nothing to train on; raise data.n_ctx (or shorten the prompts)"
        )


class ExampleRows:
    """Training or validation rows of examples, served like ``TokenWindows`` are (to the
    ``BatchSampler`` and ``val_batches``): ``batch(indices)`` gives ``(inputs, targets,
    documents)``, documents None when each row holds one example (its padding only follows
    it, which causal attention never looks at)."""

    def __init__(
        self,
        tokens: np.ndarray,
        scored: np.ndarray,
        filled: np.ndarray,
        documents: np.ndarray | None,
    ) -> None:
        self.tokens, self.scored, self.filled, self.documents = tokens, scored, filled, documents

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, indices: np.ndarray) -> Batch:
        """Inputs, targets and documents (None unless packed), each ``(len(indices), n_ctx)``."""
        rows = torch.from_numpy(self.tokens[indices])
        scored = torch.from_numpy(self.scored[indices])
        targets = torch.where(scored[:, 1:], rows[:, 1:], IGNORE_INDEX)
        documents = None
        if self.documents is not None:
            documents = torch.from_numpy(self.documents[indices][:, :-1])
        return Batch(rows[:, :-1].contiguous(), targets, documents)

    def seen_tokens(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the rows hold, padding left out."""
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[torch.from_numpy(np.unique(self.tokens[self.filled]))] = True
        return seen


def pack_rows(examples: Sequence[Example], span: int, pad_id: int) -> ExampleRows:
    """Whole examples (each at most ``span`` tokens) laid into rows of ``span`` in order, a
    new row when the next does not fit; each example, and the padding, its own document."""
    rows: list[list[Example]] = [[]]
    used = 0
    for ex in examples:
        if used + len(ex.ids) > span:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += len(ex.ids)
    return _rows(rows, span, pad_id, with_documents=True)


def pad_rows(examples: Sequence[Example], span: int, pad_id: int) -> ExampleRows:
    """One example (at most ``span`` tokens) per row, padded to ``span``."""
    return _rows([[ex] for ex in examples], span, pad_id, with_documents=False)


def _rows(
    groups: list[list[Example]], span: int, pad_id: int, *, with_documents: bool
) -> ExampleRows:
    """Rows holding each group's examples one after the other, then padding."""
    tokens = np.full((len(groups), span), pad_id, dtype=np.int64)
    scored = np.zeros((len(groups), span), dtype=bool)
    filled = np.zeros((len(groups), span), dtype=bool)
    documents = np.zeros((len(groups), span), dtype=np.int64)
    for r, group in enumerate(groups):
        start = 0
        for doc, ex in enumerate(group):
            end = start + len(ex.ids)
            tokens[r, start:end], scored[r, start:end] = ex.ids, ex.scored
            filled[r, start:end], documents[r, start:end] = True, doc
            start = end
        documents[r, start:] = len(group)  # the padding: a document of its own
    return ExampleRows(tokens, scored, filled, documents if with_documents else None)
