"""A rendered chat as the model is prompted with it: its token ids as llama.cpp's prompt path
makes them, which training and generation alike use so that a chat model reads at inference
exactly the tokens it was trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llamatrain.tokenizer import Tokenizer

__all__ = ["needs_bos", "prompt_ids"]


def needs_bos(tokenizer: Tokenizer, ids: Sequence[int]) -> bool:
    """Whether BOS goes in front of ``ids``: the tokenizer adds BOS and the text did not write
    it already (llama-3's template does), as llama.cpp's prompt path decides."""
    return tokenizer.add_bos and (not ids or ids[0] != tokenizer.bos_id)


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A rendered chat's token ids as llama.cpp tokenizes a prompt: control tokens in the text
    parsed into their ids, BOS first unless the text starts with it — the tokens a chat was
    trained on, so the model is prompted the same way."""
    ids = tokenizer.encode(text, special=True)
    return [tokenizer.bos_id, *ids] if needs_bos(tokenizer, ids) else ids
