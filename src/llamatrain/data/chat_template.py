"""Chat templates: render a conversation the way a model was tuned to read it, and say which
parts of the text are trained.

A chat template is the Jinja2 source a model ships (``tokenizer.chat_template`` in GGUF,
``chat_template`` in tokenizer_config.json); it sees ``messages`` (``role``/``content``),
``add_generation_prompt``, ``bos_token`` and ``eos_token``. It comes from a file, so it is
untrusted code: it only ever runs in Jinja's immutable sandbox, set up as transformers sets it
up (same whitespace handling and helpers), so a template renders here exactly as it does there.

Which text is trained is found without knowing the template: what assistant message ``i`` adds
is the render of the first ``i + 1`` messages minus the render of the first ``i`` with the
generation prompt (the assistant header the model is prompted with). Templates that render a
conversation turn by turn make each such render a prefix of the next; others are refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache, cached_property
from typing import Any, NoReturn

from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamatrain.errors import DataError

__all__ = ["BUILTIN_TEMPLATES", "ROLES", "ChatTemplate", "Segment", "chat_template_for"]

ROLES = ("system", "user", "assistant")
"""The roles a message may have."""

BUILTIN_TEMPLATES: dict[str, str] = {
    # ChatML as SmolLM-Instruct and Qwen ship it, without a default system prompt.
    "chatml": (
        "{% for message in messages %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta-Llama-3-8B-Instruct's: contents are trimmed; BOS is written before the first message.
    "llama-3": (
        "{% set loop_messages = messages %}"
        "{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"
    ),
    # Llama-2-7b-chat-hf's: the system message goes inside the first [INST]; every user turn
    # starts with BOS; roles must alternate; there is no generation prompt (the [/INST] is it).
    "llama-2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
        "{% else %}"
        "{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}"
        "{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' "
        "+ message['content'] %}"
        "{% else %}"
        "{% set content = message['content'] %}"
        "{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ ' '  + content.strip() + ' ' + eos_token }}"
        "{% endif %}"
        "{% endfor %}"
    ),
}
"""Templates by name (``data.chat_template``), exactly as those model families ship them."""

_PROBE = [
    {"role": "user", "content": "Say something."},
    {"role": "assistant", "content": "Something-probe-reply."},
]
"""A conversation rendered to learn how the template ends an assistant turn."""


@dataclass(frozen=True)
class Segment:
    """A consecutive piece of a rendered conversation."""

    text: str
    trained: bool
    """True for an assistant turn: its content and the end-of-turn marker after it (what the
    model must learn to write, including when to stop)."""


class ChatTemplate:
    """A compiled chat template with the special tokens it writes."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "the chat template",
    ) -> None:
        """Compile ``source``; DataError (naming it as ``name``) if it is not valid Jinja."""
        self.source, self.bos_token, self.eos_token, self.name = source, bos_token, eos_token, name
        try:
            self._template = _sandbox().from_string(source)
        except TemplateSyntaxError as e:
            raise DataError(
                f"{name} is not a valid Jinja template: {_one_line(e.message)} "
                f"(template line {e.lineno}); fix it or set data.chat_template to a built-in"
            ) from None

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False
    ) -> str:
        """The conversation as the model reads it; with ``add_generation_prompt``, followed by
        what prompts the model for the next assistant turn."""
        return self._render(_checked(messages), add_generation_prompt)

    def segments(self, messages: Sequence[Mapping[str, Any]]) -> list[Segment]:
        """The rendered conversation cut into alternating untrained and trained pieces that
        join back into :meth:`render` exactly. Text after an assistant turn's end-of-turn
        marker (chatml's newline) is untrained: the model stops before it. A conversation
        without an assistant turn is one untrained piece."""
        chat = _checked(messages)
        whole = self._render(chat, False)
        pieces: list[Segment] = []
        done = 0
        for start, end in self._assistant_spans(chat, whole):
            _append(pieces, whole[done:start], trained=False)
            cut = self._turn_end(whole[start:end])
            _append(pieces, whole[start : start + cut], trained=True)
            _append(pieces, whole[start + cut : end], trained=False)
            done = end
        _append(pieces, whole[done:], trained=False)
        return pieces

    @property
    def end_of_turn(self) -> str:
        """The marker an assistant turn ends with (``<|im_end|>``, ``<|eot_id|>``, ``</s>``):
        generation stops there. DataError if the template ends turns with nothing (llama-2's
        ends them with ``eos_token``, so it needs one)."""
        if not self._marker:
            raise DataError(
                f"{self.name} ends an assistant turn with no marker, so generation cannot "
                "know where a reply stops; give the model an EOS token or use a template "
                "that closes turns"
            )
        return self._marker

    @cached_property
    def _marker(self) -> str:
        """What follows the probe reply in its turn, without whitespace; "" if nothing."""
        whole = self._render(_PROBE, False)
        (start, end), *_ = self._assistant_spans(_PROBE, whole)
        turn, reply = whole[start:end], _PROBE[-1]["content"]
        at = turn.rfind(reply)
        return turn[at + len(reply) :].strip() if at >= 0 else ""

    def _turn_end(self, turn: str) -> int:
        """Where the trained part of an assistant turn's text ends: after its last end-of-turn
        marker, else (no marker in it) at its end."""
        at = turn.rfind(self._marker) if self._marker else -1
        return at + len(self._marker) if at >= 0 else len(turn)

    def _assistant_spans(self, chat: list[dict[str, str]], whole: str) -> list[tuple[int, int]]:
        """``(start, end)`` in ``whole`` of the text each assistant message adds, found by
        rendering prefixes of the conversation."""
        spans, done = [], 0
        for i, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            before = self._render(chat[:i], True)
            after = self._render(chat[: i + 1], False)
            if not (whole.startswith(before) and whole.startswith(after)) or not (
                done <= len(before) <= len(after)
            ):
                raise DataError(
                    f"{self.name} does not render a conversation turn by turn (its render of "
                    f"the first {i} messages with the generation prompt does not begin its "
                    f"render of the first {i + 1}), so the assistant turns cannot be told "
                    "apart; use a template that does, e.g. data.chat_template = 'chatml'"
                )
            spans.append((len(before), len(after)))
            done = len(after)
        return spans

    def _render(self, chat: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                # Defined as transformers defines them: templates test `tools is not none`.
                tools=None,
                documents=None,
            )
        except _TemplateRefused as e:
            raise DataError(f"{self.name} refused the conversation: {_one_line(e)}") from None
        except SecurityError as e:
            raise DataError(
                f"{self.name} tried an unsafe operation, which the sandbox stopped "
                f"({_one_line(e)}); use the model's published template or a built-in"
            ) from None
        except Exception as e:  # the template is user code: any failure of it is the user's
            raise DataError(
                f"{self.name} failed to render: {type(e).__name__}: {_one_line(e)}"
            ) from None


def chat_template_for(
    choice: str, model_template: str | None, *, bos_token: str, eos_token: str
) -> ChatTemplate:
    """The template ``data.chat_template = choice`` names: ``"auto"`` the model's own
    (``model_template``), a :data:`BUILTIN_TEMPLATES` name that one."""
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
    raise DataError(
        f"data.chat_template = {choice!r} is not a chat template; choose auto (the model's "
        f"own) or one of {', '.join(BUILTIN_TEMPLATES)}"
    )


class _TemplateRefused(TemplateError):
    """A template's ``raise_exception(message)``: it refuses the conversation on purpose."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRefused(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as templates expect it: Jinja's own ``tojson`` escapes ``<``, ``>`` and ``&`` for
    HTML, which would change the text the model reads."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Today's date for templates that put it in the system prompt (Llama 3.1)."""
    return datetime.now().strftime(format)


@cache
def _sandbox() -> ImmutableSandboxedEnvironment:
    """The environment every template compiles in: immutable sandbox (no attribute access to
    Python internals, no mutating the messages), with transformers' settings and helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Fresh plain copies of the messages (so a template sees nothing but strings); DataError
    for an empty conversation or a malformed message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise DataError(f"a conversation is a list of messages, not a {type(messages).__name__}")
    if not messages:
        raise DataError("the conversation is empty; give it at least one message")
    return [_checked_message(number, m) for number, m in enumerate(messages, start=1)]


def _checked_message(number: int, message: object) -> dict[str, str]:
    """A message is exactly ``{"role": str, "content": str}``: another key (a ``weight``, a
    ``name``) would be silently ignored, so it is refused instead."""
    if not isinstance(message, Mapping):
        raise DataError(
            f'message {number} is a {type(message).__name__}, not {{"role": ..., "content": ...}}'
        )
    if set(message) != {"role", "content"}:
        keys = ", ".join(map(repr, message)) or "none"
        raise DataError(
            f'message {number} has keys {keys}; a message has exactly "role" and "content"'
        )
    role, content = message["role"], message["content"]
    if type(role) is not str or role not in ROLES:
        raise DataError(f"message {number} has role {role!r}; a role is one of {', '.join(ROLES)}")
    if type(content) is not str:
        raise DataError(
            f"message {number} has content of type {type(content).__name__}; content is a string"
        )
    return {"role": role, "content": content}


def _append(pieces: list[Segment], text: str, *, trained: bool) -> None:
    """Add ``text`` to ``pieces``, merged into the last piece when it is of the same kind."""
    if not text:
        return
    if pieces and pieces[-1].trained == trained:
        pieces[-1] = Segment(pieces[-1].text + text, trained)
    else:
        pieces.append(Segment(text, trained))


def _one_line(error: object) -> str:
    """An error's text on one line (messages from templates may span several)."""
    return " ".join(str(error).split())
