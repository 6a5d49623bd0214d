"""Real chat templates of the families people finetune (Qwen2.5, Qwen3, Gemma 3, SmolLM3, in
tests/fixtures/chat_templates) render byte for byte as transformers renders them, with system
prompts, several turns, tools, tool calls and results, and thinking; the trained spans of a
conversation are found in them, or the conversation is refused in one clear line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template
from user_errors import error_of

from llamatrain.chat_template import ChatTemplate

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
FAMILIES = {  # template file, BOS and EOS text as each family's tokenizer has them
    "qwen2.5": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"),
    "gemma3": ("<bos>", "<eos>"),
    "smollm3": ("<|begin_of_text|>", "<|im_end|>"),
}
END_OF_TURN = {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "gemma3": "<end_of_turn>"}
END_OF_TURN["smollm3"] = "<|im_end|>"


def source(family: str) -> str:
    return (FIXTURES / f"{family}.jinja").read_text(encoding="utf-8")


def template(family: str) -> ChatTemplate:
    bos, eos = FAMILIES[family]
    return ChatTemplate(source(family), bos_token=bos, eos_token=eos, name=family)


def msg(role: str, content: str, **extra) -> dict:
    return {"role": role, "content": content, **extra}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city — «now», <b>live</b> & exact",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def call(city: str, *, as_string: bool = False) -> dict:
    arguments = f'{{"city": "{city}"}}' if as_string else {"city": city, "days": 1}
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


PLAIN = {
    "system, two turns": [
        msg("system", "You are terse."),
        msg("user", "What is 2+2?"),
        msg("assistant", "4"),
        msg("user", "And 3+3?\nShow <work> & all."),
        msg("assistant", "  6, since 3 + 3 = 6.\nDone.  "),
    ],
    "no system, ends with user": [
        msg("user", "Translate 'chat' — en français?"),
        msg("assistant", "« chat » means cat. 日本語: 猫"),
        msg("user", "Thanks"),
    ],
}
TOOL_TRACE = [
    msg("system", "You check the weather."),
    msg("user", "Weather in Zürich and Oslo?"),
    msg(
        "assistant",
        "",
        reasoning_content="I need both cities.",
        tool_calls=[call("Zürich"), call("Oslo", as_string=True)],
    ),
    msg("tool", '{"temp": 21}', name="get_weather", tool_call_id="a"),
    msg("tool", '{"temp": 12}', name="get_weather", tool_call_id="b"),
    msg("assistant", "Zürich 21 °C, Oslo 12 °C.", reasoning_content="\nBoth came back.\n"),
]
THINKING = [
    msg("system", "Be exact. /no_think"),
    msg("user", "Why is the sky blue?"),
    msg("assistant", "<think>\nRayleigh.\n</think>\n\nRayleigh scattering."),
    msg("user", "Short answer?"),
    msg("assistant", "Scattering.", reasoning_content="Keep it short."),
]
CASES = {  # family: [(case name, messages, keyword arguments)]
    "qwen2.5": [
        *((name, m, {}) for name, m in PLAIN.items()),
        ("tools", TOOL_TRACE, {"tools": TOOLS}),
        ("tools, no system", TOOL_TRACE[1:], {"tools": TOOLS}),
    ],
    "qwen3": [
        *((name, m, {}) for name, m in PLAIN.items()),
        ("tools", TOOL_TRACE, {"tools": TOOLS}),
        ("tools, no thinking", TOOL_TRACE, {"tools": TOOLS, "enable_thinking": False}),
        ("thinking", THINKING, {}),
        ("thinking off", THINKING, {"enable_thinking": False}),
    ],
    "gemma3": [(name, m, {}) for name, m in PLAIN.items()],
    "smollm3": [
        *((name, m, {}) for name, m in PLAIN.items()),
        ("no thinking", PLAIN["system, two turns"], {"enable_thinking": False}),
        ("/no_think in the system prompt", THINKING, {}),
        ("xml tools", TOOL_TRACE, {"xml_tools": TOOLS}),
        ("python tools", TOOL_TRACE, {"python_tools": TOOLS, "enable_thinking": False}),
    ],
}
PARAMS = [
    pytest.param(family, m, kw, id=f"{family}: {name}")
    for family, cases in CASES.items()
    for name, m, kw in cases
]


def transformers_render(family: str, messages, generation: bool, **kwargs) -> str:
    bos, eos = FAMILIES[family]
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=source(family),
        add_generation_prompt=generation,
        bos_token=bos,
        eos_token=eos,
        **kwargs,
    )
    return rendered[0]


@pytest.mark.parametrize("generation", [False, True])
@pytest.mark.parametrize("family, messages, kwargs", PARAMS)
def test_families_render_as_transformers_does(family, messages, kwargs, generation):
    ours = template(family).render(messages, add_generation_prompt=generation, **kwargs)
    assert ours == transformers_render(family, messages, generation, **kwargs)


def test_the_renders_use_what_they_were_given():
    """The comparisons above are not vacuous: tools, tool calls and results, and thinking
    reach the text."""
    qwen3 = template("qwen3").render(TOOL_TRACE, tools=TOOLS)
    assert '"description": "The weather in a city — «now», <b>live</b> & exact"' in qwen3
    assert '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 1}}' in qwen3
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in qwen3
    assert '<tool_response>\n{"temp": 12}\n</tool_response>' in qwen3
    assert "<think>\nBoth came back.\n</think>\n\nZürich" in qwen3
    prompt = template("qwen3").render(
        THINKING[:2], add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    smol = template("smollm3").render(THINKING)
    assert "Reasoning Mode: /no_think" in smol and "<think>\n\n</think>\nScattering." in smol
    assert "{'type': 'function'" in template("smollm3").render(TOOL_TRACE, xml_tools=TOOLS)
    assert (
        template("gemma3")
        .render(PLAIN["system, two turns"])
        .startswith("<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n")
    )


TRAINABLE = [  # conversations each family renders turn by turn
    ("qwen2.5", PLAIN["system, two turns"], {}),
    ("qwen2.5", TOOL_TRACE, {"tools": TOOLS}),
    ("qwen3", PLAIN["system, two turns"][:3], {}),
    ("qwen3", TOOL_TRACE, {"tools": TOOLS}),
    ("gemma3", PLAIN["system, two turns"], {}),
    ("smollm3", PLAIN["system, two turns"], {}),
    ("smollm3", PLAIN["system, two turns"], {"enable_thinking": False}),
    ("smollm3", TOOL_TRACE, {"xml_tools": TOOLS}),
]


@pytest.mark.parametrize(
    "family, messages, kwargs", TRAINABLE, ids=[f"{t[0]}-{i}" for i, t in enumerate(TRAINABLE)]
)
def test_segments_train_exactly_the_assistant_turns(family, messages, kwargs):
    chat = template(family)
    segments = chat.segments(messages, **kwargs)
    assert "".join(s.text for s in segments) == chat.render(messages, **kwargs)
    trained = [s.text for s in segments if s.trained]
    replies = [m for m in messages if m["role"] == "assistant"]
    assert len(trained) == len(replies)
    for text, reply in zip(trained, replies, strict=True):
        assert text.endswith(END_OF_TURN[family])
        assert reply["content"].strip() in text
        for tool_call in reply.get("tool_calls", ()):
            assert f'"name": "{tool_call["function"]["name"]}"' in text or family == "smollm3"
        # What the model writes after the generation prompt, never a turn header.
        assert not re.search(r"<\|im_start\|>|<start_of_turn>", text)


def test_qwen3_trains_the_thinking_it_keeps():
    segments = template("qwen3").segments(TOOL_TRACE, tools=TOOLS)
    trained = [s.text for s in segments if s.trained]
    assert trained[0].startswith("<think>\nI need both cities.\n</think>\n\n<tool_call>")
    assert trained[1] == "<think>\nBoth came back.\n</think>\n\nZürich 21 °C, Oslo 12 °C.<|im_end|>"


def test_smollm3_trained_text_lies_in_its_generation_blocks():
    """SmolLM3 marks the assistant's text with {% generation %}: transformers' assistant mask
    covers every character we train."""
    (rendered,), (blocks,) = render_jinja_template(
        conversations=[PLAIN["system, two turns"]],
        chat_template=source("smollm3"),
        return_assistant_tokens_mask=True,
    )
    segments = template("smollm3").segments(PLAIN["system, two turns"])
    assert "".join(s.text for s in segments) == rendered
    at = 0
    for s in segments:
        if s.trained:
            assert any(start <= at and at + len(s.text) <= end for start, end in blocks)
        at += len(s.text)


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        (PLAIN["system, two turns"], {}),  # the first answer loses its (empty) thinking block
        (TOOL_TRACE + [msg("user", "And Bern?"), msg("assistant", "18 °C.")], {"tools": TOOLS}),
    ],
)
def test_qwen3_conversations_it_rewrites_are_refused_in_one_line(messages, kwargs):
    message = error_of(template("qwen3").segments, messages, **kwargs)
    assert "does not render a conversation turn by turn" in message
    assert "differently once later messages follow" in message and "\n" not in message


def test_gemma3_refuses_roles_that_do_not_alternate():
    message = error_of(template("gemma3").render, [msg("user", "a"), msg("user", "b")])
    assert "refused the conversation: Conversation roles must alternate" in message


@pytest.mark.parametrize(
    "messages, kwargs, fragment",
    [
        ([msg("user", "a", tool_calls=[])], {}, 'a user message has "role" and "content"'),
        ([msg("tool", "a", reasoning_content="x")], {}, "optionally 'name', 'tool_call_id'"),
        ([msg("assistant", "a", tool_calls="x")], {}, "tool_calls of type str"),
        ([msg("assistant", "a", tool_calls=["x"])], {}, "a tool call that is not a JSON object"),
        (
            [msg("assistant", "a", tool_calls=[{"f": {1, 2}}])],
            {},
            "is of type set, which is not JSON",
        ),
        (
            [msg("user", "a")],
            {"tools": {"name": "x"}},
            "tools must be a list of JSON objects, not a dict",
        ),
        ([msg("user", "a")], {"tools": [{1: "x"}]}, "tools[0] has a key that is not a string"),
        ([msg("user", "a")], {"enable_thinking": object()}, "enable_thinking is of type object"),
        ([msg("user", "a")], {"bos_token": "x"}, "'bos_token' cannot be a chat template variable"),
    ],
)
def test_bad_tool_and_variable_inputs(messages, kwargs, fragment):
    assert fragment in error_of(template("qwen3").render, messages, **kwargs)


@pytest.mark.parametrize(
    "source",
    [
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}",
        "{{ dict.__class__.__subclasses__() }}",
        "{{ tools[0].items().__iter__ }}{{ ''.join.__self__.__class__ }}",
    ],
)
def test_the_sandbox_still_holds_with_the_new_helpers(source):
    chat = ChatTemplate(source)
    try:
        rendered = chat.render([msg("user", "x")], tools=TOOLS)
    except Exception as e:  # noqa: BLE001 - either refusal is fine, as long as nothing leaks
        assert "unsafe" in str(e) or "failed to render" in str(e), e
    else:
        assert "class" not in rendered, rendered


def test_dict_helpers_render_as_transformers_does():
    src = (
        "{% set d = dict(a=1, b=[2]) %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}"
        "{{ dict.fromkeys(['x'], 0) | tojson }}{{ tools[0].function.keys() | list }}"
        "{{ tools | tojson(indent=2, separators=(',', ': ')) }}{{ 'é' | tojson }}"
        "{{ tools[0] | tojson(ensure_ascii=true, sort_keys=true) }}"
        "{% generation %}{{ messages[-1].thinking }}{% endgeneration %}"
    )
    messages = [msg("user", "q"), msg("assistant", "a", reasoning_content="r")]
    theirs, _ = render_jinja_template(conversations=[messages], chat_template=src, tools=TOOLS)
    assert ChatTemplate(src).render(messages, tools=TOOLS) == theirs[0]
