"""Chat templates: rendering (checked against transformers' own renderer), the split into
trained and untrained text, end-of-turn markers, the sandbox and the errors users can cause."""

from __future__ import annotations

import re
from datetime import date

import pytest
from transformers.utils.chat_template_utils import render_jinja_template
from user_errors import error_of

from llamatrain.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    Segment,
    chat_template_for,
)
from llamatrain.config import load_config
from llamatrain.config.sections import CHAT_TEMPLATE_NAMES

TOKENS = {  # the BOS/EOS text each family's vocabulary has
    "chatml": ("", "<|im_end|>"),
    "llama-3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-2": ("<s>", "</s>"),
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama-3": "<|eot_id|>", "llama-2": "</s>"}
"""What each family ends an assistant turn with, as its model card documents."""


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS = {
    "single turn": [msg("user", "Hi"), msg("assistant", "Hello!")],
    "system, two turns": [
        msg("system", "You are terse."),
        msg("user", "What is 2+2?"),
        msg("assistant", "4"),
        msg("user", "And 3+3?\nShow <work> & all."),
        msg("assistant", "6, since 3 + 3 = 6.\nDone."),
    ],
    "ends with a user turn": [
        msg("user", "Translate 'chat' — en français?"),
        msg("assistant", "« chat » means cat. 日本語: 猫"),
        msg("user", "Thanks"),
    ],
    "user only": [msg("user", "Anyone there?")],
}


def template(name: str) -> ChatTemplate:
    bos, eos = TOKENS[name]
    return ChatTemplate(BUILTIN_TEMPLATES[name], bos_token=bos, eos_token=eos)


def transformers_render(source: str, messages, bos: str, eos: str, generation: bool) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=source,
        add_generation_prompt=generation,
        bos_token=bos,
        eos_token=eos,
    )
    return rendered[0]


@pytest.mark.parametrize("generation", [False, True])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_builtins_render_as_transformers_does(name, conversation, generation):
    messages = CONVERSATIONS[conversation]
    bos, eos = TOKENS[name]
    ours = template(name).render(messages, add_generation_prompt=generation)
    assert ours == transformers_render(BUILTIN_TEMPLATES[name], messages, bos, eos, generation)


FEATURE_TEMPLATES = {
    # trim_blocks / lstrip_blocks: indented multi-line templates render without stray blanks.
    "blocks": (
        "{% for message in messages %}\n"
        "    {% if message['role'] == 'system' %}\n"
        "[SYS] {{ message['content'] }}\n"
        "    {% else %}\n"
        "<{{ message['role'] }}> {{ message['content'] }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    ),
    # tojson without HTML escaping, with options.
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
    # tools and documents are none, as Mistral's and Command-R's templates test.
    "tools": (
        "{% if tools is not none %}[TOOLS]{{ tools | length }}{% endif %}"
        "{% if documents is none %}no documents{% endif %}"
    ),
    # loopcontrols ({% break %} / {% continue %}) and namespace.
    "loops": (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m.content }};{% if ns.n == 2 %}{% break %}{% endif %}"
        "{% endfor %}{{ ns.n }}"
    ),
}


@pytest.mark.parametrize("feature", FEATURE_TEMPLATES)
def test_template_features_render_as_transformers_does(feature):
    source = FEATURE_TEMPLATES[feature]
    messages = CONVERSATIONS["system, two turns"]
    ours = ChatTemplate(source).render(messages)
    assert ours == transformers_render(source, messages, "", "", False)


def test_strftime_now_is_today():
    before = date.today().isoformat()
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([msg("user", "x")])
    assert rendered in {before, date.today().isoformat()}  # the day may turn meanwhile


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_segments_join_back_and_train_exactly_the_assistant_turns(name, conversation):
    messages = CONVERSATIONS[conversation]
    chat = template(name)
    segments = chat.segments(messages)
    assert "".join(s.text for s in segments) == chat.render(messages)
    assert all(s.text for s in segments)
    assert all(a.trained != b.trained for a, b in zip(segments, segments[1:], strict=False))
    trained = [s.text for s in segments if s.trained]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(trained) == len(replies)
    for text, reply in zip(trained, replies, strict=True):
        # The reply and its marker; a template may space them (llama-2 writes " reply </s>").
        pattern = r"\s?" + re.escape(reply) + r"\s?" + re.escape(END_OF_TURN[name])
        assert re.fullmatch(pattern, text), (text, reply)


def test_segments_of_chatml_leave_the_newline_after_the_marker_untrained():
    messages = CONVERSATIONS["single turn"]
    assert template("chatml").segments(messages) == [
        Segment("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        Segment("Hello!<|im_end|>", True),
        Segment("\n", False),
    ]


def test_the_generation_prompt_is_what_precedes_a_trained_reply():
    messages = CONVERSATIONS["system, two turns"]
    for name in BUILTIN_TEMPLATES:
        chat = template(name)
        segments = chat.segments(messages)
        first_reply = segments.index(next(s for s in segments if s.trained))
        prompt = "".join(s.text for s in segments[:first_reply])
        assert prompt == chat.render(messages[:2], add_generation_prompt=True)


def test_a_conversation_without_assistant_turns_is_one_untrained_segment():
    messages = CONVERSATIONS["user only"]
    chat = template("llama-3")
    assert chat.segments(messages) == [Segment(chat.render(messages), False)]


@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_end_of_turn(name):
    assert template(name).end_of_turn == END_OF_TURN[name]


def test_end_of_turn_needs_a_marker():
    no_eos = ChatTemplate(BUILTIN_TEMPLATES["llama-2"], bos_token="<s>", eos_token="")
    assert "no marker" in error_of(lambda: no_eos.end_of_turn)
    # Without a marker the whole turn is trained (there is nothing to stop at).
    segments = no_eos.segments(CONVERSATIONS["single turn"])
    assert [s.text for s in segments if s.trained] == [" Hello! "]


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(messages[0]) }}",
        "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",
    ],
)
def test_sandbox_refuses_escapes_and_mutation(source):
    message = error_of(ChatTemplate(source).render, [msg("user", "x")])
    assert "unsafe" in message and "sandbox" in message


@pytest.mark.parametrize(
    "source", ["{{ ''|attr('__class__') }}", "{{ '{0.__class__}'.format(1) }}"]
)
def test_sandbox_hides_internals_from_attr_and_format(source):
    # An unsafe attribute reached this way is undefined (as in transformers): it renders as "".
    assert ChatTemplate(source).render([msg("user", "x")]) == ""


def test_messages_reach_the_template_as_copies():
    messages = [msg("user", "x")]
    ChatTemplate("{% set m = messages[0] %}{{ m.content }}").render(messages)
    assert messages == [msg("user", "x")]


def test_syntax_error_names_the_problem_and_line():
    message = error_of(ChatTemplate, "{% for m in messages %}\n{{ m.content }", name="the model's")
    assert message.startswith("the model's is not a valid Jinja template")
    assert "line 2" in message


def test_raise_exception_refuses_the_conversation():
    llama2 = template("llama-2")
    message = error_of(llama2.render, [msg("assistant", "I speak first")])
    assert "refused the conversation: Conversation roles must alternate" in message


ESCAPES = "\x1b]0;owned\x07\x1b[2J\r\u009b31m\u202e"
"""A title change, a screen clear, a carriage return, a C1 CSI and a bidi override."""


@pytest.mark.parametrize(
    "source",
    ["{{ raise_exception('" + ESCAPES + "') }}",  # the template's own words
     "{{ raise_exception(messages[0].content) }}",  # the conversation's, through it
     "{{ messages[0].content + 1 }}{{ '" + ESCAPES + "' }}",
     "{% for m in messages %}{{ m.content | int(1/0) }}{% endfor %}"],
)  # fmt: skip
def test_what_a_template_or_conversation_says_reaches_no_terminal_raw(source, capsys):
    """Issue 37, item 6: raise_exception's text and conversation text were quoted raw, so a
    model's template could clear the terminal or forge lines through an error message."""
    message = error_of(ChatTemplate(source).render, [msg("user", ESCAPES)])
    assert message.isprintable(), message
    assert "\\x1b" in message or "failed to render" in message


def test_a_conversation_too_large_to_render_is_its_fault_not_the_templates():
    """Issue 37: a 54 MB chat line went past the render budget of the built-in template, and
    the message called that template "broken or hostile" and suggested it again."""
    chat = [msg("user", "x" * 40_000_000), msg("assistant", "y")]
    message = error_of(template("chatml").render, chat)
    assert message.startswith("this conversation holds 40,000,0")
    assert "shorten or split it" in message and "hostile" not in message


def test_a_failing_template_is_a_data_error():
    message = error_of(ChatTemplate("{{ messages[0].content + 1 }}").render, [msg("user", "x")])
    assert "failed to render: TypeError" in message


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "conversation is empty"),
        ("hello", "list of messages, not a str"),
        (["hello"], "message 1 is a str"),
        ([msg("user", "a"), {"role": "assistant"}], "message 2 has keys 'role'; an assistant"),
        ([{"role": "user", "content": "a", "weight": 0}], "keys 'role', 'content', 'weight'"),
        ([msg("developer", "a")], "message 1 has role 'developer'; a role is one of system, user"),
        (
            [{"role": "user", "content": "a", "name": "x"}],
            "keys 'role', 'content', 'name'; a user message has \"role\"",
        ),
        ([{"role": 1, "content": "a"}], "has role 1"),
        ([{"role": "user", "content": None}], "content of type NoneType; content is a string"),
        ([{"role": "user", "content": [{"type": "text"}]}], "content of type list"),
    ],
)
def test_bad_conversations(messages, fragment):
    chat = template("chatml")
    assert fragment in error_of(chat.render, messages)
    assert fragment in error_of(chat.segments, messages)


@pytest.mark.parametrize(
    "source",
    [
        # The number of messages first: every render starts differently.
        "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
        # A closing line only without the generation prompt.
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if not add_generation_prompt %}<end>{% endif %}",
    ],
)
def test_a_template_that_does_not_render_turn_by_turn_is_refused(source):
    message = error_of(ChatTemplate(source).segments, CONVERSATIONS["system, two turns"])
    assert "does not render a conversation turn by turn" in message


def test_chat_template_for():
    model = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    chosen = chat_template_for("auto", model, bos_token="<s>", eos_token="</s>")
    assert chosen.render([msg("user", "a")]) == "a</s>"
    for name in BUILTIN_TEMPLATES:
        chosen = chat_template_for(name, model, bos_token="<s>", eos_token="</s>")
        assert chosen.source == BUILTIN_TEMPLATES[name]
        assert (chosen.bos_token, chosen.eos_token) == ("<s>", "</s>")
    missing = error_of(chat_template_for, "auto", None, bos_token="", eos_token="")
    assert "set data.chat_template to one of chatml, llama-3, llama-2" in missing
    unknown = error_of(chat_template_for, "vicuna", model, bos_token="", eos_token="")
    assert "'vicuna' is not a chat template" in unknown and "chatml, llama-3, llama-2" in unknown


def test_the_config_offers_exactly_the_builtin_templates():
    """``data.chat_template``'s names are spelled in the config layer, which sits below
    ``llamatrain.data`` and cannot import BUILTIN_TEMPLATES: the two lists must not drift."""
    assert set(CHAT_TEMPLATE_NAMES) == {"auto", *BUILTIN_TEMPLATES}


def test_a_template_file_is_read_and_a_missing_one_refused(tmp_path):
    """Any other ``data.chat_template`` is a Jinja file (the one llama-server is given):
    validation makes it absolute and refuses one that is not there; the data side reads it."""
    model = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    chosen = chat_template_for(str(tmp_path / "t.jinja"), model, bos_token="", eos_token="")
    assert chosen.render([msg("user", "a")]) == "[a]"
    missing = error_of(chat_template_for, "vicuna.jinja", model, bos_token="", eos_token="")
    assert "'vicuna.jinja' is not a chat template (No such file" in missing
    cfg = load_config(None, [f"data.chat_template={tmp_path / 't.jinja'}"])
    assert cfg.data.chat_template == str(tmp_path / "t.jinja")
    refused = error_of(load_config, None, ["data.chat_template=vicuna"])
    assert "'vicuna', neither one of 'auto', 'chatml'" in refused
