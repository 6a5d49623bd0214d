"""The token cache: stream layout, cache keys and reuse, dtype, chunked encoding."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from llamatrain.data import SONNETS_PATH, load_tokens
from llamatrain.data.cache import chunk_text, token_dtype
from llamatrain.errors import DataError


def write(path: Path, content: str) -> Path:
    path.write_text(content)
    return path


def cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "tokens").iterdir())


def test_stream_layout_and_cache_reuse(tmp_path, char_tokenizer):
    a, b = write(tmp_path / "a.txt", "ab\n"), write(tmp_path / "b.txt", "c")
    tok = char_tokenizer()
    cache = tmp_path / "cache"
    tokens = load_tokens([a, b], tok, cache)
    ids = [*tok.encode("ab\n"), tok.eos_id, *tok.encode("c"), tok.eos_id]  # EOS after each doc
    assert tokens.tolist() == ids and isinstance(tokens, np.memmap)
    assert tok.texts == ["ab\n", "c"]
    again = load_tokens([a, b], tok, cache)
    assert again.tolist() == ids and tok.texts == ["ab\n", "c"]  # read back, not re-tokenized
    with_bos = load_tokens([a, b], tok, cache, doc_bos=True)
    assert with_bos.tolist() == [tok.bos_id, *ids[:4], tok.bos_id, *ids[4:]]
    assert len(tok.texts) == 4  # a different layout is a different cache entry
    no_eos = load_tokens([a, b], tok, cache, doc_eos=False)
    assert no_eos.tolist() == [*tok.encode("ab\n"), *tok.encode("c")]
    entries = cache_entries(cache)
    assert len(entries) == 6 and not any(name.endswith(".tmp") for name in entries)


def test_cache_keys_are_unchanged(tmp_path, char_tokenizer):
    # The names of existing cache entries: a change here makes every user re-tokenize.
    a = write(tmp_path / "a.txt", "To be, or not to be.\n")
    tok = char_tokenizer()
    load_tokens([a], tok, tmp_path)
    load_tokens([a], tok, tmp_path, doc_bos=True)
    assert cache_entries(tmp_path) == [
        "75ac77a083e37a1d802fb061.bin",  # doc_bos=True
        "75ac77a083e37a1d802fb061.json",
        "b78aceac1ec2124f6befb6db.bin",  # the defaults
        "b78aceac1ec2124f6befb6db.json",
    ]


def test_cache_follows_contents_not_names_or_times(tmp_path, char_tokenizer):
    a = write(tmp_path / "a.txt", "abc\n")
    tok = char_tokenizer()
    load_tokens([a], tok, tmp_path)
    copy = tmp_path / "copy.txt"
    shutil.copy(a, copy)
    copy.touch()
    assert load_tokens([copy], tok, tmp_path).tolist() == [*tok.encode("abc\n"), tok.eos_id]
    assert tok.texts == ["abc\n"]  # same contents: the same entry
    write(a, "abd\n")  # same size, new content
    assert load_tokens([a], tok, tmp_path).tolist()[2] == tok.index["d"]
    assert tok.texts == ["abc\n", "abd\n"]
    other = char_tokenizer(vocab_size=200)  # another fingerprint
    load_tokens([a], other, tmp_path)
    assert other.texts == ["abd\n"]


def test_a_truncated_cache_file_is_rebuilt(tmp_path, char_tokenizer):
    a = write(tmp_path / "a.txt", "abcdef\n")
    tok = char_tokenizer()
    expected = load_tokens([a], tok, tmp_path).tolist()
    (bin_path,) = (tmp_path / "tokens").glob("*.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    assert load_tokens([a], tok, tmp_path).tolist() == expected
    assert len(tok.texts) == 2


def test_dtype_follows_vocab_size(tmp_path, char_tokenizer):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    a = write(tmp_path / "a.txt", "abc\n")
    assert load_tokens([a], char_tokenizer(), tmp_path).dtype == np.uint16
    assert load_tokens([a], char_tokenizer(vocab_size=65536), tmp_path).dtype == np.uint16
    wide = load_tokens([a], char_tokenizer(vocab_size=65537), tmp_path)
    assert wide.dtype == np.uint32 and wide.tolist() == [*char_tokenizer().encode("abc\n"), 2]


def test_chunk_text_cuts_at_line_ends():
    text = SONNETS_PATH.read_text()[:2000]
    chunks = chunk_text(text, 100)  # longer than any line
    assert "".join(chunks) == text and len(chunks) > 20
    assert all(len(c) <= 100 and c.endswith("\n") for c in chunks[:-1])
    assert chunk_text("x" * 120, 50) == ["x" * 50, "x" * 50, "x" * 20]  # no line end: hard cut
    assert chunk_text("", 50) == []


def test_chunked_encoding_matches_whole_documents(tmp_path, char_tokenizer):
    text = SONNETS_PATH.read_text()[:2000]
    a, b = write(tmp_path / "a.txt", text), write(tmp_path / "b.txt", "")
    tok = char_tokenizer()
    tokens = load_tokens([a, b], tok, tmp_path / "c", progress=True, chunk_chars=50)
    assert tokens.tolist() == [*tok.encode(text), tok.eos_id, tok.eos_id]  # empty doc: just EOS
    assert tok.texts == [*chunk_text(text, 50), ""]
    load_tokens([a, b], tok, tmp_path / "c")  # other piece size: its own cache entry
    assert tok.texts[len(chunk_text(text, 50)) + 1 :] == [text, ""]


def test_errors(tmp_path, char_tokenizer):
    a = write(tmp_path / "a.txt", "abc\n")
    with pytest.raises(DataError, match="outside its vocabulary of 50 while encoding"):
        load_tokens([a], char_tokenizer(50), tmp_path)
    with pytest.raises(DataError, match="no input files"):
        load_tokens([], char_tokenizer(), tmp_path)
    with pytest.raises(DataError, match="tokenize to zero tokens"):
        load_tokens([write(tmp_path / "e.txt", "")], char_tokenizer(), tmp_path, doc_eos=False)
    assert not list((tmp_path / "tokens").glob("*.tmp"))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flip", "does not match its recorded sha256"),
        ("count", "number of tokens"),
        ("dtype", "other settings"),
        ("json", "unreadable description"),
        ("id", "outside the"),
    ],
)
def test_a_damaged_or_edited_cache_entry_is_rebuilt(tmp_path, char_tokenizer, damage, reason):
    """Nothing in the cache is believed unchecked: a flipped byte, an edited description or
    an id past the vocabulary makes the run tokenize again (with a warning), never train on
    what the entry holds."""
    a = tmp_path / "a.txt"
    a.write_text("to be or not to be\n" * 20)
    cache = tmp_path / "cache"
    tok = char_tokenizer()
    first = np.array(load_tokens([a], tok, cache))
    folder = cache / "tokens"
    (bin_path,) = folder.glob("*.bin")
    meta_path = bin_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    if damage == "flip":
        data = bytearray(bin_path.read_bytes())
        data[3] ^= 1
        bin_path.write_bytes(bytes(data))
    elif damage == "count":
        meta["n_tokens"] -= 1
        meta_path.write_text(json.dumps(meta))
    elif damage == "dtype":
        meta["dtype"] = "uint32"
        meta_path.write_text(json.dumps(meta))
    elif damage == "json":
        meta_path.write_text("{" * 100_000)
    else:  # an id past the vocabulary, with a description that agrees with the bytes
        ids = np.fromfile(bin_path, dtype=meta["dtype"])
        ids[0] = np.iinfo(ids.dtype).max
        ids.tofile(bin_path)
        meta["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
        meta_path.write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=reason):
        again = np.array(load_tokens([a], tok, cache))
    np.testing.assert_array_equal(again, first)
    assert np.array_equal(load_tokens([a], tok, cache), first)  # rebuilt: no warning


def test_the_tokenizer_cache_follows_contents_not_sizes_or_times(tmp_path):
    """Issue 37: the trained tokenizer's cache was keyed by path, size and mtime, so a corpus
    rewritten with its old size and mtime (os.utime, a restored backup, a coarse clock) got the
    tokenizer trained on its old text."""
    from llamatrain.build import build_tokenizer
    from llamatrain.config import load_config
    from llamatrain.tokenizer import train_byte_bpe

    corpus = write(tmp_path / "corpus.txt", "the cat sat on the mat\n" * 40)
    overrides = ["tokenizer.model_type=byte_bpe", "tokenizer.vocab_size=300"]
    cfg = load_config(None, overrides=[*overrides, f"data.cache_dir={tmp_path / 'cache'}"])
    before = build_tokenizer(cfg, [corpus])
    times = corpus.stat()
    write(corpus, ("dog ran up my log\n" * 40).ljust(times.st_size, "\n"))  # other words
    assert corpus.stat().st_size == times.st_size
    os.utime(corpus, ns=(times.st_atime_ns, times.st_mtime_ns))
    after = build_tokenizer(cfg, [corpus])
    assert after.tokens == train_byte_bpe([corpus], 300).tokens != before.tokens
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2
