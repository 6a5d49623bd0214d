"""The tokens that answer a finished assistant turn in a multi-turn rollout (a tool's results, an
environment's reply): the chat template's rendering of the conversation with the answer's
messages, from the assistant turn's end-of-turn marker to the next assistant turn's header.

That is the text a chat-data conversation holding these messages has between the two assistant
turns (TRL's ``_get_tool_suffix_ids``, rendered over the row's own conversation rather than a
stand-in), tokenized as a rendered chat is (control tokens parsed), so a rollout's tokens are
the tokens of the conversation it logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamatrain.chat_template import ChatTemplate
from llamatrain.errors import TrainingError
from llamatrain.tokenizer import Tokenizer

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
    replied = template.render(list(before), tools=tools)
    full = template.render([*before, *answer], add_generation_prompt=True, tools=tools)
    marker = template.end_of_turn
    end = _after_nth(full, marker, replied.count(marker))
    if end is None:
        raise TrainingError(
            f"the chat template {template.name} renders a conversation with an answer to the "
            "assistant (a tool's result, an environment's reply) with fewer turns than the "
            "one without it, so the answer cannot be appended to a rollout; use a template "
            "that renders such messages after the assistant's turn (Qwen 2.5/3, Llama 3.x)"
        )
    return tokenizer.encode(full[end:], special=True)


def _after_nth(text: str, marker: str, n: int) -> int | None:
    """Where ``text`` goes on after its ``n``-th ``marker`` (None: it has fewer, or n is 0)."""
    at = -len(marker)
    for _ in range(n):
        at = text.find(marker, at + len(marker))
        if at < 0:
            return None
    return at + len(marker) if n else None
