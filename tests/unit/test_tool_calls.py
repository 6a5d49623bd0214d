"""Tool calls parsed from model text per format, as llama.cpp parses them; failures are data.

The formats are checked against the real chat templates that teach them: a conversation whose
assistant turn holds calls is rendered by transformers (``render_jinja_template``, what
``apply_chat_template`` runs), and the text the model would have written for that turn parses
back to the same calls. Hostile texts end as failed calls, never as an exception.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tool_functions import brave_search, lookup, multiply
from transformers.utils.chat_template_utils import render_jinja_template

from llamatrain.errors import ConfigError
from llamatrain.tools.call_json import MAX_CALL_CHARS, MAX_NESTING
from llamatrain.tools.calls import (
    CallFormat,
    CallSyntax,
    FailedCall,
    Reply,
    ToolCall,
    call_syntax,
    parse_reply,
)
from llamatrain.tools.formats import MAX_CALLS
from llamatrain.tools.schema import json_schema

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
HERMES, LLAMA_3, BUILTIN, GENERIC = (CallSyntax(fmt) for fmt in CallFormat)
QWEN3 = CallSyntax(CallFormat.HERMES, thinking=True)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOOLS = [json_schema(multiply), json_schema(lookup), json_schema(brave_search)]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def calls_of(reply: Reply) -> list[tuple[str, dict]]:
    assert not reply.failed, reply.failed
    return [(call.name, call.arguments) for call in reply.valid]


def only_failure(reply: Reply) -> FailedCall:
    assert not reply.valid and len(reply.calls) == 1, reply.calls
    return reply.failed[0]


# ---- syntax from templates -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "syntax"),
    [
        (template("qwen2.5"), HERMES),
        (template("qwen3"), QWEN3),
        (template("smollm3"), QWEN3),
        (template("llama3.1"), LLAMA_3),
        (template("gemma3"), GENERIC),
        (CHATML, GENERIC),
    ],
)
def test_the_syntax_is_found_in_the_template_as_llama_cpp_finds_it(source, syntax):
    assert call_syntax(source) == syntax


def test_a_template_of_xml_arguments_is_refused_in_one_line():
    qwen3_coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>\n"
    with pytest.raises(ConfigError, match=r"XML parameters \(Qwen3-Coder.*not parse") as caught:
        call_syntax(qwen3_coder)
    assert "\n" not in str(caught.value)


# ---- what the template writes parses back --------------------------------------------------------

CALLS = [("multiply", {"a": 3, "b": 4.5}), ("lookup", {"word": "tool", "lang": "fr"})]


def rendered_reply(source: str, calls: list[tuple[str, dict]], end: str, **extra) -> str:
    """The assistant turn holding ``calls`` as the template renders it, cut at ``end``: what
    the model writes after its generation prompt."""
    user = [{"role": "user", "content": "Three times 4.5, and 'tool' in French?"}]
    wrapped = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    turn = {"role": "assistant", "content": "", "tool_calls": wrapped}
    full = render_jinja_template([[*user, turn]], tools=TOOLS, chat_template=source, **extra)[0][0]
    prompt = render_jinja_template(
        [user], tools=TOOLS, chat_template=source, add_generation_prompt=True, **extra
    )[0][0]
    assert full.startswith(prompt)
    return full[len(prompt) :].split(end)[0]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_qwen_calls_parse_back_from_the_template(name):
    text = rendered_reply(template(name), CALLS, "<|im_end|>")
    assert text.count("<tool_call>\n") == 2
    reply = parse_reply(text, call_syntax(template(name)), TOOLS)
    assert calls_of(reply) == CALLS
    assert [call.id for call in reply.valid] == ["call_0", "call_1"]
    assert (reply.content, reply.reasoning, reply.refused) == ("", "", None)


def test_llama_3_calls_parse_back_from_the_template():
    for call in CALLS:  # Llama 3.1's template renders one call a turn
        text = rendered_reply(template("llama3.1"), [call], "<|eot_id|>")
        assert text.startswith('{"name": ') and '"parameters": ' in text
        assert calls_of(parse_reply(text, call_syntax(template("llama3.1")), TOOLS)) == [call]


def test_a_llama_3_built_in_call_parses_back_from_the_template():
    call = ("brave_search", {"query": "weather in Paris"})
    text = rendered_reply(
        template("llama3.1"), [call], "<|eom_id|>", builtin_tools=["brave_search"]
    )
    assert text == '<|python_tag|>brave_search.call(query="weather in Paris")'
    assert calls_of(parse_reply(text, BUILTIN, TOOLS)) == [call]
    assert parse_reply(text + " Done.", BUILTIN, TOOLS).content == "Done."


def test_smollm3_calls_are_written_as_its_template_asks():
    source = template("smollm3")
    system = render_jinja_template(
        [[{"role": "user", "content": "hi"}]], chat_template=source, xml_tools=TOOLS
    )[0][0]
    asked = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert asked in system
    text = asked.replace("<function-name>", '"multiply"').replace(
        "<args-json-object>", json.dumps(CALLS[0][1])
    )
    assert calls_of(parse_reply(text, call_syntax(source), TOOLS)) == CALLS[:1]


# ---- the formats' rules --------------------------------------------------------------------------

MULTIPLY = '<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_hermes_takes_text_before_the_calls_and_thinking_apart():
    thinking = " <think>\nI should <tool_call>not</tool_call> yet\n</think>\n\n"
    text = f"{thinking}Let me. {MULTIPLY}\n\n{MULTIPLY}\n"
    reply = parse_reply(text, QWEN3, TOOLS)
    assert reply.reasoning == "I should <tool_call>not</tool_call> yet\n"
    assert (reply.content, reply.refused) == ("Let me. ", None)
    assert calls_of(reply) == [("multiply", {"a": 1, "b": 2})] * 2


def test_without_thinking_in_the_template_think_tags_are_content():
    reply = parse_reply(f"<think>hmm</think>{MULTIPLY}", HERMES, TOOLS)
    assert reply.content == "<think>hmm</think>" and len(reply.valid) == 1


def test_thinking_cut_off_is_all_thinking_and_no_call():
    reply = parse_reply('<think>\nmaybe <tool_call>{"name": "multiply"', QWEN3, TOOLS)
    assert reply == Reply("", 'maybe <tool_call>{"name": "multiply"', ())


def test_text_without_calls_is_content():
    for fmt in CallFormat:
        assert parse_reply("The answer is 42.", CallSyntax(fmt), TOOLS) == Reply(
            "The answer is 42."
        )


def test_text_after_a_call_makes_the_server_refuse_the_reply():
    for text in (f"{MULTIPLY} Done.", f"{MULTIPLY} and {MULTIPLY}"):
        reply = parse_reply(text, HERMES, TOOLS)
        assert "text follows" in reply.refused and not reply.valid
        assert {c.error for c in reply.failed} == {
            f"llama.cpp's server refuses this reply: {reply.refused}"
        }


def test_a_call_to_an_unknown_tool_makes_the_server_refuse_the_reply():
    unknown = MULTIPLY.replace("multiply", "divide")
    reply = parse_reply(MULTIPLY + unknown, HERMES, TOOLS)
    assert reply.refused == "it calls 'divide', which is no tool"
    assert [c.kind for c in reply.calls] == ["unparseable", "unknown_tool"]


def test_a_call_the_server_cannot_read_makes_it_refuse_the_reply_but_a_cut_off_one_not():
    unreadable = MULTIPLY + hermes('{"arguments": {}, "name": "multiply"}')
    reply = parse_reply(unreadable, HERMES, TOOLS)
    assert reply.refused.startswith("it holds a call the server cannot read (write the call as")
    assert not reply.valid
    cut = parse_reply(MULTIPLY + '<tool_call>\n{"name": "multiply", "argu', HERMES, TOOLS)
    assert cut.refused is None and len(cut.valid) == 1 and "no </tool_call>" in cut.failed[0].error
    llama_cut = parse_reply('{"name": "multiply", "parameters": {"a": 1', LLAMA_3, TOOLS)
    assert llama_cut.refused is None and "not valid JSON" in only_failure(llama_cut).error


def test_llama_3_reads_one_call_after_text_without_braces():
    call = '{"type": "function", "name": "multiply", "parameters": {"a": 2, "b": 3}}'
    reply = parse_reply(f"Sure:\n{call}\n\n", LLAMA_3, TOOLS)
    assert calls_of(reply) == [("multiply", {"a": 2, "b": 3})] and reply.content == "Sure:\n"
    for text, why in [
        (f"{call} then words", "text follows the call"),
        (f"{call}\n{call}", "text follows the call"),
        (f"a {{b}} {call}", "a { in the text"),
        ('{"answer": 4}', "a { in the text"),
    ]:
        reply = parse_reply(text, LLAMA_3, TOOLS)
        assert why in reply.refused and not reply.valid
    assert parse_reply("a } b", LLAMA_3, TOOLS) == Reply("a } b")


def test_generic_replies_are_one_json_object():
    one = {"tool_call": {"name": "multiply", "arguments": {"a": 1, "b": 2}}}
    many = {
        "tool_calls": [
            {"name": "lookup", "arguments": '{"word": "x"}', "id": "c7"},
            one["tool_call"],
        ]
    }
    assert calls_of(parse_reply(json.dumps(one), GENERIC, TOOLS)) == [
        ("multiply", {"a": 1, "b": 2})
    ]
    reply = parse_reply(json.dumps(many), GENERIC, TOOLS)
    assert [(c.name, c.arguments, c.id) for c in reply.valid] == [
        ("lookup", {"word": "x"}, "c7"),
        ("multiply", {"a": 1, "b": 2}, "call_1"),
    ]
    assert parse_reply('{"response": "Hi!"}', GENERIC, TOOLS) == Reply("Hi!")
    assert parse_reply('{"response": {"x": [1]}}', GENERIC, TOOLS).content == (
        '{\n  "x": [\n    1\n  ]\n}'
    )
    assert parse_reply('{"other": 1}', GENERIC, TOOLS) == Reply('{"other": 1}')
    failed = only_failure(parse_reply('{"tool_call": {"name": "multiply", "argu', GENERIC, TOOLS))
    assert failed.kind == "unparseable" and "not valid JSON" in failed.error


# ---- failed calls are data -----------------------------------------------------------------------


def hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def call(name: str, arguments: object) -> str:
    return hermes(json.dumps({"name": name, "arguments": arguments}))


@pytest.mark.parametrize(
    ("text", "kind", "error"),
    [
        (call("divide", {"a": 1}), "unknown_tool", r"no tool named 'divide' \(the tools are 'mult"),
        (call("multiply", {"a": 1}), "wrong_arguments", r"multiply: argument 'b' is missing"),
        (call("multiply", {"a": 1, "b": "2"}), "wrong_arguments", r"'b' must be number, not str"),
        (call("multiply", {"a": True, "b": 2}), "wrong_arguments", r"'a' must be number, not bool"),
        (call("lookup", {"word": "x", "limit": 2.0}), "wrong_arguments", r"integer, not number"),
        (call("lookup", {"word": "x", "lang": "de"}), "wrong_arguments", r'one of \["en", "fr"\]'),
        (call("lookup", {"word": "x", "tags": ["a", 1]}), "wrong_arguments", r"'tags'\[1\] must"),
        (call("lookup", {"word": "x", "sense": 1}), "wrong_arguments", r"'sense' is not one the"),
        (call("multiply", [1, 2]), "unparseable", r'"arguments" must be a JSON object'),
        (call("multiply", "{'a': 1}"), "unparseable", r'"arguments" is a string that is not JSON'),
        (hermes('{"name": 3, "arguments": {}}'), "unparseable", r'no "name" string'),
        (hermes('{"arguments": {}, "name": "now"}'), "unparseable", r"these keys in this order"),
        (hermes('{"name": "multiply"}'), "unparseable", r'as \{"name": …, "arguments": …\}'),
        (hermes('{"name": "multiply", "arguments": {}, "id": "7"}'), "unparseable", "no others"),
        (MULTIPLY.replace("<tool_call>\n", "<tool_call>"), "unparseable", r"a new line after"),
        (hermes("[1, 2]"), "unparseable", r"must be a JSON object, not array"),
        (hermes('{"name": "multiply", "arguments": {"a": NaN, "b": 1}}'), "unparseable", "NaN"),
        (hermes('{"name": "multiply", "arguments": {"a": 1e999, "b": 1}}'), "unparseable", "large"),
        (
            hermes('{"name": "lookup", "arguments": {"word": "\\ud800"}}'),
            "unparseable",
            "surrogate",
        ),
        (hermes('{"name": "multiply", "arguments": {}} x'), "unparseable", r"text follows the"),
        ('<tool_call>{"name": "multiply", "arguments": {"a"', "unparseable", r"no </tool_call>"),
        (hermes(hermes(json.dumps({"name": "multiply"}))), "unparseable", r"not valid JSON"),
    ],
)
def test_a_call_that_cannot_run_is_a_failed_call_saying_why(text, kind, error):
    failed = only_failure(parse_reply(text, HERMES, TOOLS))
    assert failed.kind == kind
    assert "\n" not in failed.error
    assert re.search(error, failed.error), failed.error
    assert failed.text == text[: len(failed.text)] and len(failed.text) <= 200


def test_arguments_a_schema_accepts_run_the_function():
    text = call("lookup", {"word": "tool", "limit": 1, "tags": None}) + call(
        "multiply", '{"a": 2, "b": 0.5}'
    )
    reply = parse_reply(text, HERMES, TOOLS)
    functions = {"lookup": lookup, "multiply": multiply}
    assert [functions[c.name](**c.arguments) for c in reply.valid] == ["tool", 1.0]


def test_failed_and_valid_calls_keep_the_order_written():
    text = call("multiply", {"a": 1, "b": 2}) + hermes("{") + call("multiply", {"a": 3})
    kinds = [
        c.kind if isinstance(c, FailedCall) else c.name
        for c in parse_reply(text, HERMES, TOOLS).calls
    ]
    assert kinds == ["multiply", "unparseable", "wrong_arguments"]
    assert parse_reply(text, HERMES, TOOLS).calls[0] == ToolCall(
        "multiply", {"a": 1, "b": 2}, "call_0"
    )


def test_llama_3_failures():
    no_parameters = parse_reply(
        '{"name": "multiply", "arguments": {"a": 1, "b": 2}}', LLAMA_3, TOOLS
    )
    assert "parameters" in only_failure(no_parameters).error
    truncated = only_failure(
        parse_reply('{"name": "multiply", "parameters": {"a": 1', LLAMA_3, TOOLS)
    )
    assert truncated.kind == "unparseable"
    code = parse_reply("Running it. <|python_tag|>import os; os.remove('x')", BUILTIN, TOOLS)
    assert code.content == "Running it. "
    assert "code is never run" in only_failure(code).error
    unclosed = parse_reply('<|python_tag|>brave_search.call(query="x"', BUILTIN, TOOLS)
    assert "does not end with ')'" in only_failure(unclosed).error


# ---- hostile texts -------------------------------------------------------------------------------


def test_megabytes_of_arguments_are_a_failed_call():
    huge = call("lookup", {"word": "x" * (10 << 20)})
    failed = only_failure(parse_reply(huge, HERMES, TOOLS))
    assert f"longer than {MAX_CALL_CHARS:,} characters" in failed.error
    llama = '{"name": "lookup", "parameters": {"word": "' + "x" * (10 << 20) + '"}}'
    assert "longer than" in only_failure(parse_reply(llama, LLAMA_3, TOOLS)).error
    generic = json.dumps({"tool_call": {"name": "lookup", "arguments": {"word": "x" * (10 << 20)}}})
    assert "longer than" in only_failure(parse_reply(generic, GENERIC, TOOLS)).error


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 100_000])
def test_deep_nesting_is_a_failed_call(depth):
    arguments = '{"word": "x", "tags": ' + "[" * depth + "]" * depth + "}"
    for fmt, text in [
        (HERMES, hermes('{"name": "lookup", "arguments": ' + arguments + "}")),
        (LLAMA_3, '{"name": "lookup", "parameters": ' + arguments + "}"),
        (GENERIC, '{"tool_call": {"name": "lookup", "arguments": ' + arguments + "}}"),
    ]:
        failed = only_failure(parse_reply(text, fmt, TOOLS))
        assert f"deeper than {MAX_NESTING} levels" in failed.error or "longer than" in failed.error


def test_too_many_calls_stop_being_read():
    text = call("multiply", {"a": 1, "b": 1}) * (MAX_CALLS + 5)
    reply = parse_reply(text, HERMES, TOOLS)
    assert len(reply.calls) == MAX_CALLS + 1 and "text follows" in reply.refused
    assert reply.calls[-1].error.startswith(f"more than {MAX_CALLS} calls")
    assert reply.content.count("<tool_call>") == 5
    assert len(
        parse_reply(call("multiply", {"a": 1, "b": 1}) * MAX_CALLS, HERMES, TOOLS).valid
    ) == (MAX_CALLS)


def test_many_open_tags_are_read_in_one_pass():
    """Each marker is searched for once, forward: a million unclosed tags end as one failed
    call, not a million searches to the end of the text."""
    reply = parse_reply("<tool_call>" * 1_000_000, HERMES, TOOLS)
    assert "no </tool_call>" in only_failure(reply).error


HUGE = "x" * (10 << 20)
WRITTEN = {
    HERMES: lambda name, arguments: hermes(f'{{"name": "{name}", "arguments": {arguments}}}'),
    LLAMA_3: lambda name, arguments: f'{{"name": "{name}", "parameters": {arguments}}}',
    BUILTIN: lambda name, arguments: f"<|python_tag|>{name}.call(word={arguments[9:-1]})",
    GENERIC: lambda name, arguments: (
        f'{{"tool_call": {{"name": "{name}", "arguments": {arguments}}}}}'
    ),
}
"""How each format writes a call of ``name`` with ``arguments`` ('{"word": …}')."""


@pytest.mark.parametrize("syntax", list(WRITTEN), ids=lambda s: s.format.name)
@pytest.mark.parametrize(
    ("case", "kind"),
    [("truncated", "unparseable"), ("unknown", "unknown_tool"), ("huge", "unparseable")],
)
def test_every_formats_hostile_calls_end_as_failed_calls(syntax, case, kind):
    """The issue's hostile texts in each format — a call cut off, a tool that does not
    exist, 10 MB of arguments — are one failed call each, never an exception; the same
    call written well runs."""
    write = WRITTEN[syntax]
    assert calls_of(parse_reply(write("lookup", '{"word": "x"}'), syntax, TOOLS)) == [
        ("lookup", {"word": "x"})
    ]
    text = {
        "truncated": write("lookup", '{"word": "x"}')[:-3],
        "unknown": write("look_up", '{"word": "x"}'),
        "huge": write("lookup", f'{{"word": "{HUGE}"}}'),
    }[case]
    failed = only_failure(parse_reply(text, syntax, TOOLS))
    assert failed.kind == kind, failed
    assert "\n" not in failed.error and len(failed.text) <= 200
