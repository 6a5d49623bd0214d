"""Next-token sampling from logits, with llama.cpp's knobs.

Pure tensor functions so that the model's ``generate``, the CLI and notebooks share one
implementation. The order of the steps follows llama.cpp's classic sampler chain: repetition
penalty on the raw logits, then top-k, top-p, min-p, temperature, and a draw; like llama.cpp's,
the filters and the draw look at the few candidates top-k leaves, not the whole vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llamatrain.errors import ConfigError, ModelError

PARTIAL_SORTS = (256, 4096)
"""How many of a row's largest logits top-p looks at, in turn, before it sorts the whole
vocabulary (without top-k): 256 is llama.cpp's first guess; a small model's distribution is
often flatter (SmolLM2-135M's 256 largest held 0.60-0.99 of the mass, its 4,096 largest
0.96-1.0, over 8 prompts), and ``torch.topk`` of 4,096 costs a fifth of a sort of 49,152."""

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


def filter_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the tokens at least ``p`` times as probable as the most probable one (llama.cpp's
    min-p): in logits, those within log(p) of the row's largest."""
    floor = logits.max(dim=-1, keepdim=True).values + math.log(p)
    return logits.masked_fill(logits < floor, float("-inf"))


def filter_top_p(ranked: torch.Tensor, p: float, log_total: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches p (nucleus sampling).

    ``ranked`` (rows, n): logits sorted from the largest, the row's first n tokens;
    ``log_total`` (rows, 1): the log of the softmax's denominator over the row's tokens that
    the filters before kept (all of them, or just ``ranked`` after a top-k), so that ``ranked``
    need not hold the whole vocabulary. The token that crosses p is kept; the first always is."""
    probs = (ranked - log_total).exp()
    mass_before = torch.cumsum(probs, dim=-1) - probs
    return ranked.masked_fill(mass_before >= p, float("-inf"))


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a draw may pick, after top-k, top-p and min-p: ``(ids, logits)``, both
    (rows, n), a filtered-out token's logit -inf (it has no chance).

    The filters run in llama.cpp's order over the fewest tokens that decide them, as its
    sampler chain does, never a sort of the whole vocabulary when top-k is set: top-k's
    candidates (``torch.topk``, sorted), then top-p over them, then min-p (relative to the
    largest logit, which every filter keeps). Without top-k, top-p looks at the 256 largest
    first (llama.cpp's partial sort), then the 4,096 largest (:data:`PARTIAL_SORTS`), and
    sorts the vocabulary only when a row's mass is spread past them; with neither, every token
    is a candidate, unsorted. The kept tokens and their probabilities are those of the filters
    applied to the whole vocabulary."""
    top_p = params.top_p is not None and params.top_p < 1.0
    if params.top_k is not None:
        ranked, ids = _largest(logits, params.top_k)
        log_total = torch.logsumexp(ranked, dim=-1, keepdim=True)
    elif top_p:
        log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
        ranked, ids = _reaching(logits, params.top_p, log_total)
    else:
        ids = torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)
        ranked = logits
    if top_p:
        ranked = filter_top_p(ranked, params.top_p, log_total)
    if params.min_p > 0:
        ranked = filter_min_p(ranked, params.min_p)
    return ids, ranked


def _largest(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k's candidates, sorted from the largest: the k largest logits per row and every
    token tied with the k-th (top-k keeps ties: which of them to drop would be arbitrary), a
    row with fewer ties than another padded with -inf. One more than k is looked at to see
    whether any row has such a tie (rarely; more often in bf16)."""
    ranked, ids = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1)
    if ranked.shape[-1] <= k:
        return ranked, ids
    kth = ranked[:, k - 1 : k]
    if not bool(((ranked[:, k:] == kth) & torch.isfinite(kth)).any()):
        return ranked[:, :k], ids[:, :k]
    widest = int(((logits >= kth) & torch.isfinite(kth)).sum(dim=-1).max())
    ranked, ids = torch.topk(logits, widest, dim=-1)
    return ranked.masked_fill(ranked < kth, float("-inf")), ids


def _reaching(
    logits: torch.Tensor, p: float, log_total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest logits per row, sorted, enough of them to hold probability mass p in
    every row: the fewest of :data:`PARTIAL_SORTS` that do, else the whole vocabulary sorted."""
    for width in PARTIAL_SORTS:
        if width >= logits.shape[-1]:
            break
        ranked, ids = torch.topk(logits, width, dim=-1)
        if bool(((ranked - log_total).exp().sum(dim=-1) >= p).all()):
            return ranked, ids
    return torch.sort(logits, descending=True, dim=-1)


def draw(
    probs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator] | None
) -> torch.Tensor:
    """One index per row of ``probs`` (rows, n), drawn with probability proportional to each
    entry, (rows, 1): llama.cpp's draw, one uniform number per row against the running sum
    (in float64), where ``torch.multinomial`` would draw an exponential number per entry (a
    whole vocabulary's worth each step, the sampler's largest cost). ``generator``: one for
    the batch, or one per row (each row then draws what it would draw alone with it)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = _uniforms(probs.shape[0], generator, probs.device) * cdf[:, -1:]
    return pick(cdf, target)


def pick(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first index whose running sum ``cdf`` exceeds ``target`` (rows, 1): an entry of
    probability 0 never is one. A target rounded up to the total picks the last entry of any
    probability (the first index of the largest running sum), never one past it."""
    first = torch.searchsorted(cdf, target, right=True)
    if bool((first == cdf.shape[-1]).any()):
        first = torch.minimum(first, cdf.argmax(dim=-1, keepdim=True))
    return first


def _uniforms(
    rows: int, generator: torch.Generator | Sequence[torch.Generator] | None, device
) -> torch.Tensor:
    """(rows, 1) float64 uniform numbers in [0, 1): from torch's global generator, the batch's
    one, or row i's own ``generator[i]``."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, 1, dtype=torch.float64, device=device, generator=generator)
    draws = [torch.rand(1, dtype=torch.float64, device=device, generator=g) for g in generator]
    if len(draws) != rows:
        raise ValueError(f"{len(draws)} generators for {rows} rows: give one per row")
    return torch.stack(draws)


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
    if bool(logits.sum().isnan()) and bool(logits.isnan().any()):  # the sum: one cheap pass
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
    ids, kept = candidates(logits, params)
    probs = torch.softmax(kept / params.temperature, dim=-1)
    return ids.gather(-1, draw(probs, generator)).squeeze(-1)
