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
    prompt after ``answer``'s messages; TrainingError when the template renders the
    conversation with the answer as something other than a continuation of it without."""
    replied = template.render(list(before), tools=tools)
    full = template.render([*before, *answer], add_generation_prompt=True, tools=tools)
    marker = template.end_of_turn
    end = replied.rfind(marker)
    if end < 0 or not full.startswith(replied[: end + len(marker)]):
        raise TrainingError(
            f"the chat template {template.name} renders a conversation with an answer to the "
            "assistant (a tool's result, an environment's reply) that does not continue the "
            "one without it, so the answer cannot be appended to a rollout; use a template "
            "that renders such messages after the assistant's turn (Qwen 2.5/3, Llama 3.x)"
        )
    return tokenizer.encode(full[end + len(marker) :], special=True)
