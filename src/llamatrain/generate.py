"""Generation: decoding a model token by token, and the text and chat streams built on it.

Kept apart from the model, as gpt-fast keeps its ``generate.py`` beside ``model.py``: the
model computes logits for the tokens it is given, writing into a ``KVCache`` when handed one;
the batched decoder that keeps the cache and samples is ``decoding.RowDecoder`` (GRPO's
rollouts decode on it too); what makes generation of it (prompts, stop tokens, text decoded as
it grows, chat templates) is here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from llamatrain import parallel
from llamatrain.chat_template import ChatTemplate, prompt_ids
from llamatrain.decoding import RowDecoder, Seeds
from llamatrain.errors import ConfigError
from llamatrain.model import Llama
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer

__all__ = [
    "Conversation",
    "chat",
    "check_prompt",
    "generate",
    "generate_stream",
    "generate_text",
]


@torch.no_grad()
def generate_stream(
    model: Llama,
    tokens: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams | None = None,
    seed: Seeds = None,
    stop_tokens: frozenset[int] = frozenset(),
    allowed: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token (batch,) one step at a time, decoding with a KV cache
    (``decoding.RowDecoder``).

    ``tokens``: the prompts, (batch, seq) or (seq,), or a list of prompts of different
    lengths (ragged), decoded as one batch: each row's rope positions start at its first token
    and the slots the shorter prompts leave empty are hidden from every attention, at the
    prompt and at each step, so each row's logits are its decode's alone (to float rounding)
    and the repetition penalty counts only its own tokens. ``seed``: one for the batch's
    sampler, or one per row, each row then drawing what it draws alone with that seed,
    whatever else is in the batch.

    A row stops at the first of ``stop_tokens`` it produces and from then on repeats that
    token (padding, no longer decoded) while the other rows go on; the stream ends when every
    row has stopped or ``max_new_tokens`` have come. Generation goes on past the context the
    model was trained for, with a warning, as llama.cpp's does (``RowDecoder``).
    ``allowed``: see ``sampling.sample_next``.
    """
    prompts = _prompt_rows(tokens)
    if max_new_tokens < 1:
        return
    capacity = max(map(len, prompts)) + max_new_tokens
    decoder = RowDecoder(model, len(prompts), capacity, params or SamplingParams(), seed, allowed)
    with parallel.root_weights(model):  # the decoder runs the head outside a forward (FSDP)
        decoder.feed(prompts)
        latest = [0] * len(prompts)  # each row's last token: a stopped row's stop token
        live = list(range(len(prompts)))
        for step in range(max_new_tokens):
            for row, token in zip(live, decoder.sample(live), strict=True):
                latest[row] = token
            yield torch.tensor(latest, device=decoder.device)
            live = [row for row in live if latest[row] not in stop_tokens]
            if not live or step == max_new_tokens - 1:
                return
            going = set(live)
            decoder.feed([[t] if row in going else [] for row, t in enumerate(latest)])


def _prompt_rows(tokens: torch.Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    """``tokens`` (batch, seq) or (seq,), or a list of prompts of any lengths, as lists."""
    if isinstance(tokens, torch.Tensor):
        _check_not_empty(tokens.shape[-1])
        return (tokens[None] if tokens.dim() == 1 else tokens).tolist()
    if not tokens or min(map(len, tokens)) < 1:
        raise ValueError("generate needs at least one prompt, each of at least one token")
    return [list(prompt) for prompt in tokens]


def generate(
    model: Llama,
    tokens: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams | None = None,
    seed: int | None = None,
    stop_tokens: frozenset[int] = frozenset(),
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prompt + up to ``max_new_tokens`` sampled tokens (LongTensor, same batch shape): fewer
    when every row has met one of ``stop_tokens`` (a row that stopped earlier is padded
    with its stop token; see :func:`generate_stream`).

    ``params`` defaults to llama.cpp's sampler settings; ``SamplingParams(temperature=0)``
    is greedy decoding.
    """
    squeeze = tokens.dim() == 1
    prompt = tokens[None] if squeeze else tokens
    was_training = model.training
    model.eval()
    try:
        stream = generate_stream(model, prompt, max_new_tokens, params, seed, stop_tokens, allowed)
        new = list(stream)
    finally:
        model.train(was_training)
    out = torch.cat([prompt.to(model.token_embd.weight.device)] + [t[:, None] for t in new], 1)
    return out[0] if squeeze else out


def generate_text(
    model: Llama,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_tokens: int = 128,
    params: SamplingParams | None = None,
    seed: int | None = None,
    allowed: torch.Tensor | None = None,
) -> Iterator[str]:
    """Stream the decoded continuation of ``prompt`` piece by piece (stops at EOS); a
    prompt longer than the model's context is a ConfigError here (:func:`check_prompt`).

    The prompt is tokenized as llama-completion tokenizes one (``Tokenizer.encode_prompt``:
    BOS and EOS as the model file says, control tokens it writes parsed), so a greedy
    continuation is llama.cpp's. ``params`` defaults to llama.cpp's sampler settings
    (``SamplingParams()``); ``allowed`` restricts the vocabulary (e.g. to
    ``llamatrain.api.seen_tokens``).
    """
    ids = tokenizer.encode_prompt(prompt)
    check_prompt(len(ids), model.cfg.max_seq_len)  # now, not at the stream's first step
    stop = frozenset({tokenizer.eos_id})
    return _continuation(model, tokenizer, ids, stop, max_tokens, params, seed, allowed)


def _continuation(
    model: Llama,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    stop: frozenset[int],
    max_tokens: int,
    params: SamplingParams | None,
    seed: int | None,
    allowed: torch.Tensor | None = None,
) -> Iterator[str]:
    """The text after ``prompt_ids``, decoded as it grows, until a ``stop`` token. Bytes of a
    character still arriving are held back; at the end, those of one that never completed
    are given as replacement characters (as the tokenizer decodes them), not dropped: a
    reply of stray bytes shows as what it is, not as nothing."""
    model.eval()
    prompt = torch.tensor([prompt_ids])
    stream = generate_stream(model, prompt, max_tokens, params, seed, stop, allowed)
    new: list[int] = []
    shown = text = tokenizer.decode(prompt_ids)
    for token in stream:
        if token.item() in stop:
            break
        new.append(token.item())
        text = tokenizer.decode(prompt_ids + new)
        if text.endswith("\ufffd"):
            continue  # a multi-byte character is still arriving byte token by byte token
        yield text[len(shown) :]
        shown = text
    if len(text) > len(shown):
        yield text[len(shown) :]


def check_prompt(n_tokens: int, context: int) -> None:
    """Refuse a prompt of more tokens than ``context`` (the model's trained context,
    llama.context_length), as llama.cpp's ``llama-cli`` refuses one longer than its context
    ("prompt is too long"), whose default is the trained one: the model never saw positions
    past it, and reading them first would take minutes before the first word. Generation may
    still run past the context after a prompt that fits, with a warning (see
    :func:`generate_stream`), as llama.cpp goes on. A prompt of no tokens at all (an empty
    text, for a model that puts no BOS first) is refused as llama.cpp refuses it."""
    _check_not_empty(n_tokens)
    if n_tokens > context:
        raise ConfigError(
            f"the prompt is {n_tokens:,} tokens, longer than the model's context of "
            f"{context:,} (llama.context_length), which llama.cpp refuses too; shorten the "
            "prompt (in a chat, /reset starts the conversation over)"
        )


def _check_not_empty(n_tokens: int) -> None:
    """Refuse a prompt of no tokens, which nothing can be generated from: an empty text for a
    model that puts no BOS before a prompt, where llama.cpp stops too ("input is empty")."""
    if n_tokens == 0:
        raise ConfigError(
            "the prompt is empty and the model puts no BOS before one "
            "(tokenizer.ggml.add_bos_token = false), which llama.cpp refuses too; give a "
            "prompt of at least one token (--prompt, train.sample_prompt)"
        )


def chat(
    model: Llama,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    message: str | Sequence[Mapping[str, Any]],
    *,
    max_tokens: int = 128,
    params: SamplingParams | None = None,
    seed: int | None = None,
) -> Iterator[str]:
    """Stream the model's reply to one user ``message``, or to a conversation (a list of
    ``{"role", "content"}`` turns — system, user, assistant — ending with the user's), rendered
    with ``template`` as its training conversations were, up to the template's end-of-turn
    marker (or EOS).

    The marker is one control token in a chat model's vocabulary (``<|im_end|>``,
    ``<|eot_id|>``) and generation stops on it; where the vocabulary spells it in several
    tokens, the reply is cut where its text appears.
    """
    turns = [{"role": "user", "content": message}] if isinstance(message, str) else message
    prompt = template.render(list(turns), add_generation_prompt=True)
    ids = prompt_ids(tokenizer, prompt)
    check_prompt(len(ids), model.cfg.max_seq_len)
    stop = reply_stops(tokenizer, template)
    pieces = _continuation(model, tokenizer, ids, stop, max_tokens, params, seed)
    return _reply(pieces, template.end_of_turn)


def reply_stops(tokenizer: Tokenizer, template: ChatTemplate) -> frozenset[int]:
    """The token ids a :func:`chat` reply ends at: EOS, and the template's end-of-turn marker
    where the vocabulary spells it as one control token (a marker of several tokens is found
    in the text instead). Public so that a comparison with another decoder (llama.cpp's greedy
    tokens, in the example notebooks) stops where :func:`chat` stops."""
    marker_ids = tokenizer.encode(template.end_of_turn, special=True)
    return frozenset({tokenizer.eos_id, *(marker_ids if len(marker_ids) == 1 else ())})


class Conversation:
    """A multi-turn chat with a model, the history kept (``llamatrain chat`` and notebooks):
    each :meth:`say` streams the reply to the whole conversation so far and, once the reply
    is read to its end, adds it to the history."""

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        system: str | None = None,
        **generation: Any,
    ) -> None:
        """``generation``: :func:`chat`'s keywords (``max_tokens``, ``params``, ``seed``)."""
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.system, self.generation = system, generation
        self.turns: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget every turn but the system prompt."""
        self.turns = [{"role": "system", "content": self.system}] if self.system else []

    def say(self, message: str) -> Iterator[str]:
        """Stream the reply to ``message`` after the turns so far."""
        turns = [*self.turns, {"role": "user", "content": message}]
        pieces = []
        for piece in chat(self.model, self.tokenizer, self.template, turns, **self.generation):
            pieces.append(piece)
            yield piece
        self.turns = [*turns, {"role": "assistant", "content": "".join(pieces)}]


def _reply(pieces: Iterator[str], marker: str) -> Iterator[str]:
    """The assistant's words in ``pieces``: without the whitespace the template puts before a
    reply (llama-2's ``[/INST] ``), up to the first ``marker``; the last ``len(marker) - 1``
    characters are held back until they cannot be the start of it."""
    held, started = "", False
    for piece in pieces:
        held += piece
        if not started:
            held = held.lstrip()
            started = bool(held)
        at = held.find(marker)
        if at >= 0:
            if held[:at]:
                yield held[:at]
            return
        keep = len(marker) - 1
        if len(held) > keep:
            yield held[: len(held) - keep]
            held = held[len(held) - keep :]
    if held:
        yield held
