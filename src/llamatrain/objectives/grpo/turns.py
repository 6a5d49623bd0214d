"""A rollout's completions decoded turn by turn: each row samples until its stop token, and a
responder (the tools, :mod:`.tool_turns`) may answer the turn with tokens from outside the model
that the row then decodes on from, on the same KV cache (:class:`~llamatrain.decoding.RowDecoder`:
the answer's tokens are appended, nothing before them is computed again).

Without a responder this is the single-turn rollout: every row samples to its first stop token
or ``budget`` tokens. With one, a row's completion is its turns and the answers between them, all
counted against ``budget`` (``max_completion_length``, TRL's count: tool tokens included); an
answer that would pass it is not given (TRL drops such tool results) and the row ends there.

The responder reads every turn the model wrote within the budget, the last one too, as TRL
reads every completion for calls before it checks the length: a turn that ends with its stop
token as the budget's last token is answered (its calls run and are counted), and so is a turn
the budget cut before its stop token (``finished`` False: the tools run the calls it completed,
TRL's parser reads those too); the answer itself has no room then and is dropped.

A row whose conversation has ended waits, its cache slots left empty, while the others go on:
the batch keeps one shape, no cache is copied, and a row's draws stay its own (it samples only
its own tokens, from its own generator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llamatrain.decoding import RowDecoder
from llamatrain.model import Llama
from llamatrain.sampling import SamplingParams

__all__ = ["Completion", "Responder", "decode_turns"]


class Responder(Protocol):
    """What answers a row's finished turn."""

    def answer(self, row: int, turn: Sequence[int], room: int, finished: bool) -> list[int] | None:
        """The tokens that answer row ``row``'s turn ``turn`` (its sampled tokens, without
        its stop token), up to and including the next turn's header; None when the
        conversation ends here, or when the answer would take more than ``room`` tokens.
        ``finished``: the model ended the turn with its stop token (False: the budget cut
        it, and ``room`` is 0)."""
        ...


@dataclass
class Completion:
    """One row's completion: its ``tokens`` (the model's and the answers'), ``mask`` (1 where
    the model sampled the token, 0 on the answers' tokens) and where its last turn starts."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    last_turn: int = 0

    def add(self, tokens: Sequence[int], sampled: bool) -> None:
        self.tokens += tokens
        self.mask += [int(sampled)] * len(tokens)


def decode_turns(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    budget: int,
    params: SamplingParams,
    stops: frozenset[int],
    seeds: Sequence[int],
    responder: Responder | None = None,
    ended: Callable[[int], None] | None = None,
) -> list[Completion]:
    """Each prompt's completion, the prompts decoded as one batch (row i's sampler seeded
    ``seeds[i]``), at most ``budget`` tokens each; ``ended(row)`` is told as each row ends."""
    rows = len(prompts)
    decoder = RowDecoder(model, rows, max(map(len, prompts)) + budget, params, seeds)
    completions = [Completion() for _ in prompts]
    pending = [list(p) for p in prompts]
    live = list(range(rows))
    while live:
        decoder.feed(pending)
        pending = [[] for _ in prompts]
        for row, token in zip(live, decoder.sample(live), strict=True):
            done = completions[row]
            done.add([token], sampled=True)
            finished, full = token in stops, len(done.tokens) >= budget
            answer = None
            if responder is not None and (finished or full):
                turn = done.tokens[done.last_turn : len(done.tokens) - finished]
                answer = responder.answer(row, turn, budget - len(done.tokens), finished)
            if answer:
                done.add(answer, sampled=False)
                done.last_turn = len(done.tokens)
            if (finished and not answer) or len(done.tokens) >= budget:
                if ended is not None:
                    ended(row)
                continue
            pending[row] = [token, *(answer or [])]
        live = [row for row in live if pending[row]]
    return completions
