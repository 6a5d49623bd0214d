"""Training text → token stream → windows → batches.

Each step lives in its own module:

- :mod:`~llamatrain.data.sources` turns ``data.path`` into checked text files;
  :mod:`~llamatrain.data.shakespeare` provides the downloadable default corpus.
- :mod:`~llamatrain.data.cache` tokenizes the files once into a memory-mapped stream.
- :mod:`~llamatrain.data.windows` cuts the stream into training and validation windows and
  draws shuffled, resumable batches.
- ``data.format = "jsonl"`` (or ``"parquet"``, ``"hf"``: tables of the same rows,
  :func:`~llamatrain.data.sources.table_rows`) instead reads instruction and chat examples
  (:mod:`~llamatrain.data.jsonl`; Alpaca and ShareGPT rows mapped by
  :mod:`~llamatrain.data.layouts`), renders conversations with a chat template
  (:mod:`~llamatrain.chat_template`) and lays the tokens into rows whose targets score
  only what is trained (:mod:`~llamatrain.data.examples`, encoded once into the cache of
  :mod:`~llamatrain.data.example_cache`); the same sampler draws them.
- A preference objective (``train.objective`` dpo, ipo, orpo, simpo) reads JSONL pairs of a
  chosen and a rejected reply (:mod:`~llamatrain.data.preferences`), laid whole into rows.
- GRPO (``train.objective = "grpo"``) reads prompt rows (:mod:`~llamatrain.data.prompts`):
  the prompts' tokens and the columns its reward functions read; the sampler draws prompts.

:func:`build_train_data` wires them together the way ``cfg.data`` says.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llamatrain.chat_template import ChatTemplate, resolve_chat_template
from llamatrain.data.cache import load_tokens
from llamatrain.data.example_cache import load_examples
from llamatrain.data.examples import (
    ExampleRows,
    LineEncoder,
    cut_chars,
    pack_rows,
    pad_rows,
    require_trainable,
    split_examples,
    truncate,
)
from llamatrain.data.jsonl import BadLines
from llamatrain.data.layouts import MixedRows
from llamatrain.data.preferences import (
    DegeneratePairs,
    PairEncoder,
    cut_pairs,
    pair_rows,
    read_pairs,
)
from llamatrain.data.prompts import PromptEncoder, PromptRows, read_prompts
from llamatrain.data.sources import (
    SHAKESPEARE,
    SONNETS,
    SONNETS_PATH,
    check_text_file,
    read_text,
    resolve_inputs,
)
from llamatrain.data.windows import (
    Batch,
    BatchSampler,
    TokenWindows,
    line_end_ids,
    split_windows,
    val_batches,
)
from llamatrain.errors import LlamatrainWarning
from llamatrain.tools.loading import load as load_tools

if TYPE_CHECKING:
    from llamatrain.config import Config
    from llamatrain.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "SHAKESPEARE",
    "SONNETS",
    "SONNETS_PATH",
    "BatchSampler",
    "ExampleRows",
    "PromptRows",
    "TokenWindows",
    "TrainData",
    "build_train_data",
    "check_text_file",
    "load_tokens",
    "read_text",
    "resolve_inputs",
    "split_windows",
    "val_batches",
]


_SEEN_SLICE = 1 << 22
"""Tokens ``TrainData.seen_tokens`` counts at once (np.bincount widens them: 32 MiB a slice)."""


@dataclass
class TrainData:
    """The data side of a run: files, token stream, windows and the batch sampler; for JSONL
    data, rows of examples in place of the stream and its windows."""

    paths: list[Path]
    tokens: np.ndarray | None
    """The token stream of text data; None for JSONL (the rows hold the tokens)."""
    train: TokenWindows | ExampleRows | PromptRows
    val: TokenWindows | ExampleRows | PromptRows | None
    sampler: BatchSampler
    n_seq: int
    """Windows per batch: ``train.n_batch // data.n_ctx`` (GRPO: prompts, each sampled
    ``train.num_generations`` times to fill them)."""
    chat_template: ChatTemplate | None = None
    """The template conversations were rendered with (JSONL data), for the run to keep."""

    def val_batches(self, max_batches: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        """The first ``max_batches`` (0 = all) validation batches; see :func:`val_batches`."""
        return val_batches(self.val, self.n_seq, max_batches)

    def seen_tokens(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the training windows hold (BOS included when windows
        start with it); the held-out validation part does not count.

        Counted in slices of the memory-mapped stream, in one pass and without sorting, so a
        corpus of billions of tokens costs a linear scan and a few MB, not a sorted copy.
        """
        if self.tokens is None:  # JSONL: the rows hold the tokens
            return self.train.seen_tokens(vocab_size)
        last = int(self.train.start_positions(np.array([len(self.train) - 1]))[0])
        end = last + self.train.span
        counts = np.zeros(vocab_size, dtype=np.int64)
        for start in range(0, end, _SEEN_SLICE):
            part = self.tokens[start : min(start + _SEEN_SLICE, end)]
            counts += np.bincount(part, minlength=vocab_size)[:vocab_size]
        seen = torch.from_numpy(counts > 0)
        if self.train.bos_id is not None:
            seen[self.train.bos_id] = True
        return seen


def build_train_data(
    cfg: Config,
    tokenizer: Tokenizer,
    *,
    paths: Iterable[Path] | None = None,
    progress: bool | None = None,
    model_template: str | None = None,
    tools: Sequence[str | Callable[..., Any]] | None = None,
) -> TrainData:
    """Resolve, tokenize (cached), window and batch the data that ``cfg`` describes.

    Pass ``paths`` when they were already resolved (e.g. to train the tokenizer first).
    With ``data.bos_prefix`` every window starts with BOS, so documents in the stream do not;
    without it, each document does (see :mod:`~llamatrain.data.cache`). ``model_template``:
    the model's own chat template (``tokenizer.chat_template``), for JSONL conversations.
    ``tools``: GRPO's tools given in Python, in place of ``train.tools`` (their schemas go
    into the prompts).
    """
    d = cfg.data
    if paths is None:
        paths = resolve_inputs(d.path, d.cache_dir, format=d.format)
    paths = list(paths)
    if cfg.train.objective == "grpo":
        return _prompt_data(cfg, tokenizer, paths, model_template, tools)
    if cfg.train.objective != "sft":
        return _preference_data(cfg, tokenizer, paths, model_template)
    if d.format != "text":  # examples: JSONL lines, Parquet or HF datasets rows
        return _jsonl_data(cfg, tokenizer, paths, model_template)
    tokens = load_tokens(
        paths, tokenizer, d.cache_dir, doc_bos=not d.bos_prefix, doc_eos=True, progress=progress
    )
    train, val = split_windows(
        tokens,
        n_ctx=d.n_ctx,
        val_fraction=d.val_fraction,
        sample_start=d.sample_start,
        stride=d.stride,
        bos_id=tokenizer.bos_id if d.bos_prefix else None,
        line_ends=line_end_ids(tokenizer) if d.sample_start == "newline" else None,
    )
    n_seq = cfg.seqs_per_batch
    return TrainData(paths, tokens, train, val, BatchSampler(train, n_seq, cfg.train.seed), n_seq)


def _jsonl_data(
    cfg: Config, tokenizer: Tokenizer, paths: list[Path], model_template: str | None
) -> TrainData:
    """Examples read, encoded, cut to a row, split and laid into rows as ``cfg.data`` says;
    skipped lines, rows that fit several layouts and cut examples are reported as one warning
    each."""
    d = cfg.data
    template = resolve_chat_template(d.chat_template, model_template, tokenizer)
    bad = BadLines(d.on_bad_line)
    span = d.n_ctx + 1
    encoder = LineEncoder(tokenizer, template, train_on=d.train_on, max_chars=cut_chars(span))
    mixed = MixedRows()
    examples = load_examples(
        paths, encoder, bad, d.cache_dir, format=d.format, layout=d.layout, mixed=mixed
    )  # cached before they are cut to a row
    examples, cut, unscored = truncate(examples, span)
    notes = bad.summaries() + mixed.notes()
    notes += _truncation_notes(cut, unscored, span) + _cut_text_notes(encoder)
    inexact = sum(ex.inexact for ex in examples)
    if inexact:
        notes.append(
            f"{inexact} trained/untrained boundaries fell inside a token; each such token was "
            "counted with the text after it"
        )
    for note in notes:
        warnings.warn(note, LlamatrainWarning, stacklevel=3)
    require_trainable(examples, span, "example")
    train_examples, val_examples = split_examples(examples, d.val_fraction)
    rows = pack_rows if d.packing else pad_rows
    train = rows(train_examples, span, tokenizer.eos_id)
    val = rows(val_examples, span, tokenizer.eos_id) if val_examples else None
    n_seq = cfg.seqs_per_batch
    sampler = BatchSampler(train, n_seq, cfg.train.seed)
    return TrainData(paths, None, train, val, sampler, n_seq, chat_template=template)


def _preference_data(
    cfg: Config, tokenizer: Tokenizer, paths: list[Path], model_template: str | None
) -> TrainData:
    """Preference pairs read, encoded, cut to a row, split (whole pairs) and laid into rows;
    skipped lines and cut pairs are reported as one warning each."""
    d = cfg.data
    template = resolve_chat_template(d.chat_template, model_template, tokenizer)
    bad = BadLines(d.on_bad_line)
    span = d.n_ctx + 1
    lines = LineEncoder(tokenizer, template, train_on="completion", max_chars=cut_chars(span))
    degenerate = DegeneratePairs()
    pairs, cut, dropped = cut_pairs(read_pairs(paths, PairEncoder(lines), bad, degenerate), span)
    notes = bad.summaries() + _cut_text_notes(lines) + [n for n in [degenerate.note()] if n]
    if cut:
        lost = f"; {dropped} of them lost a whole reply and were left out" if dropped else ""
        notes.append(
            f"{cut} preference pairs were longer than data.n_ctx + 1 = {span} tokens (the "
            f"prompt once + both replies), cut to it{lost}"
        )
    for note in notes:
        warnings.warn(note, LlamatrainWarning, stacklevel=3)
    require_trainable(pairs, span, "preference pair")
    train_pairs, val_pairs = split_examples(pairs, d.val_fraction)
    train = pair_rows(train_pairs, span, tokenizer.eos_id, packing=d.packing)
    val = pair_rows(val_pairs, span, tokenizer.eos_id, packing=d.packing) if val_pairs else None
    n_seq = cfg.seqs_per_batch
    sampler = BatchSampler(train, n_seq, cfg.train.seed)
    return TrainData(paths, None, train, val, sampler, n_seq, chat_template=template)


def _prompt_data(
    cfg: Config,
    tokenizer: Tokenizer,
    paths: list[Path],
    model_template: str | None,
    given_tools: Sequence[str | Callable[..., Any]] | None = None,
) -> TrainData:
    """GRPO's prompt rows read and encoded, split (the last ``data.val_fraction`` held out,
    their greedy completions scored at each evaluation); each batch is ``n_batch / n_ctx /
    num_generations`` prompts. Skipped rows and prompts too long are reported as one warning
    each."""
    d, t = cfg.data, cfg.train
    template = resolve_chat_template(d.chat_template, model_template, tokenizer)
    bad = BadLines(d.on_bad_line)
    span, room = d.n_ctx + 1, t.max_completion_length
    specs = t.tools if given_tools is None else given_tools
    tools = [tool.schema for tool in load_tools(specs)] if specs else None
    encoder = PromptEncoder(tokenizer, template, tools)
    rows, too_long = read_prompts(paths, encoder, bad, format=d.format, span=span, room=room)
    notes = bad.summaries()
    if too_long:
        notes.append(
            f"{too_long} prompts were longer than data.n_ctx + 1 - train.max_completion_length "
            f"= {span - room} tokens (no room left for a completion) and were left out"
        )
    for note in notes:
        warnings.warn(note, LlamatrainWarning, stacklevel=3)
    train_rows, val_rows = split_examples(rows, d.val_fraction)
    n_prompts = cfg.seqs_per_batch // t.num_generations
    sampler = BatchSampler(PromptRows(train_rows), n_prompts, t.seed)
    val = PromptRows(val_rows) if val_rows else None
    return TrainData(paths, None, sampler.windows, val, sampler, n_prompts, template)


def _cut_text_notes(encoder: LineEncoder) -> list[str]:
    """The one line that reports lines cut before tokenizing (they held more text than a
    row can take: :func:`~llamatrain.data.examples.cut_chars`), if any were."""
    if not encoder.cut:
        return []
    return [
        f"{encoder.cut} lines held more than {encoder.max_chars:,} characters, more than a row "
        "of data.n_ctx tokens can take; they were cut to that before tokenizing"
    ]


def _truncation_notes(cut: int, unscored: int, span: int) -> list[str]:
    """The lines that report examples cut to a row and examples left out for scoring no
    token within it (:func:`~llamatrain.data.examples.truncate`), if any were."""
    notes = []
    if cut:
        notes.append(f"{cut} examples were longer than data.n_ctx + 1 = {span} tokens, cut to it")
    if unscored:
        notes.append(
            f"{unscored} examples had no trained token within data.n_ctx + 1 = {span} tokens "
            "and were left out"
        )
    return notes
