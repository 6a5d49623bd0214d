"""Which chat template renders a model's conversations: ``data.chat_template`` (and
``--chat-template`` for ``generate --chat``) chooses the model's own (``"auto"``), a built-in
one by name, or a Jinja file (the one ``llama-server --jinja --chat-template-file`` is given,
so that both sides render and parse the same format: a template with tools for a model whose
own has none), written with the special tokens of the model's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llamatrain.chat_template.render import BUILTIN_TEMPLATES, ChatTemplate
from llamatrain.errors import DataError

if TYPE_CHECKING:
    from llamatrain.tokenizer import Tokenizer

__all__ = ["chat_template_for", "resolve_chat_template"]


def resolve_chat_template(
    choice: str, model_template: str | None, tokenizer: Tokenizer
) -> ChatTemplate | None:
    """The template conversations are rendered with: the model's own (``"auto"``) or a builtin
    chosen by name; None for ``"auto"`` when the model has none (an error only once a line
    holds a conversation, so text-only JSONL needs no template)."""
    if choice == "auto" and model_template is None:
        return None
    return chat_template_for(
        choice,
        model_template,
        bos_token=_token_text(tokenizer, tokenizer.bos_id),
        eos_token=_token_text(tokenizer, tokenizer.eos_id),
    )


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A special token as a template writes it (``<s>``, ``<|begin_of_text|>``): its piece in
    the vocabulary, which ``decode`` leaves out for control tokens."""
    pieces = getattr(tokenizer, "pieces", None) or tokenizer.tokens  # SPM or byte-level BPE
    return pieces[token_id]


def chat_template_for(
    choice: str, model_template: str | None, *, bos_token: str, eos_token: str
) -> ChatTemplate:
    """The template ``data.chat_template = choice`` names: ``"auto"`` the model's own
    (``model_template``), a :data:`BUILTIN_TEMPLATES` name that one, any other a template
    file's path."""
    tokens = {"bos_token": bos_token, "eos_token": eos_token}
    if choice == "auto":
        if not model_template:
            raise DataError(
                "the model has no chat template (tokenizer.chat_template); set "
                f"data.chat_template to one of {', '.join(BUILTIN_TEMPLATES)}"
            )
        return ChatTemplate(model_template, name="the model's chat template", **tokens)
    if choice in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[choice], name=f"the {choice} template", **tokens)
    return ChatTemplate(template_file_text(choice), name=choice, **tokens)


def template_file_text(choice: str) -> str:
    """The text of the template file ``choice`` names; DataError when there is none."""
    try:
        return Path(choice).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or "not UTF-8 text"
        raise DataError(
            f"data.chat_template = {choice!r} is not a chat template ({reason}); choose auto "
            f"(the model's own), one of {', '.join(BUILTIN_TEMPLATES)} or a Jinja template file"
        ) from None
