"""A batch of rows decoded together on one KV cache, each row fed tokens of its own at any step:
what it sampled, a prompt, or text from outside the model (a tool's result, an environment's
reply) that it then decodes on from, with no second pass over what the cache holds.

``generate_stream`` decodes rows that only ever take one sampled token a step; a multi-turn
GRPO rollout needs more: a row stops at its end of turn, takes a tool message of a few dozen
tokens and goes on, while the others keep sampling. :class:`RowDecoder` feeds every row's
tokens in one forward per step, a chunk as wide as the longest row's: a row with fewer tokens
(one sampled token, or none while it waits) leaves the rest of its slots empty, marked in the
cache's ``padding`` so that no attention reads them (``KVCache``'s padding holds interior
holes as it holds left padding). Each row keeps its own rope positions, counting only its own
tokens, so a row's logits are those of its tokens decoded alone, to float rounding. Only each
row's last position goes through the lm head: a prompt pass over a large vocabulary holds
(rows, vocab) logits, not (rows, longest prompt, vocab). The cache grows (a copy, doubling)
when a step needs more slots than it has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llamatrain.model import KVCache, Llama
from llamatrain.sampling import SamplingParams, sample_next

__all__ = ["RowDecoder"]


class RowDecoder:
    """``rows`` token streams decoded together: :meth:`feed` appends each row's new tokens to
    the cache, :meth:`sample` draws the next token of some rows from their last logits, row i
    with its own generator seeded ``seeds[i]`` (so a row draws what it draws alone, in any
    batch, whichever rows wait). Sampling has no repetition penalty (GRPO's sampler)."""

    def __init__(
        self, model: Llama, rows: int, capacity: int, params: SamplingParams, seeds: Sequence[int]
    ) -> None:
        if len(seeds) != rows:
            raise ValueError(f"{len(seeds)} seeds for {rows} rows: give one per row")
        param = next(model.parameters())
        self.model, self.params, self.device = model, params, param.device
        padding = torch.ones(rows, max(capacity, 1), dtype=torch.bool, device=self.device)
        self.cache = KVCache(model.cfg, rows, padding.shape[1], self.device, param.dtype, padding)
        self.positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.logits: torch.Tensor | None = None  # (rows, vocab): after each row's last token
        self.generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]

    @torch.no_grad()
    def feed(self, tokens: Sequence[Sequence[int]]) -> None:
        """Append ``tokens[i]`` to row i (any number, none for a row that waits) in one
        forward; a row given tokens has its next logits from its last one."""
        width = max(len(t) for t in tokens)
        if width == 0:
            return
        rows = len(tokens)
        lengths = torch.tensor([len(t) for t in tokens], device=self.device)
        chunk = torch.zeros(rows, width, dtype=torch.long)
        for i, row in enumerate(tokens):
            chunk[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        start = self._room_for(width)
        offsets = torch.arange(width, device=self.device)
        self.cache.padding[:, start : start + width] = offsets >= lengths[:, None]
        positions = self.positions[:, None] + offsets
        hidden = self.model.hidden_states(chunk.to(self.device), self.cache, positions=positions)
        last = hidden[torch.arange(rows, device=self.device), (lengths - 1).clamp(min=0)]
        fresh = self.model.head_logits(last[:, None])[:, 0]  # each row's last token's only
        fed = (lengths > 0)[:, None]
        self.logits = fresh if self.logits is None else torch.where(fed, fresh, self.logits)
        self.positions += lengths

    def sample(self, rows: Sequence[int]) -> list[int]:
        """The next token of each of ``rows`` (each has been fed), from its own generator."""
        if not rows:
            return []
        if self.logits is None:
            raise RuntimeError("feed the rows their prompts before sampling")
        index = torch.tensor(list(rows), device=self.device)
        generators = [self.generators[r] for r in rows]
        return sample_next(self.logits[index], self.params, None, generators).tolist()

    def _room_for(self, width: int) -> int:
        """The first of ``width`` free cache slots, the cache doubled (copied) when it has
        fewer left."""
        start, capacity = self.cache.length, self.cache.k.shape[3]
        if start + width > capacity:
            self._grow(max(2 * capacity, start + width))
        return start

    def _grow(self, capacity: int) -> None:
        old = self.cache
        padding = torch.ones(old.padding.shape[0], capacity, dtype=torch.bool, device=self.device)
        padding[:, : old.length] = old.padding[:, : old.length]
        rows = padding.shape[0]
        self.cache = KVCache(self.model.cfg, rows, capacity, self.device, old.k.dtype, padding)
        self.cache.k[..., : old.length, :] = old.k[..., : old.length, :]
        self.cache.v[..., : old.length, :] = old.v[..., : old.length, :]
        self.cache.length = old.length
