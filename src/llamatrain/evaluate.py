"""How well a model predicts text: validation during training, perplexity afterwards.

Two measures, because the field uses both. :func:`validation_metrics` is what the trainer
reports on its held-out windows (mean next-token loss, its perplexity, next-token accuracy,
like ``llama-finetune``). :func:`perplexity` is ``llama-perplexity``'s number, computed its way,
so a figure from ``llamatrain eval`` compares with one from llama.cpp.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llamatrain import parallel
from llamatrain.data import Batch, check_text_file, read_text
from llamatrain.errors import DataError
from llamatrain.model import Llama
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.tokenizer import Tokenizer

CHUNK_LOGITS = 4 << 20
"""Bytes of float32 logits validation computes at once (32 rows of a 32000-piece vocabulary):
a quarter of the fused training loss's chunk, which needs larger chunks to amortise its
weight-gradient work; validation has none, so smaller chunks cost it nothing measurable."""


@torch.no_grad()
def validation_metrics(
    model: Llama,
    batches: Iterable[tuple[torch.Tensor, ...]],
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
) -> dict[str, float]:
    """Mean loss, perplexity and next-token accuracy over the scored targets of ``batches``
    (``llamatrain.data.Batch``; targets -100 are not scored), each batch weighted by its
    scored count."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    try:
        for batch in (Batch(*b) for b in batches):  # a plain (inputs, targets[, documents]) too
            inputs, targets = batch.inputs.to(device), batch.targets.to(device)
            documents = None if batch.documents is None else batch.documents.to(device)
            with autocast or contextlib.nullcontext(), parallel.root_weights(model):
                hidden = model.hidden_states(inputs, documents=documents)
                sums = _head_scores(model, hidden, targets)
            loss_sum, correct, count = loss_sum + sums[0], correct + sums[1], count + sums[2]
    finally:
        model.train(was_training)
    val_loss = loss_sum / max(count, 1)
    return {
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 700.0)),
        "val_acc": correct / max(count, 1),
    }


def _head_scores(
    model: Llama, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[float, int, int]:
    """Summed loss, correct next-token guesses and scored count of one batch, taking the lm
    head :data:`CHUNK_LOGITS` bytes of logits at a time: a whole batch's (tokens x vocab)
    logits and the log-softmax beside them would be the largest tensors of the run, and
    validation would set a peak memory no training step reaches."""
    rows = max(1, CHUNK_LOGITS // (model.cfg.vocab_size * 4))
    loss_sum, correct, count = 0.0, 0, 0
    pairs = zip(hidden.flatten(0, -2).split(rows), targets.flatten().split(rows), strict=True)
    for h, t in pairs:
        scored = t != IGNORE_INDEX
        n_scored = int(scored.sum())
        if n_scored == 0:
            continue
        logits = model.head_logits(h).float()  # soft-capped as the model's
        loss_sum += F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum").item()
        correct += int(((logits.argmax(-1) == t) & scored).sum())
        count += n_scored
    return loss_sum, correct, count


@dataclass
class PerplexityResult:
    """Two views of how well a model predicts a text."""

    perplexity: float  # llama-perplexity's method
    mean_loss: float  # every next-token prediction inside the chunks
    mean_ppl: float
    n_tokens: int
    n_chunks: int
    n_ctx: int


@torch.no_grad()
def perplexity(
    model: Llama, tokenizer: Tokenizer, path: str | Path, n_ctx: int | None = None
) -> PerplexityResult:
    """Perplexity computed exactly as llama.cpp's ``llama-perplexity`` does.

    The text is tokenized as the model file says (``Tokenizer.encode_prompt``, control tokens
    not parsed: BOS first only where ``tokenizer.ggml.add_bos_token`` says so) and cut into
    non-overlapping chunks of ``n_ctx``; where the file adds BOS, each chunk's first token is
    replaced by BOS. Only the second half of each chunk is scored, so every scored token has
    at least n_ctx/2 tokens of context. ``mean_loss`` also scores the first half (plain mean
    next-token loss over the chunks). (llama-perplexity refuses a vocabulary that adds EOS;
    here that EOS ends the text.)

    Each target's log-probability comes from the model's chunked head (``head_logps``), so
    a chunk's (n_ctx x vocab) logits never exist: at a real model's own context (SmolLM2's
    8192 x 49,152) they, in float64 as llama-perplexity sums them, would be 3.2 GB.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist; pass a UTF-8 text file to score with --data")
    check_text_file(path)
    n_ctx = n_ctx or model.cfg.max_seq_len
    tokens = tokenizer.encode_prompt(read_text(path), special=False)
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 1:
        raise DataError(
            f"{path} has {len(tokens)} tokens, fewer than one chunk of n_ctx = {n_ctx}; "
            "use a longer text or a smaller --n-ctx"
        )
    model.eval()
    first = n_ctx // 2
    nll_second_half, nll_all = 0.0, 0.0
    for i in range(n_chunks):
        chunk = torch.tensor(tokens[i * n_ctx : (i + 1) * n_ctx])
        if tokenizer.add_bos:
            chunk[0] = tokenizer.bos_id
        nll = -model(chunk[None, :-1], logps_of=chunk[None, 1:])[0].double()
        nll_second_half += nll[first:].sum().item()
        nll_all += nll.sum().item()
    scored = n_chunks * (n_ctx - 1 - first)
    mean_loss = nll_all / (n_chunks * (n_ctx - 1))
    return PerplexityResult(
        perplexity=math.exp(nll_second_half / scored),
        mean_loss=mean_loss,
        mean_ppl=math.exp(mean_loss),
        n_tokens=len(tokens),
        n_chunks=n_chunks,
        n_ctx=n_ctx,
    )
