"""Prompt rows for GRPO: ``{"prompt": …, <column>: …}`` → the prompt's tokens and its columns.

A row (a JSONL line, or a Parquet / HF ``datasets`` row: ``data.format``) holds a ``prompt``,
raw text or a conversation (a list of ``{"role", "content"}`` messages), and any other columns.
Text is tokenized as a ``{"prompt", "completion"}`` line's prompt is (BOS first when the
tokenizer adds one); a conversation is rendered with the chat template and its generation
prompt (``<|im_start|>assistant\\n``), as ``llamatrain chat`` prompts the model, and tokenized
with its control tokens. The completions are sampled after it
(``llamatrain.objectives.grpo.rollout``).

Every other column is the reward functions' (``llamatrain.objectives.grpo.rewards``: an
``answer`` column is the usual ground truth), handed over as read: a table's null stays
``None``. The prompt itself goes to them as TRL hands it: the text, or the message list. A row
whose prompt leaves no room for a completion in a row of ``data.n_ctx + 1`` tokens is left out
and counted, as a too-long SFT example is cut and counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llamatrain.chat_template import ChatTemplate, needs_bos, prompt_ids
from llamatrain.data.json_text import load_json
from llamatrain.data.jsonl import BadLines, _chat_line, _json_type, numbered_rows
from llamatrain.errors import ConfigError, DataError
from llamatrain.tokenizer import Tokenizer
from llamatrain.tools.template_tools import tool_variables

__all__ = ["PromptRow", "PromptRows", "read_prompts"]

_SHAPE = '{"prompt": "text" or [{"role", "content"}, ...], "answer"?: ..., ...}'


@dataclass(frozen=True)
class PromptRow:
    """One usable row: its prompt's token ids, the prompt as the reward functions get it
    (text or messages), and its other columns."""

    ids: tuple[int, ...]
    prompt: str | list[dict[str, Any]]
    columns: Mapping[str, Any]


class PromptRows:
    """A run's prompt rows, drawn by index (``llamatrain.data.windows.BatchSampler``)."""

    def __init__(self, rows: Sequence[PromptRow]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def batch(self, indices: np.ndarray) -> list[PromptRow]:
        """The rows ``indices``, in order."""
        return [self.rows[int(i)] for i in indices]

    def seen_tokens(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the prompts hold."""
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        for row in self.rows:
            seen[list(row.ids)] = True
        return seen


class PromptEncoder:
    """A row's prompt as tokens: text as a completion line's prompt, messages rendered with
    ``template`` and its generation prompt (ConfigError at the first conversation if there
    is no template). With ``tools`` (GRPO's ``train.tools``, their JSON schemas) the
    template renders them too, and a prompt must be messages: a text prompt has no place to
    tell the model of them (DataError, a bad row)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer, self.template, self.tools = tokenizer, template, tools

    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        tok = self.tokenizer
        if isinstance(prompt, str):
            if self.tools:
                raise DataError(
                    "with train.tools a prompt is a list of messages (the chat template "
                    "renders the tools with them), not text"
                )
            ids = tok.encode(prompt)
            return [tok.bos_id, *ids] if needs_bos(tok, ids) else ids
        if self.template is None:
            raise ConfigError(
                "data.chat_template = 'auto' but the model has no chat template "
                "(tokenizer.chat_template) to render the prompts' messages with; set "
                "data.chat_template to one of chatml, llama-3, llama-2"
            )
        shown = tool_variables(self.template.source, self.tools)
        text = self.template.render(prompt, add_generation_prompt=True, **shown)
        return prompt_ids(tok, text)


def parse_prompt_row(line: str | Mapping[str, Any]) -> tuple[str | list[dict], dict[str, Any]]:
    """(prompt, other columns) of one JSONL line or table row; DataError saying what is
    wrong."""
    value = load_json(line) if isinstance(line, str) else dict(line)
    if not isinstance(value, dict):
        raise DataError(f"a line must be a JSON object {_SHAPE}, not {_json_type(value)}")
    prompt = value.pop("prompt", None)
    if isinstance(prompt, list):
        prompt = [dict(m) for m in _chat_line(prompt, False, field="prompt").messages]
    elif not isinstance(prompt, str):
        raise DataError(
            f'a prompt row needs a "prompt", text or a list of messages, got {_json_type(prompt)}'
        )
    return prompt, value


def read_prompts(
    paths: Sequence[Path],
    encoder: PromptEncoder,
    bad: BadLines,
    *,
    format: str,
    span: int,
    room: int,
) -> tuple[list[PromptRow], int]:
    """Every usable row of ``paths`` (``format``: jsonl, parquet, hf), in order, and how many
    were left out for a prompt longer than ``span - room`` tokens (``room``: the completion's
    ``train.max_completion_length``); ``bad`` decides about rows that do not parse."""
    rows, too_long = [], 0
    for path in paths:
        for number, line in numbered_rows(path, format, bad):
            bad.line_read(path)
            try:
                prompt, columns = parse_prompt_row(line)
                ids = encoder.encode(prompt)
            except DataError as problem:
                bad.bad(path, number, problem)
                continue
            if len(ids) > span - room:
                too_long += 1
                continue
            rows.append(PromptRow(tuple(ids), prompt, columns))
    if too_long and not rows:
        raise DataError(
            f"all {too_long} prompts are longer than data.n_ctx + 1 - "
            f"train.max_completion_length = {span - room} tokens, leaving no room for a "
            "completion; raise data.n_ctx or lower train.max_completion_length"
        )
    if not rows:
        names = ", ".join(str(p) for p in paths)
        raise DataError(f"no usable prompt row in {names}; see the lines skipped above")
    return rows, too_long
