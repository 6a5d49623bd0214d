"""Next-token sampling from logits, with llama.cpp's knobs.

Pure tensor functions so that the model's ``generate``, the CLI and notebooks share one
implementation. The order of the steps follows llama.cpp's classic sampler chain: repetition
penalty on the raw logits, then top-k, top-p, temperature, and a draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax).

    The defaults are llama.cpp's own sampler defaults (``llama-cli`` with no sampling flags,
    minus min-p, which llamatrain does not implement), so a model sampled here and in
    llama.cpp behaves alike out of the box. This is the one home of sampling defaults: the
    CLI, the API and the trainer's samples all start from it.
    """

    temperature: float = 0.8
    top_k: int | None = 40
    top_p: float | None = 0.95
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")


def apply_repeat_penalty(
    logits: torch.Tensor, recent: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Make recently seen tokens less likely, as llama.cpp does.

    Positive logits are divided by the penalty and negative ones multiplied, so the penalty
    always pushes a token's probability down whatever the sign of its logit.
    ``logits`` is (batch, vocab), ``recent`` (batch, n) token ids.
    """
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    seen = torch.gather(logits, 1, recent)
    penalised = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(1, recent, penalised)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row; the rest become -inf."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p (nucleus sampling)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p  # the first token always survives
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    recent: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (batch, vocab); returns (batch,) int64.

    ``allowed`` (vocab,) bool, when given, is the only tokens that may be picked (the 2023
    trainer's "sample from the tokens seen in training"): every other logit is -inf before any
    other step, so greedy decoding and every filter see the restricted vocabulary.
    """
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if recent is not None and params.repeat_penalty != 1.0:
        window = recent[:, -params.repeat_last_n :] if params.repeat_last_n > 0 else recent
        logits = apply_repeat_penalty(logits, window, params.repeat_penalty)
    if params.temperature == 0:
        return torch.argmax(logits, dim=-1)
    if params.top_k is not None:
        logits = filter_top_k(logits, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        logits = filter_top_p(logits, params.top_p)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
