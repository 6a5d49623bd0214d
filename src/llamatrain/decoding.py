"""A batch of rows decoded together on one KV cache, each row fed tokens of its own at any step:
a prompt, what it sampled, or text from outside the model (a tool's result, an environment's
reply) that it then decodes on from, with no second pass over what the cache holds. Both of
the library's decoders are this one: ``generate.generate_stream`` (``generate``, ``chat``,
``eval``'s samples: prompts of any lengths, one sampled token a row a step, rows stopping at
their stop tokens) and GRPO's turn-by-turn rollouts (``objectives.grpo.turns``: a row stops at
its end of turn, takes a tool message of a few dozen tokens and goes on, while the others keep
sampling).

:class:`RowDecoder` feeds every row's tokens in one forward per step, a chunk as wide as the
longest row's, each row's tokens at its end: a row with fewer tokens (one sampled token, or
none while it waits) leaves the slots before them empty, marked in the cache's ``padding`` so
that no attention reads them (``KVCache``'s padding holds interior holes as it holds left
padding). Each row keeps its own rope positions, counting only its own tokens, so a row's
logits are those of its tokens decoded alone, to float rounding. Rows that each take one token
a step (or stop for good) keep their tokens in adjacent slots after their prompt's, which a
sliding window (Gemma's) needs, as it measures its span in slots; a row that waits while
another takes a tool's message leaves a hole inside its window. While no row has left a
hole (prompts of one length, every row fed every step) the cache has no padding and the model
takes its plain path, no mask and no positions. Only the chunk's last position, every row's
last token, goes through the lm head: a prompt pass over a large vocabulary holds (rows,
vocab) logits, not (rows, longest prompt, vocab). The cache grows (a copy, doubling) when a
step needs more slots than it has.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from types import FrameType

import torch

from llamatrain.model import KVCache, Llama
from llamatrain.sampling import SamplingParams, sample_next

__all__ = ["RowDecoder"]

Seeds = int | Sequence[int] | None
"""A decoder's random source: torch's global generator (None), one generator for the batch
(an int), or one per row (row i then draws what it draws alone, whatever else is in the
batch)."""


class RowDecoder:
    """``rows`` token streams decoded together: :meth:`feed` appends each row's new tokens to
    the cache, :meth:`sample` draws the next token of some rows from their last logits with
    ``params`` (the repetition penalty over each row's own tokens, prompt included), from
    ``seeds``' generators (:data:`Seeds`), restricted to ``allowed`` where given
    (``sampling.sample_next``).

    ``capacity``: the slots the cache starts with (it grows past them when fed more); past the
    context the model was trained on, decoding goes on as llama.cpp's does (rope extends to
    any position) with one warning: what comes out there is the model's, and llama.cpp's,
    best guess outside its training."""

    def __init__(
        self,
        model: Llama,
        rows: int,
        capacity: int,
        params: SamplingParams,
        seeds: Seeds,
        allowed: torch.Tensor | None = None,
    ) -> None:
        param = next(model.parameters())
        self.model, self.params, self.allowed, self.device = model, params, allowed, param.device
        self.generator = _generators(seeds, rows, self.device)
        _warn_past_context(capacity, model.cfg.max_seq_len)
        self.cache = KVCache(model.cfg, rows, max(capacity, 1), self.device, param.dtype)
        self.positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.logits: torch.Tensor | None = None  # (rows, vocab): after each row's last token
        self.history: list[list[int]] = [[] for _ in range(rows)]  # the repetition penalty's

    @torch.no_grad()
    def feed(self, tokens: Sequence[Sequence[int]]) -> None:
        """Append ``tokens[i]`` to row i (any number, none for a row that waits) in one
        forward; a row given tokens has its next logits from its last one."""
        width = max(len(t) for t in tokens)
        if width == 0:
            return
        lengths = torch.tensor([len(t) for t in tokens], device=self.device)
        chunk = torch.tensor([[*[0] * (width - len(row)), *row] for row in tokens])
        start = self._room_for(width)
        holes = width - lengths[:, None]  # each row's empty slots, before its tokens
        offsets = torch.arange(width, device=self.device)
        if self.cache.padding is not None or bool((lengths < width).any()):
            self._holes()[:, start : start + width] = offsets < holes
        positions = None
        if self.cache.padding is not None:
            positions = (self.positions[:, None] + offsets - holes).clamp(min=0)
        hidden = self.model.hidden_states(chunk.to(self.device), self.cache, positions=positions)
        fresh = self.model.head_logits(hidden[:, -1:])[:, 0]  # each row's last token's only
        fed = lengths > 0
        if self.logits is None or bool(fed.all()):
            self.logits = fresh
        else:  # a row that waited keeps its logits
            self.logits = torch.where(fed[:, None], fresh, self.logits)
        self.positions += lengths
        for history, row in zip(self.history, tokens, strict=True):
            history.extend(row)

    def sample(self, rows: Sequence[int]) -> list[int]:
        """The next token of each of ``rows`` (each has been fed)."""
        if not rows:
            return []
        if self.logits is None:
            raise RuntimeError("feed the rows their prompts before sampling")
        index = torch.tensor(list(rows), device=self.device)
        generator = self.generator
        if isinstance(generator, list):
            generator = [generator[r] for r in rows]
        recent = self._recent(rows) if self.params.repeat_penalty != 1.0 else None
        logits = self.logits[index]
        return sample_next(logits, self.params, recent, generator, self.allowed).tolist()

    def _recent(self, rows: Sequence[int]) -> torch.Tensor:
        """(len(rows), n): each row's last ``repeat_last_n`` tokens (all of them for -1 or 0),
        left-padded with -1, which is no token (``sampling.apply_repeat_penalty``)."""
        n = self.params.repeat_last_n
        windows = [self.history[r][-n:] if n > 0 else self.history[r] for r in rows]
        width = max(map(len, windows))
        padded = [[-1] * (width - len(w)) + w for w in windows]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _holes(self) -> torch.Tensor:
        """The cache's ``padding``, made (no slot so far a hole) the first time a row leaves
        one: from then on every forward passes it, and each row's positions."""
        if self.cache.padding is None:
            rows, capacity = self.cache.k.shape[1], self.cache.k.shape[3]
            self.cache.padding = torch.zeros(rows, capacity, dtype=torch.bool, device=self.device)
        return self.cache.padding

    def _room_for(self, width: int) -> int:
        """The first of ``width`` free cache slots, the cache doubled (copied) when it has
        fewer left."""
        start, capacity = self.cache.length, self.cache.k.shape[3]
        if start + width > capacity:
            self._grow(max(2 * capacity, start + width))
        return start

    def _grow(self, capacity: int) -> None:
        old = self.cache
        rows = old.k.shape[1]
        padding = None
        if old.padding is not None:
            padding = torch.ones(rows, capacity, dtype=torch.bool, device=self.device)
            padding[:, : old.length] = old.padding[:, : old.length]
        self.cache = KVCache(self.model.cfg, rows, capacity, self.device, old.k.dtype, padding)
        self.cache.k[..., : old.length, :] = old.k[..., : old.length, :]
        self.cache.v[..., : old.length, :] = old.v[..., : old.length, :]
        self.cache.length = old.length


def _generators(seeds: Seeds, rows: int, device: torch.device) -> torch.Generator | list | None:
    """The sampler's random source for :data:`Seeds`."""
    if seeds is None:
        return None
    if not isinstance(seeds, Sequence):
        return torch.Generator(device=device).manual_seed(seeds)
    if len(seeds) != rows:
        raise ValueError(f"{len(seeds)} seeds for a batch of {rows} rows: give one per row")
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def _warn_past_context(capacity: int, context: int) -> None:
    """Warn that decoding goes past the context the model was trained on (see
    :class:`RowDecoder`), pointing at the line that asked for the tokens: the first frame
    outside llamatrain and torch (the decoder is built by ``generate_stream``, run through
    torch's ``no_grad`` wrapper, or by a rollout, so no fixed depth names that line)."""
    if capacity > context:
        warnings.warn(
            f"generating {capacity} tokens, past the {context} the model was trained on "
            "(llama.context_length); llama.cpp continues too, quality may drop",
            stacklevel=_callers_level(),
        )


_INNER_PACKAGES = ("llamatrain", "torch")
"""Packages whose frames a warning about the caller's request looks past."""


def _callers_level() -> int:
    """``warnings.warn``'s stacklevel, from the function that calls this one, of the first
    frame outside :data:`_INNER_PACKAGES` (the outermost frame if every one is inside)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and _package(frame) in _INNER_PACKAGES:
        frame, level = frame.f_back, level + 1
    return level


def _package(frame: FrameType) -> str:
    """The top-level package of the module ``frame`` runs in."""
    return frame.f_globals.get("__name__", "").partition(".")[0]
