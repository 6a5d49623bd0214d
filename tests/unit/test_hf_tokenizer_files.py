"""The tokenizer side of an HF folder: the chat template's places, vocabulary size, and the
tokenizer_config.json an export writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamatrain.errors import CheckpointError
from llamatrain.hf.tokenizer_files import (
    read_chat_template,
    read_folder_tokenizer,
    write_tokenizer_files,
)
from llamatrain.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, BpeTokenizer
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def byte_tokenizer() -> BpeTokenizer:
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["<|begin|>", "<|end|>"]
    types = [TOKEN_TYPE_NORMAL] * 256 + [TOKEN_TYPE_CONTROL] * 2
    return BpeTokenizer(tokens, types, [], pre="llama-bpe", bos_id=256, eos_id=257)


def write_config(folder: Path, config: object) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_chat_template_is_found_where_transformers_keeps_it(tmp_path):
    assert read_chat_template(tmp_path) is None
    write_config(tmp_path, {"chat_template": TEMPLATE})
    assert read_chat_template(tmp_path) == TEMPLATE
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    write_config(tmp_path, {"chat_template": named})  # llama.cpp's converter keeps "default"
    assert read_chat_template(tmp_path) == TEMPLATE
    write_config(tmp_path, {})
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)  # transformers 5 saves it here
    assert read_chat_template(tmp_path) == TEMPLATE
    write_config(tmp_path, ["not", "an", "object"])
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        read_chat_template(tmp_path)


def test_written_files_read_back_as_the_same_tokenizer(tmp_path):
    tokenizer = byte_tokenizer()
    write_tokenizer_files(tmp_path, tokenizer, TEMPLATE, max_seq_len=128)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["chat_template"]) == (
        "<|begin|>",
        "<|end|>",
        TEMPLATE,
    )
    assert config["model_max_length"] == 128 and "pad_token" not in config
    back = read_folder_tokenizer(tmp_path, vocab_size=258)
    assert back.fingerprint() == tokenizer.fingerprint()


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    write_tokenizer_files(tmp_path, byte_tokenizer(), None, max_seq_len=128)
    with pytest.raises(CheckpointError, match="258 tokens but config.json's vocab_size is 200"):
        read_folder_tokenizer(tmp_path, vocab_size=200)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        read_folder_tokenizer(tmp_path, vocab_size=258)
