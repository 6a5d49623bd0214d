"""A chat template is untrusted code: every render has a budget (steps, characters made,
nested calls, integer size, time), so a hostile template ends in one line naming the template,
the limit and the fix, quickly and within a memory bound — while real templates render exactly
as before at no measurable cost. A failure is blamed on the template when it fails whatever
the conversation, on the line when it depends on it."""

from __future__ import annotations

import json
import resource
import time
from datetime import datetime
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_chat_template_families import CASES, source, template
from user_errors import error_of

from llamatrain.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    TemplateFault,
    budget,
    helpers,
    sandbox,
)
from llamatrain.chat_template import render as ct
from llamatrain.chat_template.budget import BUDGET
from llamatrain.data.examples import LineEncoder, read_examples
from llamatrain.data.jsonl import BadLines
from llamatrain.errors import DataError

USER = [{"role": "user", "content": "hi"}]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}x",
    "a huge product": '{{ "a" * 4000000000 }}',
    "doubling in a loop": '{% set ns = namespace(s="ab") %}{% for i in range(64) %}'
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "doubling with ~": '{% set a = "ab" %}' + "{% set a = a ~ a %}" * 40 + "{{ a }}",
    "center": '{{ "x" | center(10**10) }}',
    "center, folded while compiling": '{{ "x" | center(10000000000) }}',
    "a huge range in a filter": '{{ range(100000)|map("string")|map("center", 100000)|join }}',
    "a list of lists": '{{ range(100000)|map("string")|list|map("list")|list|length }}',
    "macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "branching macros": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{% endmacro %}{{ f(40) }}",
    "a recursive loop": "{% for x in range(3) recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "join of a giant generator": '{{ range(100000)|map("string")|map("replace", "", "x" * 60)'
    "|join }}",
    "join of shared strings": '{% set s = "a" * 1000000 %}'
    "{{ dict.fromkeys(range(100000), s).values()|list|join }}",
    "printing shared strings": '{% set s = "a" * 1000000 %}{{ dict.fromkeys(range(100000), s) }}',
    "a list product": "{{ (range(100000)|list) * 100000 }}",
    "a huge power": "{{ 2 ** 100000000 }}",
    "% width": '{{ "%99999999999d" % 1 }}',
    "format width": '{{ "{:>9999999999}".format(1) }}',
    "ljust": '{{ "x".ljust(10**10) }}',
    "indent": '{{ "a\\nb"|indent(10**10) }}',
    "tojson indent": "{{ range(1000)|list|tojson(indent=10**8) }}",
    "batch fill": '{{ [1]|batch(10**9, "x")|list }}',
    "to_bytes": '{{ (1).to_bytes(10**10, "big") }}',
    "lipsum": "{{ lipsum(10**6) }}",
    "a block set": '{% set x %}{% for i in range(100000) %}{{ "a" * 1000 }}{% endfor %}'
    "{% endset %}{{ x }}",
    "slices": '{% set s = "a" * 10000000 %}{% for i in range(1000) %}{% set t = s[1:] %}'
    "{% endfor %}",
    "a scan in a loop": '{% set s = "a" * 1000000 %}{% for i in range(100000) %}'
    '{% if "zz" in s %}{% endif %}{% endfor %}',
    "scans in a row": '{% set s = "a" * 30000000 %}' + '{% if "zz" in s %}{% endif %}' * 500,
    "a cyclic namespace": "{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}",
    "a long string added in a loop": '{% set s = "a" * 10000000 %}{% for i in range(1000) %}'
    '{{ s + "b" }}{{ "b" ~ s }}{% endfor %}',
    "trim in a loop": '{% set s = " " * 10000000 %}{% for i in range(1000) %}{{ s|trim }}'
    "{% endfor %}",
    "strip in a loop": '{% set s = " " * 10000000 %}{% for i in range(1000) %}'
    '{% if s.strip() or s.startswith("x") %}{% endif %}{% endfor %}',
    "a method reading a long argument": '{% set t = ("a",) * 30000000 %}'
    '{% for i in range(100) %}{% if "x".startswith(t) %}{% endif %}{% endfor %}',
    "nested loops over a list": "{% set l = range(1000)|list %}{% for a in l %}{% for b in l %}"
    "{% for c in l %}{% endfor %}{% endfor %}{% endfor %}",
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_ends_in_one_line_quickly_within_memory(name):
    before, start = peak_rss_mb(), time.process_time()  # CPU time: work, not the machine's load
    chat = ChatTemplate(HOSTILE[name], name="the model's chat template")
    message = error_of(chat.render, USER, add_generation_prompt=True)
    assert time.process_time() - start < 2
    assert peak_rss_mb() - before < 500
    assert message.startswith("the model's chat template went past its budget of ")
    assert "per render" in message and "data.chat_template = 'chatml'" in message
    assert "on_bad_line" not in message


def test_the_message_names_the_limit_and_the_template_line():
    message = error_of(ChatTemplate(HOSTILE["nested loops"], name="qwen").render, USER)
    assert f"{BUDGET.steps:,} steps (loop iterations, calls, filters and operators)" in message
    message = error_of(ChatTemplate("\n\n" + HOSTILE["a huge product"], name="qwen").render, USER)
    assert f"{BUDGET.chars:,} characters made" in message and "(template line 3)" in message
    assert "64 nested calls" in error_of(ChatTemplate(HOSTILE["macro recursion"]).render, USER)


def test_the_budget_holds_for_segments_and_the_end_of_turn_marker_too():
    chat = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}" + HOSTILE["center"])
    with pytest.raises(TemplateFault, match="went past its budget"):
        chat.segments(CHAT)
    with pytest.raises(TemplateFault, match="went past its budget"):
        chat.end_of_turn  # noqa: B018


def test_a_render_not_metered_is_refused():
    source_text = "{% for m in messages %}{{ m.content }}{% endfor %}"
    compiled = sandbox.environment().from_string(source_text)
    with pytest.raises(Exception, match="render only metered"):
        compiled.render(messages=USER)
    assert sandbox.render(compiled, {"messages": USER}) == "hi"


# ---------------------------------------------------------------------- real templates, as before


def reference(source_text: str):
    """The template compiled as it was before the budget: Jinja's immutable sandbox with
    transformers' settings and helpers, unmetered."""
    env = ImmutableSandboxedEnvironment(**helpers.OPTIONS)
    env.filters.update(helpers.FILTERS)
    env.globals.update(helpers.GLOBALS, strftime_now=lambda format: datetime.now().strftime(format))
    return env.from_string(source_text)


def unmetered_render(compiled, chat: ChatTemplate, messages, generation: bool, **kwargs) -> str:
    context = ct._context(kwargs.pop("tools", None), kwargs.pop("documents", None), kwargs)
    return compiled.render(
        **context,
        messages=ct._checked(messages),
        add_generation_prompt=generation,
        bos_token=chat.bos_token,
        eos_token=chat.eos_token,
    )


FAMILY_CASES = [
    pytest.param(family, messages, kwargs, id=f"{family}: {name}")
    for family, cases in CASES.items()
    for name, messages, kwargs in cases
]


@pytest.mark.parametrize("family, messages, kwargs", FAMILY_CASES)
def test_real_templates_render_exactly_as_without_the_budget(family, messages, kwargs):
    chat, compiled = template(family), reference(source(family))
    for generation in (False, True):
        expected = unmetered_render(compiled, chat, messages, generation, **dict(kwargs))
        assert chat.render(messages, add_generation_prompt=generation, **kwargs) == expected


@pytest.mark.parametrize("name", list(BUILTIN_TEMPLATES))
def test_builtins_render_exactly_as_without_the_budget(name):
    chat = ChatTemplate(BUILTIN_TEMPLATES[name], bos_token="<s>", eos_token="</s>")
    compiled = reference(BUILTIN_TEMPLATES[name])
    conversation = CHAT[1:] if name == "llama-2" else CHAT
    expected = unmetered_render(compiled, chat, conversation, False)
    assert chat.render(conversation) == expected


CONSTRUCTS = {
    "a block": "{% block body %}{% for m in messages %}{{ m.role + ':' + m.content }}"
    "{% endfor %}{% endblock %}{{ self.body() }}",
    "a macro": "{% macro turn(m, n) %}{{ '<' + m.role + '>' ~ n ~ m.content|trim }}"
    "{% endmacro %}{% for m in messages %}{{ turn(m, loop.index) }}{% endfor %}",
    "a call block": "{% macro wrap() %}[{{ caller() + '!' }}]{% endmacro %}"
    "{% call wrap() %}{{ messages[0].content + 'x' }}{% endcall %}",
    "a filter block": "{% filter upper %}{% for m in messages %}{{ m.content ~ 1 }}{% endfor %}"
    "{% endfilter %}",
    "a block set": "{% set x %}{% for m in messages %}{{ m.role + m.content }}{% endfor %}"
    "{% endset %}{{ x + x|length|string }}",
    "a recursive loop": "{% for m in [[1, [2, 3]], 4] recursive %}{% if m is iterable %}"
    "{{ loop(m) }}{% else %}{{ m + 1 }},{% endif %}{% endfor %}",
    "a loop filter": "{% for m in messages if m.role + 'x' != 'userx' %}"
    "{{ loop.index0 % 2 ~ m.content }}{% endfor %}",
    "numbers and lists": "{{ 1 + 2 }}{{ [1] + [2] }}{{ (1, 2) + (3,) }}{{ 1.5 + 2 }}"
    "{{ 7 % 3 }}{{ '%s-%d' % ('a', 3) }}{{ -7 % 3 }}{{ 7.5 % 2 }}{{ true % 2 }}",
    "comparisons": "{{ (messages[0].role == 'system') != (messages|length % 2 == 0) }}"
    "{{ not true == false }}{{ 'x' in messages[0].content }}{{ messages[1:] == messages[1:] }}",
    "trim": "{{ messages[0].content|trim }}{{ '  a  '|trim }}{{ ['  a ']|trim }}"
    "{{ 'xxaxx'|trim('x') }}{{ none|trim }}",
    "~": "{{ 'a' ~ 'b' }}{{ 1 ~ 2 }}{{ none ~ 'x' }}"
    "{{ messages[0].content ~ messages[1].content ~ 3 }}",
    "undefined": "{{ nothing ~ 'x' }}{{ (nothing or '') + 'y' }}{{ nothing|length }}"
    "{{ nothing|trim }}",
    "methods": "{{ messages[0].content.strip('.').split(' ')|join('|') }}{{ 'a,b'.split(',') }}"
    "{{ 'AbC'.lower() + 'x'.upper() }}{{ 'abc'.startswith(('x', 'a')) }}"
    "{{ 'abc'.replace('b', 'bb') }}",
    "methods in line": "{{ messages[0].content.strip('.') }}{{ ' a '.strip() }}"
    "{{ messages[0].content.startswith('You') }}{{ messages[2].content.endswith('2?') }}"
    "{{ messages[0].content.endswith('.', 1) }}{{ (messages[0].content ~ '\\n').rstrip('\\n') }}",
    "autoescape": "{% autoescape true %}{{ '<' ~ messages[0].content ~ '>' }}{{ '<a>' + 'b' }}"
    "{% endautoescape %}",
    "a namespace": "{% set ns = namespace(s='') %}{% for m in messages %}"
    "{% set ns.s = ns.s + m.content[:3] %}{% endfor %}{{ ns.s }}",
    "unmetered filters": "{{ messages|length }}{{ messages|count }}{{ messages|first|tojson }}"
    "{{ (messages|last).content }}{{ nothing|default('d') }}{{ ''|d('e', true) }}",
    "a dict": "{% for k, v in messages[0]|dictsort %}{{ k + '=' + v }};{% endfor %}"
    "{{ {'a': 1}.items()|list }}",
}
"""Templates of each construct the metering changes the code of (in line or not)."""


@pytest.mark.parametrize("construct", list(CONSTRUCTS))
def test_every_construct_renders_exactly_as_without_the_budget(construct):
    chat = ChatTemplate(CONSTRUCTS[construct], bos_token="<s>", eos_token="</s>")
    expected = unmetered_render(reference(CONSTRUCTS[construct]), chat, CHAT, False)
    assert chat.render(CHAT) == expected


@pytest.mark.parametrize(
    "source_text, error",
    [
        ("{{ messages[0].content + 1 }}", TypeError),
        ("{{ 1 + messages[0].content }}", TypeError),
        ("{{ 'a%d' % 'x' }}", TypeError),
        ("{{ 1 % 0 }}", ZeroDivisionError),
        ("{{ messages[0].content.startswith() }}", TypeError),
    ],
)
def test_a_failing_operation_fails_as_without_the_budget(source_text, error):
    with pytest.raises(error):
        unmetered_render(reference(source_text), ChatTemplate(source_text), CHAT, False)
    message = error_of(ChatTemplate(source_text).render, CHAT)
    assert f"failed to render: {error.__name__}" in message


@pytest.fixture
def meter_of(monkeypatch):
    """The steps and characters each render of a template used."""
    meters: list[budget.Meter] = []

    class Spied(budget.Meter):
        __slots__ = ()

        def __init__(self, *args):
            super().__init__(*args)
            meters.append(self)

    monkeypatch.setattr(sandbox, "Meter", Spied)
    return meters


def test_real_templates_use_a_tiny_fraction_of_the_budget_in_proportion_to_the_chat(meter_of):
    """Counting the work: a long conversation (201 messages, tools) takes a few steps per
    message and a few characters per character of the conversation, far from the limits."""
    from test_chat_template_families import TOOL_TRACE, TOOLS, msg

    long = [TOOL_TRACE[0]]
    for i in range(100):
        long += [msg("user", f"question {i} " * 20), msg("assistant", f"answer {i} " * 50)]
    size = sum(len(m["content"]) for m in long)
    for family in CASES:
        meter_of.clear()
        kwargs = {"tools": TOOLS} if family.startswith("qwen") else {}
        template(family).render(long, add_generation_prompt=True, **kwargs)
        ((steps, chars),) = [(BUDGET.steps - m.steps, BUDGET.chars - m.chars) for m in meter_of]
        assert steps < 20 * len(long) < BUDGET.steps / 30, family
        assert chars < 8 * size < BUDGET.chars / 50, family


# -------------------------------------------------------------------------- who is at fault


def test_a_template_that_fails_on_any_conversation_is_blamed_for_it():
    chat = ChatTemplate("{{ messages[0].content + 1 }}", name="the model's chat template")
    message = error_of(chat.render, USER)
    assert "failed to render: TypeError" in message and "(template line 1)" in message
    assert "the fault is the template, not the data" in message
    assert "data.chat_template = 'chatml'" in message and "on_bad_line" not in message
    with pytest.raises(TemplateFault):
        chat.segments(CHAT)


def test_a_template_that_refuses_this_conversation_blames_the_conversation():
    llama2 = ChatTemplate(BUILTIN_TEMPLATES["llama-2"], bos_token="<s>", eos_token="</s>")
    with pytest.raises(DataError, match="refused the conversation: Conversation roles must"):
        llama2.render([{"role": "assistant", "content": "I speak first"}])
    boom = ChatTemplate(
        "{% for m in messages %}{{ m.content }}{% if m.content == 'boom' %}{{ 1 // 0 }}"
        "{% endif %}{% endfor %}"
    )
    message = error_of(boom.render, [{"role": "user", "content": "boom"}])
    assert (
        "failed to render: ZeroDivisionError" in message and "fault is the template" not in message
    )


def test_a_template_that_always_refuses_is_blamed_for_it():
    message = error_of(ChatTemplate("{{ raise_exception('not for chat') }}").render, USER)
    assert "refused the conversation: not for chat" in message
    assert "fault is the template" in message


def test_a_syntax_error_is_the_template_s_fault():
    with pytest.raises(TemplateFault, match="not a valid Jinja template.*data.chat_template"):
        ChatTemplate("{% for m in messages %}")


def write_chats(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(n)))
    return path


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize(
    "source_text, fragment",
    [
        ("{{ messages[0].content + 1 }}", "fault is the template, not the data"),
        (HOSTILE["nested loops"], "went past its budget"),
        ("{{ ''.__class__.__mro__ }}{{ messages[0].append(1) }}", "unsafe operation"),
    ],
)
def test_reading_data_stops_at_the_first_line_a_faulty_template_fails_on(
    tmp_path, policy, source_text, fragment
):
    """Skipping lines cannot help a template at fault: it would skip every line."""
    chat = ChatTemplate(source_text, name="the model's chat template")
    encoder = LineEncoder(None, chat, train_on="completion")  # it fails before tokenizing
    path = write_chats(tmp_path / "chats.jsonl", 3)
    message = error_of(read_examples, [path], encoder, BadLines(policy))
    assert message.startswith(f"{path}:1: the model's chat template") and fragment in message
    assert "on_bad_line" not in message and "data.chat_template = 'chatml'" in message
