"""Chat templates: render a conversation the way a model was tuned to read it, and say which
parts of the text are trained.

A chat template is the Jinja2 source a model ships (``tokenizer.chat_template`` in GGUF,
``chat_template`` in tokenizer_config.json); it sees ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, ``tools``, ``documents`` and any extra variables (``enable_thinking``
for Qwen3 and SmolLM3, ``xml_tools``...). A message has a ``role`` and a string ``content``; an
assistant message may carry ``tool_calls`` and ``reasoning_content`` (its thinking), a ``tool``
message (a tool's result) a ``name`` and ``tool_call_id``. The template comes from a file, so it
is untrusted code: it only ever runs in Jinja's immutable sandbox, set up as transformers sets it
up (same whitespace handling, extensions and helpers, see ``helpers``: ``tojson``,
``raise_exception``, ``strftime_now``, loop controls, ``{% generation %}``), and sees only
plain JSON data, so a template renders here byte for byte as ``apply_chat_template`` renders
it. Every render has a
budget of steps, characters, nesting and time (``sandbox``), so a template cannot hang or
exhaust memory either.

A failure is blamed on what is at fault: a template that goes past its budget, tries an unsafe
operation, or fails on a plain conversation as well is a :class:`TemplateFault` (the fix is
another template, whatever the data); a template that renders a plain conversation but not
this one (a ``raise_exception`` on the order of roles) is a DataError about the conversation.

Which text is trained is found without knowing the template: what assistant message ``i`` adds
is the render of the first ``i + 1`` messages minus the render of the first ``i`` with the
generation prompt (the assistant header the model is prompted with). Templates that render a
conversation turn by turn make each such render a prefix of the next; others are refused, as
are conversations a template rewrites once they go on (Qwen3's drops the thinking of assistant
turns before the last user message, so such a turn is not trained as the model writes it).
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from jinja2.exceptions import SecurityError, TemplateSyntaxError

from llamatrain.chat_template.budget import BUDGET, OverBudget
from llamatrain.chat_template.helpers import TemplateRefused
from llamatrain.chat_template.sandbox import environment, render
from llamatrain.errors import ConfigError, DataError, shown

__all__ = [
    "BUILTIN_TEMPLATES",
    "ROLES",
    "ChatTemplate",
    "Segment",
    "TemplateFault",
]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (``tool``: a tool's result, which templates with tools read)."""

_OPTIONAL_KEYS = {
    "assistant": {"tool_calls": list, "reasoning_content": str},
    "tool": {"name": str, "tool_call_id": str},
}
"""Keys a message of a role may have besides ``role`` and ``content``, with their JSON type."""

_RESERVED = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"}
)
"""Template variables set from :meth:`ChatTemplate.render`'s own arguments."""

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
"""A conversation rendered to learn how the template ends an assistant turn, and whether a
failure is the template's (it fails on this too) or the conversation's."""
_BUILTIN = (
    "data.chat_template = 'chatml' (or "
    f"{', '.join(repr(n) for n in list(BUILTIN_TEMPLATES)[1:])}; --chat-template NAME for "
    "generate --chat)"
)
_FIX = f"use a built-in template instead: {_BUILTIN}"
"""What to do about a template at fault."""


class TemplateFault(ConfigError):
    """The chat template itself is unusable, whatever the conversation: no line of the data
    would render with it, so skipping lines cannot help; the fix is another template (a
    setting, hence a ConfigError rather than a DataError about a line)."""


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
            self._template = environment().from_string(source)
        except TemplateSyntaxError as e:
            raise TemplateFault(
                f"{name} is not a valid Jinja template: {_one_line(e.message)} "
                f"(template line {e.lineno}); {_FIX}"
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The conversation as the model reads it; with ``add_generation_prompt``, followed by
        what prompts the model for the next assistant turn. ``tools`` (JSON schemas of the
        functions the model may call), ``documents`` and ``variables`` (``enable_thinking=False``)
        reach the template as ``apply_chat_template``'s keyword arguments do; DataError for a
        value that is not plain JSON data."""
        context = _context(tools, documents, variables)
        return self._render(_checked(messages), add_generation_prompt, context)

    def segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> list[Segment]:
        """The rendered conversation (as :meth:`render` renders it with the same arguments) cut
        into alternating untrained and trained pieces that join back into it exactly. Text
        after an assistant turn's end-of-turn marker (chatml's newline) is untrained: the model
        stops before it. A conversation without an assistant turn is one untrained piece."""
        chat, context = _checked(messages), _context(tools, documents, variables)
        shapes: dict = {}  # the renders of one conversation measure its data once
        whole = self._render(chat, False, context, shapes)
        pieces: list[Segment] = []
        done = 0
        for start, end in self._assistant_spans(chat, whole, context, shapes):
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
        whole = self._render(_PROBE, False, _context(None, None, {}))
        (start, end), *_ = self._assistant_spans(_PROBE, whole, _context(None, None, {}))
        turn, reply = whole[start:end], _PROBE[-1]["content"]
        at = turn.rfind(reply)
        return turn[at + len(reply) :].strip() if at >= 0 else ""

    def _turn_end(self, turn: str) -> int:
        """Where the trained part of an assistant turn's text ends: after its last end-of-turn
        marker, else (no marker in it) at its end."""
        at = turn.rfind(self._marker) if self._marker else -1
        return at + len(self._marker) if at >= 0 else len(turn)

    def _assistant_spans(
        self,
        chat: list[dict[str, Any]],
        whole: str,
        context: dict[str, Any],
        shapes: dict | None = None,
    ) -> list[tuple[int, int]]:
        """``(start, end)`` in ``whole`` of the text each assistant message adds, found by
        rendering prefixes of the conversation."""
        spans, done = [], 0
        for i, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            before = self._render(chat[:i], True, context, shapes)
            after = self._render(chat[: i + 1], False, context, shapes)
            if whole.startswith(before) and len(before) <= len(after) and done <= len(before):
                if not whole.startswith(after):
                    raise DataError(
                        f"{self.name} does not render a conversation turn by turn: it writes "
                        f"assistant message {i + 1} differently once later messages follow "
                        "(Qwen3's template drops the thinking of turns before the last user "
                        "message), so that turn would not be trained as the model writes it; "
                        "end the conversation at that turn (one line per turn), or for Qwen3 "
                        "give each assistant turn after the last user message a "
                        "reasoning_content"
                    )
            else:
                problem = (
                    f"{self.name} does not render a conversation turn by turn (its render of "
                    f"the first {i} messages with the generation prompt does not begin its "
                    f"render of the first {i + 1}), so the assistant turns cannot be told apart"
                )
                if chat is not _PROBE and not self._splits_plain_chat:
                    raise TemplateFault(f"{problem}, not even in a plain conversation; {_FIX}")
                raise DataError(f"{problem}; use a template that does, e.g. {_BUILTIN}")
            spans.append((len(before), len(after)))
            done = len(after)
        return spans

    def _render(
        self,
        chat: list[dict[str, Any]],
        add_generation_prompt: bool,
        context: dict[str, Any],
        shapes: dict | None = None,
    ) -> str:
        try:
            return self._render_unchecked(chat, add_generation_prompt, context, shapes)
        except Exception as e:  # the template is user code: any failure of it is the user's
            raise self._fault(e, _chars(chat) + _chars(context)) from None

    def _render_unchecked(
        self,
        chat: list[dict[str, Any]],
        add_generation_prompt: bool,
        context: dict[str, Any],
        shapes: dict | None = None,
    ) -> str:
        variables = {
            **context,
            "messages": chat,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        return render(self._template, variables, shapes)

    def _fault(self, error: Exception, given: int) -> DataError | TemplateFault:
        """The one-line error for a failed render, blaming the template when it is at fault
        whatever the conversation, else the conversation: ``given`` characters of it (and
        its tools) past a quarter of the budget are the conversation's fault when it runs out
        (a template writes its conversation a few times over)."""
        where = _template_line(error)
        at = f" (template line {where})" if where else ""
        if isinstance(error, OverBudget) and given > BUDGET.chars // 4:
            return DataError(
                f"this conversation holds {given:,} characters, too many for one render of "
                f"{self.name} ({error}); shorten or split it"
            )
        if isinstance(error, OverBudget | RecursionError | MemoryError):
            what = (
                f"went {error}"
                if isinstance(error, OverBudget)
                else f"ran out ({_error_name(error)})"
            )
            return TemplateFault(
                f"{self.name} {what}{at}; a chat template needs a tiny fraction of that, so "
                f"this one is broken or hostile: {_FIX}"
            )
        if isinstance(error, SecurityError):
            return TemplateFault(
                f"{self.name} tried an unsafe operation, which the sandbox stopped "
                f"({_one_line(error)}){at}; {_FIX}"
            )
        if isinstance(error, TemplateRefused):
            what = f"refused the conversation: {_one_line(error)}"
        else:
            what = f"failed to render: {type(error).__name__}: {_one_line(error)}{at}"
        if self._renders_plain_chat:
            return DataError(f"{self.name} {what}")
        return TemplateFault(
            f"{self.name} {what}; it fails on a plain user/assistant conversation too, so the "
            f"fault is the template, not the data: {_FIX}"
        )

    @cached_property
    def _renders_plain_chat(self) -> bool:
        """Whether the template renders a plain conversation (with and without a system
        message, with the generation prompt): if not, no line of data would render."""
        context = _context(None, None, {})
        for chat in (_PROBE, [{"role": "system", "content": "Be brief."}, *_PROBE]):
            try:
                self._render_unchecked(chat, False, context)
                self._render_unchecked(chat[:-1], True, context)
                return True
            except Exception:  # what failed is reported from the line that failed
                continue
        return False

    @cached_property
    def _splits_plain_chat(self) -> bool:
        """Whether the template renders a plain conversation turn by turn."""
        try:
            self._marker  # noqa: B018 (found by splitting the probe conversation)
        except (DataError, ConfigError):
            return False
        return True


def _context(
    tools: Sequence[Mapping[str, Any]] | None,
    documents: Sequence[Mapping[str, Any]] | None,
    variables: Mapping[str, Any],
) -> dict[str, Any]:
    """The template variables besides the messages, as plain JSON data: ``tools`` and
    ``documents`` (None when not given: templates test ``tools is not none``) and the extra
    variables, whose names must not shadow the others'."""
    for name in variables:
        if name in _RESERVED or not name.isidentifier() or keyword.iskeyword(name):
            raise DataError(f"{name!r} cannot be a chat template variable")
    context = {"tools": tools, "documents": documents, **variables}
    for name in ("tools", "documents"):
        value = context[name]
        if value is not None and not (
            isinstance(value, Sequence)
            and not isinstance(value, str | bytes)
            and all(isinstance(item, Mapping) for item in value)
        ):
            raise DataError(f"{name} must be a list of JSON objects, not a {type(value).__name__}")
    return {name: _plain(value, name) for name, value in context.items()}


def _plain(value: Any, where: str) -> Any:
    """A fresh copy of ``value`` made of JSON types only (dict with string keys, list, str,
    int, float, bool, None), so a template reaches no Python object's methods; DataError naming
    ``where`` for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        if not all(type(key) is str for key in value):
            raise DataError(f"{where} has a key that is not a string")
        return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise DataError(f"{where} is of type {type(value).__name__}, which is not JSON data")


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fresh plain copies of the messages (so a template sees nothing but JSON data); DataError
    for an empty conversation or a malformed message."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise DataError(f"a conversation is a list of messages, not a {type(messages).__name__}")
    if not messages:
        raise DataError("the conversation is empty; give it at least one message")
    return [_checked_message(number, m) for number, m in enumerate(messages, start=1)]


def _checked_message(number: int, message: object) -> dict[str, Any]:
    """A message is ``{"role": str, "content": str}`` plus the optional keys of its role
    (:data:`_OPTIONAL_KEYS`): another key (a ``weight``) would be silently ignored, so it is
    refused instead. A ``reasoning_content`` is also given as ``thinking`` (which gpt-oss
    templates read), as transformers gives it."""
    if not isinstance(message, Mapping):
        raise DataError(
            f'message {number} is a {type(message).__name__}, not {{"role": ..., "content": ...}}'
        )
    role = message.get("role")
    if type(role) is not str or role not in ROLES:
        raise DataError(f"message {number} has role {role!r}; a role is one of {', '.join(ROLES)}")
    optional = _OPTIONAL_KEYS.get(role, {})
    if not {"role", "content"} <= set(message) <= {"role", "content", *optional}:
        keys = ", ".join(map(repr, message)) or "none"
        extra = f" (and optionally {', '.join(map(repr, optional))})" if optional else ""
        raise DataError(
            f"message {number} has keys {keys}; {'an' if role == 'assistant' else 'a'} {role} "
            f'message has "role" and "content"{extra}'
        )
    for key, kind in {"content": str, **optional}.items():
        if key in message and type(message[key]) is not kind:
            raise DataError(
                f"message {number} has {key} of type {type(message[key]).__name__}; "
                f"{key} is a {'string' if kind is str else 'list'}"
            )
    if any(not isinstance(call, Mapping) for call in message.get("tool_calls", ())):
        raise DataError(f"message {number} has a tool call that is not a JSON object")
    checked = _plain(dict(message), f"message {number}")
    if "reasoning_content" in checked:  # transformers' _alias_reasoning_fields, key order too
        checked = {"thinking": checked["reasoning_content"], **checked}
    return checked


def _append(pieces: list[Segment], text: str, *, trained: bool) -> None:
    """Add ``text`` to ``pieces``, merged into the last piece when it is of the same kind."""
    if not text:
        return
    if pieces and pieces[-1].trained == trained:
        pieces[-1] = Segment(pieces[-1].text + text, trained)
    else:
        pieces.append(Segment(text, trained))


def _template_line(error: BaseException) -> int | None:
    """The line of the template a render failed on (Jinja puts the template's lines in the
    traceback), or None."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _error_name(error: BaseException) -> str:
    return f"{type(error).__name__}: {_one_line(error)}" if str(error) else type(error).__name__


def _chars(value: Any) -> int:
    """The characters of a conversation's texts (its strings, in lists and mappings), keys
    included: what a template has to write out."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(map(_chars, value))
    return 0


def _one_line(error: object) -> str:
    """An error's text on one line (messages from templates may span several), control
    characters escaped (a template's raise_exception text is the template author's)."""
    return shown(" ".join(str(error).split()), 300)
