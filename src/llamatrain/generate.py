"""Generation: decoding a model token by token, and the text and chat streams built on it.

Kept apart from the model, as gpt-fast keeps its ``generate.py`` beside ``model.py``: the
model computes logits for the tokens it is given, writing into a ``KVCache`` when handed one;
all that producing tokens involves (the cache's size, sampling, stop tokens, text decoded as
it grows, chat templates) is here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llamatrain.chat_template import ChatTemplate, prompt_ids
from llamatrain.errors import ConfigError
from llamatrain.model import KVCache, Llama
from llamatrain.sampling import SamplingParams, sample_next
from llamatrain.tokenizer import Tokenizer

__all__ = [
    "Conversation",
    "chat",
    "check_prompt",
    "generate",
    "generate_stream",
    "generate_text",
]


@dataclass(frozen=True)
class _Prompts:
    """A batch of prompts as the decoder holds them: ``ids`` (batch, seq), each row
    left-padded to the longest prompt, and ``pads`` (batch,) how many padding slots each row
    has (None when no row has any: the plain path, which passes neither positions nor a
    padding mask to the model)."""

    ids: torch.Tensor
    pads: torch.Tensor | None

    @staticmethod
    def of(tokens: torch.Tensor | Sequence[Sequence[int]], device: torch.device) -> _Prompts:
        """``tokens`` (batch, seq) or (seq,), or a list of prompts of any lengths, on
        ``device``; padding is token 0, which nothing reads (masked, never sampled)."""
        if isinstance(tokens, torch.Tensor):
            _check_not_empty(tokens.shape[-1])
            return _Prompts((tokens[None] if tokens.dim() == 1 else tokens).to(device), None)
        lengths = [len(p) for p in tokens]
        if not lengths or min(lengths) < 1:
            raise ValueError("generate needs at least one prompt, each of at least one token")
        width = max(lengths)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)
        for row, prompt in enumerate(tokens):
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        pads = torch.tensor([width - n for n in lengths], device=device)
        return _Prompts(ids.to(device), pads if bool(pads.any()) else None)

    def cache_padding(self, max_len: int) -> torch.Tensor | None:
        """(batch, max_len): the KV cache slots that hold padding (``KVCache``'s ``padding``)."""
        if self.pads is None:
            return None
        return torch.arange(max_len, device=self.pads.device) < self.pads[:, None]

    def positions(self, start: int, n: int) -> torch.Tensor | None:
        """(batch, n) rope positions of the cache slots [start, start + n): each row's first
        token at 0, as if unpadded (the padding's own, never seen by a token, at 0 too)."""
        if self.pads is None:
            return None
        slots = torch.arange(start, start + n, device=self.pads.device)
        return (slots - self.pads[:, None]).clamp_(min=0)

    def history(self) -> torch.Tensor:
        """Each row's tokens so far for the sampler's repetition penalty: its padding as -1,
        which is no token (``sampling.apply_repeat_penalty``)."""
        if self.pads is None:
            return self.ids
        return self.ids.masked_fill(self.cache_padding(self.ids.shape[1]), -1)


@torch.no_grad()
def generate_stream(
    model: Llama,
    tokens: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams | None = None,
    seed: int | Sequence[int] | None = None,
    stop_tokens: frozenset[int] = frozenset(),
    allowed: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token (batch,) one step at a time, decoding with a KV cache.

    ``tokens``: the prompts, (batch, seq) or (seq,), or a list of prompts of different
    lengths (ragged), decoded as one batch: each is left-padded to the longest, its rope
    positions start at its first token and the padding is hidden from every attention, at the
    prompt and at each step, so each row's logits are its unpadded decode's (to float
    rounding: the padded sums run over more, zero, terms) and the padding is never a token its
    repetition penalty counts. ``seed``: one for the batch's sampler, or one per row, each
    row then drawing what it draws alone with that seed, whatever else is in the batch.

    A row stops at the first of ``stop_tokens`` it produces and from then on repeats that
    token (padding) while the other rows go on; the stream ends when every row has stopped or
    ``max_new_tokens`` have come. Like llama.cpp, generation goes on past the context the
    model was trained for (rope extends to any position) and warns once when it does: what
    comes out there is the model's, and llama.cpp's, best guess outside its training.
    ``allowed``: see ``sampling.sample_next``.
    """
    param = next(model.parameters())
    prompts = _Prompts.of(tokens, param.device)
    if max_new_tokens < 1:
        return
    batch, width = prompts.ids.shape
    total = width + max_new_tokens
    if total > model.cfg.max_seq_len:
        warnings.warn(
            f"generating {total} tokens, past the {model.cfg.max_seq_len} the model was "
            "trained on (llama.context_length); llama.cpp continues too, quality may drop",
            stacklevel=3,  # the line that asked for tokens (past the no_grad wrapper)
        )
    padding = prompts.cache_padding(total)
    cache = KVCache(model.cfg, batch, total, param.device, param.dtype, padding)
    generator = _generators(seed, batch, param.device)
    history = prompts.history()
    stops = torch.tensor(sorted(stop_tokens), dtype=history.dtype, device=param.device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=param.device)
    logits = model(prompts.ids, cache=cache, positions=prompts.positions(0, width))[:, -1]
    params = params or SamplingParams()
    while True:
        next_token = sample_next(logits, params, history, generator, allowed)
        if stop_tokens:  # a row that stopped repeats its stop token
            next_token = torch.where(stopped, history[:, -1], next_token)
            stopped |= torch.isin(next_token, stops)
        yield next_token
        history = torch.cat((history, next_token[:, None]), dim=1)
        if history.shape[1] >= total or (stop_tokens and bool(stopped.all())):
            return
        at = prompts.positions(cache.length, 1)
        logits = model(next_token[:, None], cache=cache, positions=at)[:, -1]


def _generators(
    seed: int | Sequence[int] | None, rows: int, device: torch.device
) -> torch.Generator | list[torch.Generator] | None:
    """The sampler's random source: none (torch's global one), one seeded generator for the
    batch, or one per row."""
    if seed is None:
        return None
    if not isinstance(seed, Sequence):
        return torch.Generator(device=device).manual_seed(seed)
    if len(seed) != rows:
        raise ValueError(f"{len(seed)} seeds for a batch of {rows} rows: give one per row")
    return [torch.Generator(device=device).manual_seed(s) for s in seed]


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
    """The text after ``prompt_ids``, decoded as it grows, until a ``stop`` token."""
    model.eval()
    prompt = torch.tensor([prompt_ids])
    stream = generate_stream(model, prompt, max_tokens, params, seed, stop, allowed)
    new: list[int] = []
    shown = tokenizer.decode(prompt_ids)
    for token in stream:
        if token.item() in stop:
            break
        new.append(token.item())
        text = tokenizer.decode(prompt_ids + new)
        if text.endswith("\ufffd"):
            continue  # a multi-byte character is still arriving byte token by byte token
        yield text[len(shown) :]
        shown = text


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
    marker = template.end_of_turn
    marker_ids = tokenizer.encode(marker, special=True)
    stop = {tokenizer.eos_id} | ({marker_ids[0]} if len(marker_ids) == 1 else set())
    ids = prompt_ids(tokenizer, prompt)
    check_prompt(len(ids), model.cfg.max_seq_len)
    pieces = _continuation(model, tokenizer, ids, frozenset(stop), max_tokens, params, seed)
    return _reply(pieces, marker)


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
