"""build_train_data: a config's data section turned into windows and batches."""

from __future__ import annotations

import numpy as np
import torch

from llamatrain.config import load_config
from llamatrain.data import SONNETS_PATH, build_train_data, read_text


def config(cache_dir, *overrides: str):
    return load_config(None, ["data.path=sonnets", f"data.cache_dir={cache_dir}", *overrides])


def test_sonnets_with_bos_prefixed_windows(tmp_path, monkeypatch, char_tokenizer):
    monkeypatch.chdir(tmp_path)  # the packaged corpus is found from any working directory
    cfg = config(tmp_path, "data.n_ctx=64", "train.n_batch=512", "data.val_fraction=0.05")
    tok = char_tokenizer()
    td = build_train_data(cfg, tok, progress=False)
    assert td.paths == [SONNETS_PATH]
    n = len(read_text(SONNETS_PATH)) + 1  # one token per character, then EOS
    assert td.tokens.tolist() == [*tok.encode(read_text(SONNETS_PATH)), tok.eos_id]
    split = n - round(n * 0.05)
    assert len(td.train) == split - 64 + 1 and len(td.val) == (n - split - 64) // 64 + 1
    assert td.n_seq == 8
    x, y, _ = td.sampler.next_batch()
    assert x.shape == y.shape == (8, 64)
    assert x[:, 0].eq(tok.bos_id).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert tok.bos_id not in td.tokens  # BOS only as the window prefix
    vx, vy, _ = next(td.val_batches(1))
    assert vx.shape == (8, 64) and vy[0].tolist() == td.tokens[split : split + 64].tolist()


def test_plain_windows_put_bos_in_the_stream(tmp_path, char_tokenizer):
    cfg = config(tmp_path, "data.n_ctx=64", "data.bos_prefix=false", "train.n_batch=128")
    tok = char_tokenizer()
    td = build_train_data(cfg, tok, progress=False)
    assert td.tokens[0] == tok.bos_id and td.tokens[-1] == tok.eos_id and td.train.span == 65
    x, y, _ = td.sampler.next_batch()
    assert x.shape == (2, 64) and torch.equal(x[:, 1:], y[:, :-1])


def test_newline_windows_start_after_line_and_document_ends(tmp_path, char_tokenizer):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one two three\nfour five six\n" * 20)
    b.write_text("no newline at all, " * 40)
    cfg = config(
        tmp_path,
        f"data.path=[{str(a)!r}, {str(b)!r}]",
        "data.n_ctx=8",
        "train.n_batch=16",
        "data.val_fraction=0",
        "data.sample_start=newline",
    )
    tok = char_tokenizer()
    td = build_train_data(cfg, tok, progress=False)
    assert td.paths == [a, b] and td.val is None and list(td.val_batches()) == []
    starts = td.train.start_positions(np.arange(len(td.train)))
    assert starts[0] == 0
    assert {int(td.tokens[s - 1]) for s in starts[1:]} == {tok.index["\n"], tok.eos_id}
    doc_b = len(a.read_text()) + 1
    assert doc_b in starts  # the start of the second document


def test_already_resolved_paths_are_used_as_given(tmp_path, char_tokenizer):
    text = tmp_path / "t.txt"
    text.write_text("a short text\n" * 10)
    cfg = config(tmp_path, "data.n_ctx=8", "train.n_batch=16", "data.val_fraction=0")
    td = build_train_data(cfg, char_tokenizer(), paths=iter([text]), progress=False)
    assert td.paths == [text] and len(td.tokens) == 131
