"""Fuzz the tool-call parsers with hostile model text, property-based.

A reply is drawn as a run of pieces: each format's markers (``<tool_call>``, ``</tool_call>``,
``<think>``, ``<|python_tag|>``, ``name.call(``), JSON fragments and whole call objects with
right and wrong arguments, unknown tool names, ``NaN``, lone ``\\ud800`` escapes, 5000-digit
numbers, 100,000-deep nesting and megabyte strings. Parsed in each format, every reply ends
as a :class:`~llamatrain.tools.calls.Reply` within ``fuzz_bounds.bounded``'s time and memory,
never an exception: each call in it is either a known tool with arguments its schema accepts
or a failed call of a stated kind with a one-line reason. Calls written exactly as a template
writes them, between pieces of plain text, parse back to themselves.
"""

from __future__ import annotations

import json

import pytest
from fuzz_bounds import bounded
from hypothesis import example, given
from hypothesis import strategies as st
from tool_functions import lookup, multiply

from llamatrain.tools.arguments import argument_problem
from llamatrain.tools.calls import CallFormat, CallSyntax, FailedCall, Reply, ToolCall, parse_reply
from llamatrain.tools.schema import json_schema

pytestmark = pytest.mark.fuzz


TOOLS = [json_schema(multiply), json_schema(lookup)]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
KINDS = {"unparseable", "unknown_tool", "wrong_arguments"}

json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
names = st.sampled_from(["multiply", "lookup", "divide", "", "python", "brave_search"])
arguments = st.one_of(
    st.fixed_dictionaries({"a": json_values, "b": json_values}),
    st.fixed_dictionaries({"word": st.text(max_size=8)}, optional={"limit": json_values}),
    json_values,
)
call_objects = st.builds(
    lambda name, args, key, as_string: json.dumps(
        {"name": name, key: json.dumps(args) if as_string else args}
    ),
    names,
    arguments,
    st.sampled_from(["arguments", "parameters"]),
    st.booleans(),
)
MARKERS = [
    "<tool_call>", "<tool_call>\n", "</tool_call>", "<think>", "</think>", "<|python_tag|>",
    "brave_search.call(", 'query="x")', "{", "}", "[", "]", '"name": ', '"arguments": ',
    '"parameters": ', ", ", "\n",
    '{"tool_call": ', '{"tool_calls": [', '{"response": ', "NaN", "Infinity", '"\\ud800"',
    "9" * 5000, "1e999",
]  # fmt: skip
HUGE = [
    "[" * 100_000,
    "{" * 50_000,
    '{"name": "lookup", "arguments": {"word": "' + "x" * (2 << 20) + '"}}',
    "<tool_call>" * 20_000,
]
pieces = st.one_of(
    st.sampled_from(MARKERS), call_objects, st.text(max_size=10), st.sampled_from(range(len(HUGE)))
)


def checked(reply: Reply) -> Reply:
    """The properties every parse keeps, whatever the text."""
    assert isinstance(reply, Reply)
    assert isinstance(reply.content, str) and isinstance(reply.reasoning, str)
    for call in reply.calls:
        if isinstance(call, ToolCall):
            assert call.name in PARAMETERS
            assert argument_problem(call.arguments, PARAMETERS[call.name]) is None
        else:
            assert isinstance(call, FailedCall) and call.kind in KINDS
            assert call.error.strip() and "\n" not in call.error
            assert len(call.text) <= 200
    return reply


SYNTAXES = [CallSyntax(fmt, thinking) for fmt in CallFormat for thinking in (False, True)]


@given(parts=st.lists(pieces, min_size=1, max_size=8), syntax=st.sampled_from(SYNTAXES))
@example(parts=[0], syntax=CallSyntax(CallFormat.HERMES))
@example(parts=["<tool_call>\n", 2, "</tool_call>"], syntax=CallSyntax(CallFormat.HERMES))
def test_any_text_parses_to_calls_or_failed_calls(parts: list, syntax: CallSyntax) -> None:
    text = "".join(HUGE[p] if isinstance(p, int) else p for p in parts)
    bounded(lambda: checked(parse_reply(text, syntax, TOOLS)), f"{syntax}: {text[:300]!r}")


plain = st.text(max_size=20).filter(lambda t: "<" not in t and "{" not in t and "|" not in t)
good_calls = st.one_of(
    st.builds(lambda a, b: ("multiply", {"a": a, "b": b}), st.integers(), st.floats(-1e9, 1e9)),
    st.builds(
        lambda w, n, tags: ("lookup", {"word": w, "limit": n, "tags": tags}),
        st.text(max_size=10),
        st.integers(0, 99),
        st.none() | st.lists(st.text(max_size=4), max_size=3),
    ),
)


@given(
    before=plain,
    calls=st.lists(good_calls, min_size=1, max_size=4),
    after=plain,
    thinking=st.booleans(),
)
def test_calls_written_as_the_template_writes_them_parse_back(before, calls, after, thinking):
    """Text may come before the calls; after them, whitespace only, or the server refuses
    the reply and no call runs."""
    syntax = CallSyntax(CallFormat.HERMES, thinking)
    written = "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
        for name, args in calls
    )
    reply = checked(parse_reply(before + written + after, syntax, TOOLS))
    assert reply.content == before.lstrip() + after.lstrip()
    if after.strip():
        assert "text follows" in reply.refused and not reply.valid
    else:
        assert [(c.name, c.arguments) for c in reply.calls] == calls and reply.refused is None
    name, args = calls[0]
    llama = f'{{"name": "{name}", "parameters": {json.dumps(args)}}}'
    first = checked(parse_reply(before + llama + after, CallSyntax(CallFormat.LLAMA_3), TOOLS))
    if after.strip():
        assert "text follows" in first.refused and not first.valid
    else:
        assert [(c.name, c.arguments) for c in first.calls] == [(name, args)]
