"""The built-in chat templates render conversations byte for byte as llama.cpp does.

llama.cpp formats a conversation with ``llama_chat_apply_template`` (``llm_chat_apply_template``
in src/llama-chat.cpp): not a Jinja interpreter but one hand-written formatter per family,
chosen by name (``"chatml"``, ``"llama3"``, ``"llama2-sys-bos"``...) or by patterns in a Jinja
source. ``add_ass`` there is ``add_generation_prompt`` here. Where llama.cpp's formatter leaves
something out that the model's own template writes, the relationship is stated exactly at the
test, and the test checks it with equality.
"""

from __future__ import annotations

import ctypes

import llama_cpp  # a test dependency (pip install -e '.[test]'): missing, collection fails
import pytest

from llamatrain.chat_template import BUILTIN_TEMPLATES, ChatTemplate


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS = {
    "single turn": [msg("user", "Hi"), msg("assistant", "Hello!")],
    "system, multi-turn, ends with user": [
        msg("system", "You are terse."),
        msg("user", "What is 2+2?"),
        msg("assistant", "4"),
        msg("user", "And 3+3?\nShow <work> & all."),
        msg("assistant", "6, since 3 + 3 = 6.\nDone."),
        msg("user", "Thanks"),
    ],
    "no system, ends with assistant": [
        msg("user", "Translate 'chat' — en français?"),
        msg("assistant", "« chat » means cat. 日本語: 猫"),
        msg("user", "And dog?"),
        msg("assistant", "« chien »."),
    ],
    "user only": [msg("user", "Anyone there?")],
}
"""Conversations whose contents have no surrounding whitespace (llama-2 needs that, below)."""

PADDED = [
    msg("system", " Be kind. "),
    msg("user", "\tHi there\n"),
    msg("assistant", "  Hello!  \n"),
    msg("user", "Bye "),
]
"""Contents with ASCII whitespace around them, which llama-3's template and llama.cpp's
``llama3`` both trim (and chatml keeps)."""


def cpp_render(template: str, messages: list[dict[str, str]], add_ass: bool) -> str:
    """llama.cpp's ``llama_chat_apply_template(tmpl, chat, n_msg, add_ass, buf, length)``."""
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages)
    )
    tmpl = template.encode()
    needed = llama_cpp.llama_chat_apply_template(tmpl, chat, len(messages), add_ass, None, 0)
    assert needed >= 0, f"llama.cpp does not know the template {template[:40]!r}"
    buf = ctypes.create_string_buffer(needed)
    written = llama_cpp.llama_chat_apply_template(tmpl, chat, len(messages), add_ass, buf, needed)
    assert written == needed
    return buf.raw[:written].decode("utf-8")


def ours(name: str, messages, add_generation_prompt: bool, bos: str = "", eos: str = "") -> str:
    chat = ChatTemplate(BUILTIN_TEMPLATES[name], bos_token=bos, eos_token=eos)
    return chat.render(messages, add_generation_prompt=add_generation_prompt)


ALL = [*CONVERSATIONS.values(), PADDED]
IDS = [*CONVERSATIONS, "padded contents"]


@pytest.mark.parametrize("add_ass", [False, True])
@pytest.mark.parametrize("messages", ALL, ids=IDS)
def test_chatml(messages, add_ass):
    # llama.cpp's "chatml" is the whole template: no BOS, no default system message.
    expected = cpp_render("chatml", messages, add_ass)
    assert ours("chatml", messages, add_ass) == expected
    # llama.cpp recognises our source by its <|im_start|> and formats it the same way.
    assert cpp_render(BUILTIN_TEMPLATES["chatml"], messages, add_ass) == expected


@pytest.mark.parametrize("add_ass", [False, True])
@pytest.mark.parametrize("messages", ALL, ids=IDS)
def test_llama_3(messages, add_ass):
    # llama.cpp's "llama3" leaves BOS to the tokenizer (which adds it); Meta's template writes
    # bos_token before the first message. So ours == bos_token + llama.cpp's, for any BOS text.
    expected = cpp_render("llama3", messages, add_ass)
    assert ours("llama-3", messages, add_ass) == expected
    assert ours("llama-3", messages, add_ass, bos="<|begin_of_text|>") == (
        "<|begin_of_text|>" + expected
    )
    # llama.cpp recognises our source by its <|start_header_id|> and formats it the same way.
    assert cpp_render(BUILTIN_TEMPLATES["llama-3"], messages, add_ass) == expected


def spaced_replies(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each assistant content with one space either side, as Meta's llama-2 format writes it."""
    return [
        msg(m["role"], f" {m['content']} " if m["role"] == "assistant" else m["content"])
        for m in messages
    ]


@pytest.mark.parametrize("add_ass", [False, True])
@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS)
def test_llama_2(messages, add_ass):
    # Meta's format (the Llama-2-chat template): "<s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user}
    # [/INST] {reply} </s><s>[INST] {user} [/INST]" - BOS before every [INST], one space either
    # side of each reply. llama.cpp's llama2 formatters write replies with no spaces and never
    # put BOS first (the tokenizer adds it); "llama2-sys-bos" writes "<s>" before each later
    # [INST], "llama2-sys" writes none. Given replies already spaced, they reproduce Meta's
    # format exactly: ours(bos="<s>") == "<s>" + llama2-sys-bos, ours(bos="") == llama2-sys.
    # (Meta's template strips contents and llama.cpp's do not, hence contents without
    # surrounding whitespace here.) Neither has a generation prompt: "[/INST]" is it.
    spaced = spaced_replies(messages)
    with_bos = ours("llama-2", messages, add_ass, bos="<s>", eos="</s>")
    assert with_bos == "<s>" + cpp_render("llama2-sys-bos", spaced, add_ass)
    assert ours("llama-2", messages, add_ass, eos="</s>") == cpp_render(
        "llama2-sys", spaced, add_ass
    )


def test_llama_2_source_is_recognised_as_the_stripping_variant():
    # Passing our llama-2 source itself as tmpl selects "llama2-sys-strip" (its content.strip()),
    # which strips the spaces above away: it cannot reproduce Meta's format, so the equalities
    # are proven against the named variants instead.
    messages = CONVERSATIONS["system, multi-turn, ends with user"]
    spaced = spaced_replies(messages)
    detected = cpp_render(BUILTIN_TEMPLATES["llama-2"], spaced, False)
    assert detected == cpp_render("llama2-sys-strip", spaced, False)
    assert detected == cpp_render("llama2-sys", messages, False)
