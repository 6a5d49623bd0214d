"""The example cache: JSONL is encoded once; a changed input or setting misses, a damaged entry
is rebuilt with a warning, and skipped lines are reported again from the cache."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_files import vocab_dir as vocab_dir

from llamatrain.chat_template import resolve_chat_template
from llamatrain.data.example_cache import load_examples
from llamatrain.data.examples import LineEncoder
from llamatrain.data.jsonl import BadLines
from llamatrain.gguf.llama import read_tokenizer

CHAT = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
]
LINES = [{"messages": CHAT}, "{oops", {"text": "plain text"}, {"prompt": "Q:", "completion": "A"}]


class Counting:
    """A tokenizer that counts its encode calls."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.calls += 1
        return self.inner.encode_batch(*args, **kwargs)


@pytest.fixture(scope="module")
def qwen(vocab_dir: Path):
    return read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def build(tokenizer, paths, cache, *, template="chatml", train_on="completion"):
    """(examples, skipped-line summaries, warnings) of one cached read."""
    encoder = LineEncoder(
        tokenizer, resolve_chat_template(template, None, tokenizer), train_on=train_on
    )
    bad = BadLines("skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples = load_examples(paths, encoder, bad, cache)
    return examples, bad.summaries(), [str(w.message) for w in caught]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.ids, y.ids)
        and np.array_equal(x.scored, y.scored)
        and x.scored.dtype == y.scored.dtype
        and x.ids.dtype == y.ids.dtype
        and x.inexact == y.inexact
        for x, y in zip(a, b, strict=True)
    )


def test_a_second_build_encodes_nothing_and_repeats_the_skipped_lines(qwen, tmp_path):
    path = write_lines(tmp_path / "chats.jsonl", LINES)
    tok = Counting(qwen)
    first, summaries, caught = build(tok, [path], tmp_path / "cache")
    assert tok.calls > 0 and not caught and len(first) == 3
    assert summaries and summaries[0].startswith(f"skipped 1 of 4 lines of {path}")
    tok.calls = 0
    again, summaries_again, caught = build(tok, [path], tmp_path / "cache")
    assert tok.calls == 0 and not caught
    assert same(first, again) and summaries_again == summaries


def test_a_changed_file_template_or_train_on_misses_the_cache(qwen, tmp_path):
    path = write_lines(tmp_path / "chats.jsonl", LINES)
    cache = tmp_path / "cache"
    tok = Counting(qwen)
    base, _, _ = build(tok, [path], cache)
    for change in ("file", "template", "train_on"):
        tok.calls = 0
        if change == "file":
            write_lines(path, [*LINES, {"text": "one more"}])
            got, _, _ = build(tok, [path], cache)
            assert len(got) == len(base) + 1
        elif change == "template":
            build(tok, [path], cache, template="llama-2")
        else:
            got, _, _ = build(tok, [path], cache, train_on="all")
            assert not same(got, base)
        assert tok.calls > 0, change
    assert len(list((cache / "examples").glob("*.bin"))) == 4


def test_a_flipped_byte_is_rebuilt_with_a_warning(qwen, tmp_path):
    path = write_lines(tmp_path / "chats.jsonl", LINES)
    cache = tmp_path / "cache"
    first, _, _ = build(qwen, [path], cache)
    (entry,) = (cache / "examples").glob("*.bin")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 1
    entry.write_bytes(bytes(data))
    tok = Counting(qwen)
    again, summaries, caught = build(tok, [path], cache)
    assert tok.calls > 0 and same(first, again) and summaries
    (message,) = caught
    assert "does not match its recorded sha256; encoding again" in message
    tok.calls = 0
    build(tok, [path], cache)
    assert tok.calls == 0  # rebuilt: sound again


def test_an_edited_description_is_rebuilt(qwen, tmp_path):
    path = write_lines(tmp_path / "chats.jsonl", LINES)
    cache = tmp_path / "cache"
    build(qwen, [path], cache)
    (meta_path,) = (cache / "examples").glob("*.json")
    meta = json.loads(meta_path.read_text())
    meta["tallies"][0][1] = 0  # hide the skipped line
    meta_path.write_text(json.dumps(meta))
    _, summaries, caught = build(qwen, [path], cache)
    assert summaries and len(caught) == 1 and "encoding again" in caught[0]
