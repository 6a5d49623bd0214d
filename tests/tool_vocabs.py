"""Real vocabularies whose tool tokens are what each family's template writes, for any test
module: ``from tool_vocabs import family_vocab``.

llama.cpp's test vocabularies (``llama_cpp_files.vocab_dir``) hold Qwen2's (``<|im_end|>`` one
control token; ``<tool_call>`` is text in it, as in the Qwen2 release) and Llama 3's. Llama 3.1
kept Llama 3's vocabulary and named two of its reserved control tokens: 128008 became
``<|eom_id|>`` (the end of a message that waits for a tool's output) and 128010
``<|python_tag|>`` (a call follows). :func:`family_vocab` gives Llama 3's file with those names,
the vocabulary a Llama 3.1 GGUF carries, so its template's markers are one token each.
"""

from __future__ import annotations

from pathlib import Path

from llamatrain.gguf.file import read_gguf_metadata
from llamatrain.gguf.vocab import tokenizer_from_metadata
from llamatrain.tokenizer import Tokenizer

LLAMA_3_1_NAMES = {128008: "<|eom_id|>", 128010: "<|python_tag|>"}
"""Llama 3's reserved tokens that Llama 3.1 named (its tokenizer_config.json)."""

VOCABS = {"qwen": "qwen2", "llama3.1": "llama-bpe"}


def family_vocab(vocab_dir: Path, family: str) -> Tokenizer:
    """The vocabulary of ``family`` ("qwen": Qwen 2.5/3 and SmolLM3's templates' test
    vocabulary; "llama3.1")."""
    meta = dict(read_gguf_metadata(vocab_dir / f"ggml-vocab-{VOCABS[family]}.gguf"))
    if family == "llama3.1":
        tokens = list(meta["tokenizer.ggml.tokens"])
        for token_id, name in LLAMA_3_1_NAMES.items():
            assert tokens[token_id].startswith("<|reserved_special_token_"), tokens[token_id]
            tokens[token_id] = name
        meta["tokenizer.ggml.tokens"] = tokens
    return tokenizer_from_metadata(meta, source=f"{family}'s test vocabulary")
