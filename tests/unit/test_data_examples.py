"""JSONL examples → tokens with a trained mask → packed or padded rows.

The masks are checked on llama.cpp's real vocabularies against an independent reference: each
token is placed in the rendered text by its own vocabulary string, and the characters it covers
must all belong to one class — trained (assistant content and end-of-turn marker, as the
template's segments say) exactly when the token is scored. So no token straddles into the
wrong class, and the scored tokens spell exactly the trained text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_files import vocab_dir as vocab_dir

from llamatrain.chat_template import chat_template_for, resolve_chat_template
from llamatrain.data.examples import (
    Example,
    LineEncoder,
    pack_rows,
    pad_rows,
    read_examples,
    split_examples,
    truncate,
)
from llamatrain.data.jsonl import BadLines, ChatLine, CompletionLine, TextLine
from llamatrain.errors import ConfigError, DataError
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.tokenizer import TOKEN_TYPE_CONTROL

CHAT = (
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And\n3 + 3?"},
    {"role": "assistant", "content": " Six, of course!  "},
)

VOCABS = {"chatml": "qwen2", "llama-3": "llama-bpe", "llama-2": "llama-spm"}
"""Each builtin template on a vocabulary of the family that uses it."""


@pytest.fixture(scope="module")
def tokenizers(vocab_dir: Path) -> dict:
    return {t: read_tokenizer(vocab_dir / f"ggml-vocab-{v}.gguf") for t, v in VOCABS.items()}


def token_strings(tokenizer, ids: np.ndarray) -> list[str]:
    """Each token as it stands in the text: control tokens as their piece (``<|im_start|>``),
    others as the bytes llama.cpp renders for them."""
    pieces = getattr(tokenizer, "pieces", None) or tokenizer.tokens
    types = tokenizer.token_types
    return [
        pieces[i] if types[i] == TOKEN_TYPE_CONTROL else tokenizer.token_bytes(i).decode()
        for i in map(int, ids)
    ]


def char_spans(text: str, strings: list[str]) -> list[tuple[int, int]]:
    """Where each token string lies in ``text``, in order. A leading BOS the encoder added is
    not in the text (empty span); SPM's dummy-prefix space may be absent from it."""
    spans, pos = [], 0
    for s in strings:
        if text.startswith(s, pos):
            spans.append((pos, pos + len(s)))
        elif s.startswith(" ") and text.startswith(s[1:], pos):
            spans.append((pos, pos + len(s) - 1))
        else:
            assert not spans, f"token {s!r} is not at {pos} of {text!r}"
            spans.append((0, 0))  # the BOS put before the text
            continue
        pos = spans[-1][1]
    assert pos == len(text)
    return spans


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_scored_tokens_are_exactly_the_trained_text(tokenizers, name):
    tokenizer = tokenizers[name]
    template = resolve_chat_template(name, None, tokenizer)
    segments = template.segments(CHAT)
    text = "".join(s.text for s in segments)
    trained_chars = np.concatenate([np.full(len(s.text), s.trained) for s in segments])
    example = LineEncoder(tokenizer, template, train_on="completion").encode(ChatLine(CHAT))
    assert example.inexact == 0
    spans = char_spans(text, token_strings(tokenizer, example.ids))
    for i, (start, end) in enumerate(spans):
        classes = set(trained_chars[start:end].tolist())
        assert classes in ({True}, {False}, set()), f"token {i} straddles classes"
        if i > 0:
            assert example.scored[i] == (classes == {True}), f"token {i} in the wrong class"
    scored_text = "".join(text[a:b] for (a, b), s in zip(spans, example.scored, strict=True) if s)
    assert scored_text == "".join(s.text for s in segments if s.trained)
    assert template.end_of_turn in scored_text  # each assistant turn ends with its marker


def test_bos_is_added_once_where_the_tokenizer_adds_it(tokenizers):
    for name, tokenizer in tokenizers.items():
        template = resolve_chat_template(name, None, tokenizer)
        ids = LineEncoder(tokenizer, template, train_on="all").encode(ChatLine(CHAT)).ids
        assert (ids[0] == tokenizer.bos_id) == tokenizer.add_bos
        assert list(ids).count(tokenizer.bos_id) == BOS_COUNT[name]


BOS_COUNT = {"chatml": 0, "llama-3": 1, "llama-2": 2}
"""BOS in CHAT's tokens: Qwen adds none; llama-3 writes one; llama-2 writes one per user turn."""


def test_text_and_completion_lines(tokenizers):
    tokenizer = tokenizers["llama-2"]
    encoder = LineEncoder(tokenizer, None, train_on="completion")
    text = encoder.encode(TextLine("Once upon a time"))
    expected = [tokenizer.bos_id, *tokenizer.encode("Once upon a time"), tokenizer.eos_id]
    assert text.ids.tolist() == expected and text.scored.tolist() == [False] + [True] * (
        len(expected) - 1
    )
    line = encoder.encode(CompletionLine("Q: two and two?\nA:", " four"))
    whole = tokenizer.encode("Q: two and two?\nA: four")
    prompt = tokenizer.encode("Q: two and two?\nA:")
    assert line.ids.tolist() == [tokenizer.bos_id, *whole, tokenizer.eos_id]
    n_prompt = 1 + len(prompt)  # the prompt's tokens are a prefix here: no straddling token
    assert whole[: len(prompt)] == prompt and line.inexact == 0
    assert line.scored.tolist() == [False] * n_prompt + [True] * (len(line.ids) - n_prompt)
    everything = LineEncoder(tokenizer, None, train_on="all").encode(CompletionLine("Q:", " A"))
    assert everything.scored.tolist() == [False] + [True] * (len(everything.ids) - 1)


def test_a_straddling_boundary_is_counted_and_goes_to_the_later_text(tokenizers):
    tokenizer = tokenizers["llama-2"]
    line = CompletionLine("upo", "n")  # "upon" is one token: the boundary falls inside it
    example = LineEncoder(tokenizer, None, train_on="completion").encode(line)
    assert example.inexact == 1
    assert example.ids.tolist() == [tokenizer.bos_id, *tokenizer.encode("upon"), tokenizer.eos_id]
    assert example.scored.tolist() == [False, True, True]


def test_auto_without_a_model_template_fails_only_for_conversations(tokenizers):
    tokenizer = tokenizers["chatml"]
    assert resolve_chat_template("auto", None, tokenizer) is None
    encoder = LineEncoder(tokenizer, None, train_on="completion")
    encoder.encode(TextLine("plain text needs no template"))
    with pytest.raises(ConfigError, match="data.chat_template to one of chatml"):
        encoder.encode(ChatLine(CHAT))
    model_template = chat_template_for("chatml", None, bos_token="", eos_token="").source
    own = resolve_chat_template("auto", model_template, tokenizer)
    assert own.render(CHAT) == resolve_chat_template("chatml", None, tokenizer).render(CHAT)


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


BAD_ROLE = {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}


def test_bad_lines_name_file_and_line_or_are_skipped_and_counted(tokenizers, tmp_path):
    tokenizer = tokenizers["chatml"]
    encoder = LineEncoder(
        tokenizer, resolve_chat_template("chatml", None, tokenizer), train_on="completion"
    )
    path = write_lines(
        tmp_path / "chats.jsonl",
        [{"text": "ok"}, "", "{oops", {"messages": list(CHAT)}, BAD_ROLE, {"text": "fine"}],
    )
    with pytest.raises(DataError, match=r"chats\.jsonl:3: invalid JSON"):
        read_examples([path], encoder, BadLines("error"))
    write_lines(path, [{"text": "ok"}, BAD_ROLE])
    with pytest.raises(DataError, match=r"chats\.jsonl:2: .*wizard"):  # the template's error
        read_examples([path], encoder, BadLines("error"))
    write_lines(path, [{"text": "ok"}, "", "{oops", {"messages": list(CHAT)}, BAD_ROLE, "7"])
    bad = BadLines("skip")
    examples = read_examples([path], encoder, bad)
    assert len(examples) == 2
    (summary,) = bad.summaries()
    assert summary.startswith(f"skipped 3 of 5 lines of {path} (first: line 3: invalid JSON")
    write_lines(path, ["{oops"])
    with pytest.raises(DataError, match="no usable example"):
        read_examples([path], encoder, BadLines("skip"))


def example(n: int, scored_from: int = 1, first: int = 10) -> Example:
    ids = np.arange(first, first + n, dtype=np.int64)
    return Example(ids, np.arange(n) >= max(scored_from, 1))


def test_packing_lays_whole_examples_in_order_each_its_own_document():
    examples = [example(4, first=10), example(3, first=20), example(5, first=30), example(2)]
    rows = pack_rows(examples, span=8, pad_id=0)
    assert len(rows) == 2  # 4 + 3 | 5 + 2 (the third does not fit after 4 + 3)
    inputs, targets, documents = rows.batch(np.arange(2))
    assert inputs.shape == targets.shape == documents.shape == (2, 7)
    assert inputs[0].tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert documents.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    # targets: the next token of the same example; -100 where the next one starts another
    # example (its first token is nobody's target) or is padding
    assert targets[0].tolist() == [11, 12, 13, IGNORE_INDEX, 21, 22, IGNORE_INDEX]
    assert targets[1].tolist() == [31, 32, 33, 34, IGNORE_INDEX, 11, IGNORE_INDEX]
    assert (np.diff(rows.documents, axis=1) >= 0).all()


def test_unpacked_rows_hold_one_example_padded_and_no_documents():
    rows = pad_rows([example(3, scored_from=2), example(8)], span=8, pad_id=7)
    inputs, targets, documents = rows.batch(np.array([0, 1]))
    assert documents is None
    assert inputs[0].tolist() == [10, 11, 12, 7, 7, 7, 7]
    assert targets[0].tolist() == [IGNORE_INDEX, 12] + [IGNORE_INDEX] * 5
    assert targets[1].tolist() == list(range(11, 18))
    assert rows.seen_tokens(32).nonzero().flatten().tolist() == list(range(10, 18))


def test_truncation_cuts_to_a_row_counts_and_drops_what_lost_every_trained_token():
    kept, cut, emptied = truncate([example(4), example(12), example(12, scored_from=9)], 8)
    assert [len(e.ids) for e in kept] == [4, 8] and (cut, emptied) == (2, 1)


def test_an_example_that_scores_nothing_is_left_out_cut_or_not():
    """A one-token text (``{"text": ""}`` without BOS: EOS alone, nobody's target) scores
    nothing even uncut; a batch of such rows would have no loss to average."""
    kept, cut, unscored = truncate([example(1), example(4), example(12, scored_from=9)], 8)
    assert [len(e.ids) for e in kept] == [4] and (cut, unscored) == (1, 2)


def test_validation_is_the_last_whole_examples():
    examples = [example(2, first=i) for i in range(20)]
    train, val = split_examples(examples, 0.1)
    assert [e.ids[0] for e in val] == [18, 19] and len(train) == 18
    assert split_examples(examples, 0) == (examples, [])
    with pytest.raises(DataError, match="holds out 0"):
        split_examples(examples[:3], 0.1)
