"""Next-token sampling from logits, with llama.cpp's knobs.

Pure tensor functions so that the model's ``generate``, the CLI and notebooks share one
implementation. The order of the steps follows llama.cpp's classic sampler chain: repetition
penalty on the raw logits, then top-k, top-p, temperature, and a draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llamatrain.errors import ConfigError, ModelError

MAX_NEW_TOKENS = 1 << 20
"""Most tokens one generation may ask for (``generate --max-tokens``, ``train.sample_tokens``):
its KV cache is allocated up front for all of them."""


class SamplingError(ConfigError):
    """A sampling parameter out of its range: ``field`` names it, ``rule`` says the range."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{field} must be {rule}, got {value!r}")
        self.field, self.value, self.rule = field, value, rule


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax).

    The defaults are llama.cpp's own sampler defaults (``llama-cli`` with no sampling flags:
    top-k 40, top-p 0.95, min-p 0.05, temperature 0.8, filters applied in llama.cpp's order
    before the temperature), so a model sampled here and in llama.cpp behaves alike out of the
    box. This is the one home of sampling defaults: the
    CLI, the API and the trainer's samples all start from it.
    """

    temperature: float = 0.8
    top_k: int | None = 40
    top_p: float | None = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def __post_init__(self) -> None:
        """Every value in its range (NaN and infinities refused), as a SamplingError
        (a ConfigError, so one line at the CLI) naming the field."""
        if not _number(self.temperature) or not 0 <= self.temperature <= 1e6:
            raise SamplingError("temperature", self.temperature, "a number in [0, 1e6], 0 = greedy")
        if self.top_k is not None and (not _integer(self.top_k) or self.top_k < 1):
            raise SamplingError("top_k", self.top_k, "an integer >= 1")
        if self.top_p is not None and (not _number(self.top_p) or not 0 < self.top_p <= 1):
            raise SamplingError("top_p", self.top_p, "a number in (0, 1] (1 = no top-p)")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", self.min_p, "a number in [0, 1] (0 = no min-p)")
        if not _number(self.repeat_penalty) or not 0 < self.repeat_penalty <= 1e6:
            raise SamplingError("repeat_penalty", self.repeat_penalty, "a number in (0, 1e6]")
        if not _integer(self.repeat_last_n) or self.repeat_last_n < -1:
            raise SamplingError(
                "repeat_last_n", self.repeat_last_n, "an integer >= -1 (-1 or 0 = all tokens)"
            )


def _number(value: object) -> bool:
    """A finite real number (bools are not numbers here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def apply_repeat_penalty(
    logits: torch.Tensor, recent: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Make recently seen tokens less likely, as llama.cpp does.

    Positive logits are divided by the penalty and negative ones multiplied, so the penalty
    always pushes a token's probability down whatever the sign of its logit; a token seen
    several times is penalised once, as llama.cpp's ``repeat_penalty`` is.
    ``logits`` is (batch, vocab), ``recent`` (batch, n) token ids; an id < 0 is no token (the
    left padding of a ragged batch's shorter rows) and penalises nothing.
    """
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    real = recent >= 0
    counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
    seen = counts.scatter_add_(1, recent.clamp(min=0), real.to(torch.int32)) > 0
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row; the rest become -inf."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the tokens at least ``p`` times as probable as the most probable one (llama.cpp's
    min-p): in logits, those within log(p) of the row's largest."""
    floor = logits.max(dim=-1, keepdim=True).values + math.log(p)
    return logits.masked_fill(logits < floor, float("-inf"))


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
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (batch, vocab); returns (batch,) int64.

    ``generator``: one for the batch, or one per row: each row then draws with its own, what
    it would draw alone with it whatever else is in the batch (GRPO's per-row seeds).
    ``recent``: the tokens the repetition penalty looks at (:func:`apply_repeat_penalty`).

    ``allowed`` (vocab,) bool, when given, is the only tokens that may be picked (the 2023
    trainer's "sample from the tokens seen in training"): every other logit is -inf before any
    other step, so greedy decoding and every filter see the restricted vocabulary.
    """
    logits = logits.float()
    if bool(torch.isnan(logits).any()):  # multinomial would fail with a traceback
        raise ModelError(
            "the model's next-token logits are NaN: its weights hold NaN or infinite values "
            "(llamatrain info --verify FILE names them); use an earlier checkpoint"
        )
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
    if params.min_p > 0:
        logits = filter_min_p(logits, params.min_p)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    rows = zip(probs, generator, strict=True)
    return torch.cat([torch.multinomial(row[None], 1, generator=g) for row, g in rows]).squeeze(-1)
