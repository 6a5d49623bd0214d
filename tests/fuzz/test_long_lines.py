"""Text is cut before it is tokenized, in bounded pieces (issue 30, item 4).

A 100 MB JSONL line, in each example layout, is read, parsed, cut to what its row can take
and encoded in < 2 s and < 500 MB (``fuzz_bounds.bounded``), where it used to be tokenized
whole (4.8 GB); the cut is counted and reported. A line past what is ever read is skipped
(or refused) without being held, and what ``json`` cannot hold is one line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from fuzz_bounds import bounded
from llama_cpp_files import vocab_dir as vocab_dir

from llamatrain.chat_template import chat_template_for
from llamatrain.config import load_config
from llamatrain.data import build_train_data
from llamatrain.data.examples import LineEncoder, cut_chars, read_examples
from llamatrain.data.jsonl import BadLines, numbered_lines, parse_line
from llamatrain.data.preferences import PairEncoder, read_pairs
from llamatrain.errors import DataError
from llamatrain.gguf.llama import read_tokenizer

pytestmark = pytest.mark.fuzz

SPAN = 129
"""A row of the tiny config (n_ctx 64 + 1 would do as well; the cut's floor is the same)."""
BIG = 100 << 20
"""Characters of the long field: a 100 MB line."""


@pytest.fixture(scope="module")
def tokenizer(vocab_dir: Path):
    return read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")


def encoder_for(tokenizer) -> LineEncoder:
    template = chat_template_for("chatml", None, bos_token="", eos_token="<|endoftext|>")
    return LineEncoder(tokenizer, template, train_on="completion", max_chars=cut_chars(SPAN))


def huge_row(layout: str) -> dict:
    sentence = "All the world's a stage, and all the men and women merely players. "
    text = sentence * (BIG // len(sentence) + 1)
    return {
        "text": {"text": text},
        "completion": {"prompt": "Q: ", "completion": text},
        "long prompt": {"prompt": text, "completion": " A"},
        "messages": {"messages": [{"role": "user", "content": text[: BIG // 2]},
                                  {"role": "assistant", "content": text[BIG // 2 :]}]},
        "many messages": {"messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "ho"}] * (BIG // 80)},
        "alpaca": {"instruction": "Say it.", "input": "", "output": text},
        "sharegpt": {"conversations": [{"from": "human", "value": "Say it."},
                                       {"from": "gpt", "value": text}]},
    }[layout]  # fmt: skip


SLOW = pytest.mark.slow  # ~3 s each: the default suite runs two layouts, -m slow the rest


@pytest.mark.parametrize(
    "layout",
    ["text", "messages"]
    + [pytest.param(x, marks=SLOW) for x in ("completion", "long prompt", "alpaca", "sharegpt")],
)
def test_a_100_mb_line_is_cut_before_it_is_tokenized(tmp_path: Path, tokenizer, layout) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"text": "A short line first."}) + "\n")
        f.write(json.dumps(huge_row(layout)) + "\n")
    assert path.stat().st_size >= BIG
    encoder = encoder_for(tokenizer)
    examples = bounded(lambda: read_examples([path], encoder, BadLines("error")), layout)
    short, long = examples
    assert encoder.cut == 1
    assert long.ids[-1] != tokenizer.eos_id  # the line did not end where it was cut
    assert len(long.ids) > SPAN  # the row is filled as if the line had been tokenized whole
    assert len(short.ids) < SPAN and short.ids[-1] == tokenizer.eos_id


@SLOW
def test_a_100_mb_line_of_small_values_is_refused_before_parsing(tmp_path: Path, tokenizer):
    """Parsed, it would take ~1 GB of Python objects: one skipped line, not a swap storm."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"text": "A short line first."}) + "\n")
        f.write(json.dumps(huge_row("many messages")) + "\n")
    bad = BadLines("skip")
    examples = bounded(lambda: read_examples([path], encoder_for(tokenizer), bad), "messages")
    assert len(examples) == 1
    (summary,) = bad.summaries()
    assert "line 2: " in summary and "MB in memory" in summary and "split it" in summary


def test_lines_within_the_cut_are_encoded_as_before(tokenizer) -> None:
    """The cut changes nothing below its limit: the same tokens as with no limit at all."""
    whole = LineEncoder(tokenizer, encoder_for(tokenizer).template, train_on="completion")
    cut = encoder_for(tokenizer)
    limit = cut_chars(SPAN)
    text = ("word " * limit)[: limit - 40]
    lines = [
        {"text": text},
        {"prompt": text[:1000], "completion": text[1000:]},
        {"messages": [{"role": "user", "content": text[: limit // 2]},
                      {"role": "assistant", "content": text[limit // 2 : -100]}]},
    ]  # fmt: skip
    for line in lines:
        parsed = parse_line(json.dumps(line), need_assistant=True)
        a, b = whole.encode(parsed), cut.encode(parsed)
        assert a.ids.tolist() == b.ids.tolist() and a.scored.tolist() == b.scored.tolist()
    assert cut.cut == 0


def test_the_cut_lines_are_counted_in_one_warning(tmp_path: Path, tokenizer) -> None:
    limit = cut_chars(65)
    rows = [{"text": "x " * limit}, {"text": "short"}, {"prompt": "y " * limit, "completion": "z"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"data.path='{path}'", "data.format='jsonl'", f"data.cache_dir='{tmp_path}'",
                 "data.val_fraction=0"]  # fmt: skip
    cfg = load_config("tiny", overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_train_data(cfg, tokenizer)
    notes = [str(w.message) for w in caught]
    assert any(f"2 lines held more than {limit:,} characters" in n for n in notes), notes


def test_a_line_past_what_is_read_is_skipped_without_being_held(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "a"}\n' + "x" * 5_000_000 + '\n\n{"text": "b"}\r\n')
    bad = BadLines("skip")
    lines = bounded(lambda: list(numbered_lines(path, bad, max_chars=1000)), "a long line")
    assert lines == [(1, '{"text": "a"}'), (4, '{"text": "b"}')]
    (summary,) = bad.summaries()
    assert "skipped 1 of 1 lines" in summary and "line 2: a line of more than 1,000" in summary
    with pytest.raises(DataError, match=r"long\.jsonl:2: a line of more than 1,000 characters"):
        list(numbered_lines(path, max_chars=1000))


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper"),
        ('{"text": "a", "n": ' + "9" * 5000 + "}", "4300 digits"),
        ('{"text": "a\\ud800b"}', "lone surrogate (\\ud800"),
        ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "lone surrogate"),
        ('{"messages": [], "tools": "' + "[" * 100_000 + '"}', '"tools"'),
    ],
)
def test_json_python_cannot_hold_is_one_line(line: str, words: str) -> None:
    caught: list[DataError] = []

    def parse() -> None:
        try:
            parse_line(line, need_assistant=False)
        except DataError as e:
            caught.append(e)

    bounded(parse, "a crafted line")
    assert caught and words in str(caught[0]) and "\n" not in str(caught[0])


def test_a_surrogate_pair_is_a_character() -> None:
    line = parse_line('{"text": "\\ud83d\\ude00"}', need_assistant=False)
    assert line.text == "\U0001f600"


@pytest.mark.parametrize("shape", ["text", "messages"])
def test_a_100_mb_preference_reply_is_cut_before_it_is_tokenized(tmp_path: Path, tokenizer, shape):
    """A pair's reply is cut like any line's; both replies keep the same prompt."""
    text = huge_row("text")["text"]
    if shape == "text":
        row = {"prompt": "Q: ", "chosen": text, "rejected": "No."}
    else:
        row = {"prompt": [{"role": "user", "content": "Q?"}], "chosen": text, "rejected": "No."}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    encoder = encoder_for(tokenizer)
    (pair,) = bounded(lambda: read_pairs([path], PairEncoder(encoder), BadLines("error")), shape)
    assert len(pair.chosen.ids) > SPAN and len(pair.rejected.ids) < SPAN
    prompt = int(pair.rejected.scored.nonzero()[0][0])  # where the rejected reply is scored
    assert pair.chosen.ids[:prompt].tolist() == pair.rejected.ids[:prompt].tolist()
    assert encoder.cut == 1
