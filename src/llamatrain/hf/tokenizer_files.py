"""The tokenizer side of an HF folder: ``tokenizer.json`` and ``tokenizer_config.json``.

``tokenizer.json`` itself is read by ``llamatrain.tokenizer.hf_json``, which also sizes the
vocabulary as llama.cpp's converter does (ids up to config.json's ``vocab_size`` that the
tokenizer leaves unused become ``[PAD<id>]`` tokens), and written by
``llamatrain.tokenizer.hf_json_write``. What belongs to the folder is
handled here: a tokenizer larger than the embedding is refused (llama.cpp's converter refuses
it too), the chat template is found, and ``tokenizer_config.json`` — the special tokens
``tokenizer.json`` does not name — is written beside it on export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llamatrain.errors import CheckpointError
from llamatrain.gguf.vocab import tokenizer_metadata
from llamatrain.hf.config import read_json_object
from llamatrain.hf.inside import file_in_folder
from llamatrain.tokenizer import Tokenizer
from llamatrain.tokenizer.hf_json import read_hf_tokenizer
from llamatrain.tokenizer.hf_json_write import write_hf_tokenizer

__all__ = [
    "TOKENIZER_CONFIG",
    "TOKENIZER_FILE",
    "read_chat_template",
    "read_folder_tokenizer",
    "write_tokenizer_files",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers 5 saves the chat template instead of tokenizer_config.json."""
MAX_TEMPLATE_BYTES = 1 << 20
"""The largest chat_template.jinja read (published ones are at most tens of KiB)."""


def read_folder_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    """The folder's tokenizer, which must have exactly ``vocab_size`` ids (config.json's);
    its files (tokenizer.json, tokenizer_config.json, config.json) must lie in the folder."""
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG, "config.json"):
        file_in_folder(folder, name)
    if not (folder / TOKENIZER_FILE).is_file():
        raise CheckpointError(
            f"{folder} has no {TOKENIZER_FILE}; copy the model's tokenizer files into it"
        )
    tokenizer = read_hf_tokenizer(folder)
    if tokenizer.vocab_size != vocab_size:
        raise CheckpointError(
            f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens but config.json's "
            f"vocab_size is {vocab_size}; the model has no embedding for ids past "
            f"{vocab_size - 1} — use the model's own tokenizer"
        )
    return tokenizer


def read_chat_template(folder: Path) -> str | None:
    """The folder's default chat template, or None: from tokenizer_config.json (a string, or
    a list of named templates of which ``default`` is the one llama.cpp's converter keeps),
    else from ``chat_template.jinja``."""
    config = read_json_object(file_in_folder(folder, TOKENIZER_CONFIG))
    template = config.get("chat_template")
    if isinstance(template, list):
        defaults = [t.get("template") for t in template if _is_named(t, "default")]
        template = defaults[0] if defaults else None
    if isinstance(template, str):
        return template
    jinja = file_in_folder(folder, CHAT_TEMPLATE_FILE)
    if not jinja.is_file():
        return None
    if jinja.stat().st_size > MAX_TEMPLATE_BYTES:
        raise CheckpointError(
            f"{jinja} is {jinja.stat().st_size:,} bytes, more than a chat template "
            f"({MAX_TEMPLATE_BYTES >> 10} KiB at most); remove it or use a built-in template"
        )
    try:
        return jinja.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{jinja} is not UTF-8 text ({e.reason} at byte {e.start}); re-save the model's "
            "chat template, or use a built-in one"
        ) from None


def _is_named(entry: object, name: str) -> bool:
    """Whether a ``chat_template`` list entry is the template called ``name``."""
    return isinstance(entry, dict) and entry.get("name") == name


def write_tokenizer_files(
    folder: Path, tokenizer: Tokenizer, chat_template: str | None, max_seq_len: int
) -> None:
    """``tokenizer.json`` and the ``tokenizer_config.json`` transformers reads beside it: the
    special tokens, whether BOS/EOS are added, and the chat template. Byte-level BPE only
    (``write_hf_tokenizer`` raises TokenizerError for another vocabulary)."""
    write_hf_tokenizer(tokenizer, folder / TOKENIZER_FILE)
    (folder / TOKENIZER_CONFIG).write_text(
        json.dumps(_tokenizer_config(tokenizer, chat_template, max_seq_len), indent=2) + "\n",
        encoding="utf-8",
    )


def _tokenizer_config(
    tokenizer: Tokenizer, chat_template: str | None, max_seq_len: int
) -> dict[str, Any]:
    tokens = tokenizer_metadata(tokenizer)["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[tokenizer.bos_id],
        "eos_token": tokens[tokenizer.eos_id],
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": tokenizer.add_eos,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    for role, token_id in (("unk_token", tokenizer.unk_id), ("pad_token", tokenizer.pad_id)):
        if token_id is not None:
            config[role] = tokens[token_id]
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
