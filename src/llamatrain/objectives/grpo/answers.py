"""The tokens that answer a finished assistant turn in a multi-turn rollout (a tool's results, an
environment's reply): the chat template's rendering of the conversation with the answer's
messages, from the assistant turn's end-of-turn marker to the next assistant turn's header.

That is the text a chat-data conversation holding these messages has between the two assistant
turns (TRL's ``_get_tool_suffix_ids``, rendered over the row's own conversation rather than a
stand-in), tokenized as a rendered chat is, so a rollout's tokens are the tokens of the
conversation it logs: the template's own markers (``<|im_start|>``, ``<|eot_id|>``) become
their control tokens.

What the messages say is data, never markup: a tool's output or an environment's reply that
writes a control token's text (``<|im_end|>``, ``<|im_start|>assistant``) is tokenized as
text, so it cannot close the tool's turn or open one for the model (TRL and chat data parse
control tokens in every message's text; llama-server in the prompts it renders too). Where no
message's text holds one, the whole answer is tokenized at once, exactly as chat data is; where
one does, the text each message's content became in the rendering (found by rendering it with
a stand-in) is tokenized without control tokens and the template's text around it with them,
each piece apart (so no token spans a content's edge there, where one text might merge two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamatrain.chat_template import ChatTemplate
from llamatrain.errors import TrainingError
from llamatrain.tokenizer import Tokenizer
from llamatrain.tools.template_tools import tool_variables

__all__ = ["answer_tokens"]


def answer_tokens(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    before: Sequence[Mapping[str, Any]],
    answer: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The tokens between the end of ``before``'s last (assistant) turn and the generation
    prompt after ``answer``'s messages: where the rendering with the answer goes on after as
    many end-of-turn markers as the rendering without it holds. Not after the rendering
    without it: a template may render the last assistant turn differently from one that
    others follow (Qwen3's empty ``<think></think>`` on the last one only), but not the
    number of turns. TrainingError when that number is not there."""
    text = _answer_text(template, before, answer, tools)
    if not any(_holds_control_tokens(tokenizer, m.get("content")) for m in answer):
        return tokenizer.encode(text, special=True)
    pieces = _pieces(template, before, answer, tools)
    return [t for piece, data in pieces for t in tokenizer.encode(piece, special=not data)]


def _answer_text(
    template: ChatTemplate,
    before: Sequence[Mapping[str, Any]],
    answer: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> str:
    """The text of :func:`answer_tokens`."""
    shown = tool_variables(template.source, tools)
    replied = template.render(list(before), **shown)
    full = template.render([*before, *answer], add_generation_prompt=True, **shown)
    marker = template.end_of_turn
    end = _after_nth(full, marker, replied.count(marker))
    if end is None:
        raise TrainingError(
            f"the chat template {template.name} renders a conversation with an answer to the "
            "assistant (a tool's result, an environment's reply) with fewer turns than the "
            "one without it, so the answer cannot be appended to a rollout; use a template "
            "that renders such messages after the assistant's turn (Qwen 2.5/3, Llama 3.x)"
        )
    return full[end:]


def _holds_control_tokens(tokenizer: Tokenizer, content: Any) -> bool:
    """Whether parsing control tokens would change ``content``'s tokens."""
    return isinstance(content, str) and (
        tokenizer.encode(content, special=True) != tokenizer.encode(content)
    )


_STAND_IN = "LLAMATRAINANSWERCONTENT{}Q"
"""What a message's content is rendered as to find where the template writes it: letters and
digits only, which no template escapes or splits."""


def _pieces(
    template: ChatTemplate,
    before: Sequence[Mapping[str, Any]],
    answer: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[tuple[str, bool]]:
    """The answer's text as (piece, is a message's content) in order: each message's content
    as the template wrote it (rendered alone among the others' stand-ins, so it is the text
    between the same surroundings), the template's text between them."""
    texts = [isinstance(m.get("content"), str) for m in answer]
    stand_ins = [
        {**m, "content": _STAND_IN.format(k)} if text else m
        for k, (m, text) in enumerate(zip(answer, texts, strict=True))
    ]
    framed = _answer_text(template, before, stand_ins, tools)
    pieces, at = [], 0
    for k, message in enumerate(answer):
        mark = _STAND_IN.format(k)
        start = framed.find(mark, at) if texts[k] else -1
        if start < 0:
            continue  # content not text, or a template that does not write it
        alone = [*stand_ins[:k], message, *stand_ins[k + 1 :]]
        written = _answer_text(template, before, alone, tools)
        after = len(framed) - start - len(mark)
        pieces += [(framed[at:start], False), (written[start : len(written) - after], True)]
        at = start + len(mark)
    return [*pieces, (framed[at:], False)]


def _after_nth(text: str, marker: str, n: int) -> int | None:
    """Where ``text`` goes on after its ``n``-th ``marker`` (None: it has fewer, or n is 0)."""
    at = -len(marker)
    for _ in range(n):
        at = text.find(marker, at + len(marker))
        if at < 0:
            return None
    return at + len(marker) if n else None
