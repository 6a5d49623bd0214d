"""GRPO's rollouts: completions sampled from the model being trained, laid into rows for the
loss, with what the ranks exchange of them.

Completions come from our own KV-cache decoder (``llamatrain.decoding``, through
:mod:`.turns`) on the very weights, LoRA adapters on: no second copy, no weight sync. Sampling is
temperature only (top-k, top-p and min-p off), so a sampled token's log-prob is the training
forward's ``log_softmax(logits / temperature)`` (TRL's convention). A completion ends at its
first stop token (EOS, the chat template's end-of-turn token, or Llama 3.1's end of message
``<|eom_id|>``), included; one without is truncated at ``max_completion_length``. With
``train.tools`` a stop token may instead end a turn whose tool calls are run and answered
(:mod:`.tool_turns`): the completion goes on after the answer, whose tokens the loss never
sees (the rows' ``mask``).

A step's rows (this rank's share) decode as one batch, prompts of every length and their
groups together: each row's rope positions are its own and the cache slots it leaves empty are
masked out of every attention, so each row's logits are its unpadded decode's, to float
rounding. Each row's sampler is seeded by ``(train.seed, step, its index in the step)``: a row
draws what it would in any batch, so a resumed run draws what the uninterrupted run drew, with
no generator state to store, and a row draws alike on any number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from llamatrain import parallel
from llamatrain.chat_template import ChatTemplate
from llamatrain.errors import DataError
from llamatrain.fused_decode import fused_decoding
from llamatrain.lora import decoded_base, kernels_serve
from llamatrain.memory import available_memory
from llamatrain.model import Llama
from llamatrain.objectives.grpo.loss import mask_truncated
from llamatrain.objectives.grpo.turns import Completion, Responder, decode_turns
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer

__all__ = [
    "MESSAGE_ENDS",
    "Rollout",
    "Scored",
    "completion_metrics",
    "loss_mask",
    "sample_completions",
    "scored_logps",
    "stop_ids",
    "training_rows",
]


@dataclass(frozen=True)
class Rollout:
    """One step's completions laid into rows for the loss, this rank's: ``inputs`` and
    ``targets`` (N, L) (a row is prompt + completion, targets the completion's tokens, -100
    elsewhere), ``mask`` (N, L) the targets that count, ``advantages`` (N,), the old policy's
    and the reference's log-probs of the targets when used. The whole step's, over every
    rank: ``batch_tokens`` (the counted targets, dapo's divisor), ``completion_tokens`` (every
    completion's, its throughput), the metrics (TRL's names) and the table (prompt,
    completion, rewards, advantage), a row each completion."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    batch_tokens: float
    completion_tokens: int
    metrics: dict[str, float]
    table: list[dict[str, Any]]


@dataclass(frozen=True)
class Scored:
    """What one rank sampled and scored, as the ranks exchange it: (n, F) rewards (NaN:
    None), the prompts as the reward functions got them, the completions' texts, lengths
    (the model's tokens, the stop token counted, tool tokens not: TRL's) and whether each was
    truncated, the targets it counts for the loss, and with tools (an environment) each row's
    counts of calls (replies): ``multi_turn.Turns.counts``."""

    table: torch.Tensor
    prompts: list[Any]
    texts: list[str]
    lengths: list[int]
    truncated: list[bool]
    counted: float
    turns: torch.Tensor | None = None

    @staticmethod
    def gathered(mine: Scored) -> Scored:
        """Every rank's, in rank order (the rows' order on one process)."""
        parts = parallel.each_rank(mine)
        return Scored(
            torch.cat([p.table for p in parts]),
            [prompt for p in parts for prompt in p.prompts],
            [text for p in parts for text in p.texts],
            [n for p in parts for n in p.lengths],
            [t for p in parts for t in p.truncated],
            sum(p.counted for p in parts),
            None if mine.turns is None else torch.cat([p.turns for p in parts]),
        )


MESSAGE_ENDS = ("<|eom_id|>",)
"""Tokens that end an assistant message short of its turn's end, stops wherever the vocabulary
has them: Llama 3.1's ``<|eom_id|>``, which its model writes after a call
(``<|python_tag|>{"name": …, "parameters": …}<|eom_id|>``) and its template after a call in its
ipython mode. llama.cpp counts every vocabulary's ``<|eom_id|>`` token among its
end-of-generation tokens (src/llama-vocab.cpp), so ``llama-server`` stops there and parses the
call; a rollout must too, or it samples on past the call and never runs it."""


def stop_ids(tokenizer: Tokenizer, template: ChatTemplate | None) -> frozenset[int]:
    """What ends a completion (or, with tools, a turn): EOS, and with a chat template its
    end-of-turn marker when it is one token (``<|im_end|>``), as ``llamatrain chat`` stops, and
    the :data:`MESSAGE_ENDS` that are one token of the vocabulary."""
    ids = {tokenizer.eos_id}
    if template is None:  # plain-text prompts: the model ends at EOS
        return frozenset(ids)
    markers = list(MESSAGE_ENDS)
    with contextlib.suppress(DataError):  # a template ending turns with EOS alone
        markers.append(template.end_of_turn)
    for marker in markers:
        token = tokenizer.encode(marker, special=True)
        ids |= set(token) if len(token) == 1 else set()
    return frozenset(ids)


@contextlib.contextmanager
def _evaluating(model: Llama) -> Iterator[None]:
    """The model in eval mode (no adapter dropout) for sampling; its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def sample_completions(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams,
    stops: frozenset[int],
    seeds: Callable[[int], int],
    *,
    autocast: contextlib.AbstractContextManager | None = None,
    progress: bool = False,
    responder: Responder | None = None,
) -> list[Completion]:
    """Each prompt's completion: its sampled tokens up to and including its first stop token
    (all ``max_new_tokens`` when none came), or with a ``responder`` (the tools) its turns and
    the answers between them (:func:`~.turns.decode_turns`). The prompts, of any lengths,
    decode as one batch, prompt i's sampler seeded by ``seeds(i)``; a progress bar counts
    finished completions.

    One batch, not batches of a bounded size: it holds every row's KV cache at once (rows x
    (longest prompt + ``max_new_tokens``) positions, more when answers leave some rows' slots
    empty) and its prompt pass the (rows, longest prompt, vocab) logits, as a step whose
    prompts share one length always did; the training step that follows holds the same rows'
    activations."""
    if not prompts:
        return []
    bar = tqdm(
        total=len(prompts), desc="rollout", unit="completion", leave=False, disable=not progress
    )
    row_seeds = [seeds(i) for i in range(len(prompts))]
    with _evaluating(model), _decoding_autocast(model, len(prompts), autocast), bar:
        budget = _decoding_budget(model, len(prompts))  # under the rollout's autocast
        with decoded_base(model, budget), fused_decoding(model):
            return decode_turns(
                model,
                prompts,
                max_new_tokens,
                params,
                stops,
                row_seeds,
                responder,
                ended=lambda _row: bar.update(1),
            )


def _decoding_autocast(
    model: Llama, rows: int, autocast: contextlib.AbstractContextManager | None
) -> contextlib.AbstractContextManager:
    """The autocast a rollout decodes under: the training step's, except where the quantized
    kernels multiply every stored weight in float32 at ``rows`` rows (``lora.kernels_serve``,
    asked outside any autocast). Those compute in float32 whatever the autocast (under bf16
    their results were only cast down and back up), and the C++ decoding step
    (:mod:`~llamatrain.fused_decode`) serves float32 alone: on a CPU with AMX, where a QLoRA
    run trains in bf16 by default, its rollouts otherwise decoded layer by layer in PyTorch."""
    if autocast is None or kernels_serve(model, rows):
        return contextlib.nullcontext()
    return autocast


def _decoding_budget(model: Llama, rows: int) -> int | None:
    """What a rollout of ``rows`` rows may spend holding its model's stored weights decoded
    (``lora.decoded_base``): none where the quantized kernels multiply every stored weight at
    that many rows (``lora.kernels_serve``: faster over the blocks, and the base stays the
    file's size at every model size); else half the memory this process may still take, on
    the CPU, where a decode per token costs most of a rollout; elsewhere none (a GPU decodes
    at its bandwidth, and its memory is the training step's)."""
    if next(model.parameters()).device.type != "cpu" or kernels_serve(model, rows):
        return None
    available = available_memory()
    return None if available is None else available // 2


def training_rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) (N, L), L the longest row less one: row i is prompt + completion
    shifted by one, its targets the completion's tokens (-100 on the prompt and padding)."""
    rows = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows) - 1
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, len(prompt) - 1 : len(row) - 1] = torch.tensor(row[len(prompt) :])
    return inputs, targets


def loss_mask(
    targets: torch.Tensor,
    completions: Sequence[Completion],
    truncated: torch.Tensor,
    mask_truncated_rows: bool,
) -> torch.Tensor:
    """(N, L) float: the targets the loss, the KL and the entropy count — a completion's
    tokens the model sampled (TRL's ``completion_mask * tool_mask``: a tool's answer and the
    template's tokens around it are 0), none of a truncated completion's with
    ``mask_truncated_rows`` (``train.mask_truncated_completions``)."""
    mask = torch.zeros(targets.shape, dtype=torch.float32)
    for i, completion in enumerate(completions):
        positions = (targets[i] != IGNORE_INDEX).nonzero().squeeze(1)
        mask[i, positions] = torch.tensor(completion.mask, dtype=torch.float32)
    return mask_truncated(mask, truncated) if mask_truncated_rows else mask


@torch.no_grad()
def scored_logps(
    model: Llama,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    micro_batch: int,
    autocast: contextlib.AbstractContextManager,
) -> torch.Tensor:
    """(N, L) the targets' log-probs at ``temperature``, ``micro_batch`` rows at a time,
    without gradients (the old policy's, or with the adapters off the reference's)."""
    device = next(model.parameters()).device
    parts = []
    for x, y in zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True):
        with autocast:
            logps = model(x.to(device), logps_of=y.to(device), temperature=temperature)
        parts.append(logps.float())
    return torch.cat(parts)


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict:
    """TRL's completion-length metrics (lengths count the stop token)."""
    truncated = torch.tensor(truncated, dtype=torch.bool)
    lengths = torch.tensor(lengths, dtype=torch.float64)
    ended = lengths[~truncated]
    metrics = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.double().mean()),
    }
    for name, reduce in (("mean", torch.mean), ("min", torch.min), ("max", torch.max)):
        value = float(reduce(ended)) if len(ended) else 0.0
        metrics[f"completions/{name}_terminated_length"] = value
    return metrics
