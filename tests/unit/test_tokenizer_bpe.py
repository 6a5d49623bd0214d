"""Byte-level BPE (GGUF model "gpt2"): merges, pre-tokenizers, special tokens, GGUF round trip.

llama.cpp's own test vectors, on real vocabularies, are in
tests/integration/test_llama_cpp_vocabs.py; these tests pin the rules on a tiny vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llamatrain.gguf.llama import read_tokenizer, write_vocab
from llamatrain.gguf.vocab import tokenizer_from_metadata, tokenizer_metadata
from llamatrain.tokenizer import (
    PRE_TOKENIZERS,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    BpeTokenizer,
    SpmTokenizer,
    Tokenizer,
    TokenizerError,
)
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR
from llamatrain.tokenizer.pretokenizers import pre_tokenizer

BYTES = [BYTE_TO_CHAR[b] for b in range(256)]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor ld"]
WORDS = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworld"]
SPECIALS = {"<|begin|>": TOKEN_TYPE_CONTROL, "<|eot_id|>": TOKEN_TYPE_CONTROL}
USER = {"<tool>": TOKEN_TYPE_USER_DEFINED}
TOKENS = [*BYTES, *WORDS, *SPECIALS, *USER]
TYPES = [TOKEN_TYPE_NORMAL] * (256 + len(WORDS)) + [*SPECIALS.values(), *USER.values()]


def make(pre: str = "llama-bpe", **kwargs: object) -> BpeTokenizer:
    ids = {t: i for i, t in enumerate(TOKENS)}
    return BpeTokenizer(
        TOKENS,
        TYPES,
        MERGES,
        pre=pre,
        bos_id=ids["<|begin|>"],
        eos_id=ids["<|eot_id|>"],
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
def tok() -> BpeTokenizer:
    return make()


def test_is_a_tokenizer(tok: BpeTokenizer) -> None:
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(TOKENS) and tok.unk_id is None


def test_merges_apply_by_rank_and_bytes_fall_back(tok: BpeTokenizer) -> None:
    assert [tok.piece(i) for i in tok.encode("hello world")] == ["hello", "Ġworld"]
    # "helo": "he" merges, then no rule joins "he"+"l"; the rest stays single bytes.
    assert [tok.piece(i) for i in tok.encode("helo")] == ["he", "l", "o"]
    assert tok.encode("é") == [TOKENS.index(BYTE_TO_CHAR[0xC3]), TOKENS.index(BYTE_TO_CHAR[0xA9])]


def test_decode_round_trips(tok: BpeTokenizer) -> None:
    for text in ["", "hello world", " \t\n\n  x", "naïve café 🦙 中文", "<|eot_id|> <tool>"]:
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_control_tokens_in_text_need_special(tok: BpeTokenizer) -> None:
    eot = TOKENS.index("<|eot_id|>")
    assert eot not in tok.encode("hi<|eot_id|>")
    assert tok.encode("hi<|eot_id|>", special=True)[-1] == eot
    assert tok.decode([eot]) == ""  # control tokens render nothing, as llama.cpp
    assert tok.eot_id == eot


def test_user_defined_tokens_are_always_cut_out(tok: BpeTokenizer) -> None:
    tool = TOKENS.index("<tool>")
    assert tool in tok.encode("a<tool>b")
    assert tok.decode(tok.encode("a<tool>b")) == "a<tool>b"


def test_bos_eos_and_add_defaults(tok: BpeTokenizer) -> None:
    ids = tok.encode("hello", bos=True, eos=True)
    assert ids == [tok.bos_id, *tok.encode("hello"), tok.eos_id]
    assert tok.add_bos and not tok.add_eos  # llama3's default
    assert not make(pre="gpt-2").add_bos
    assert not make(add_bos=False).add_bos
    assert make(add_bos=False).fingerprint() != tok.fingerprint()


def test_pre_tokenizers_split_like_llama_cpp() -> None:
    assert pre_tokenizer("llama-bpe").split("Hello world 1234567") == [
        "Hello", " world", " ", "123", "456", "7"
    ]  # fmt: skip
    assert pre_tokenizer("qwen2").split("x 123") == ["x", " ", "1", "2", "3"]
    assert pre_tokenizer("gpt-2").split("I'm  ok\n") == ["I", "'m", " ", " ok", "\n"]
    assert pre_tokenizer(None).name == "default"
    required = {"llama-bpe", "llama3", "smollm", "deepseek-llm", "deepseek-coder", "gpt-2",
                "default", "qwen2", "starcoder", "falcon", "mpt", "refact",
                "command-r"}  # fmt: skip
    assert required <= set(PRE_TOKENIZERS)


def test_unknown_pre_tokenizer_is_one_clear_error() -> None:
    with pytest.raises(TokenizerError, match="'no-such-pre'.*llama-bpe"):
        make(pre="no-such-pre")


def test_gguf_metadata_round_trip(tok: BpeTokenizer, tmp_path: Path) -> None:
    again = tokenizer_from_metadata(tokenizer_metadata(tok))
    assert isinstance(again, BpeTokenizer)
    assert again.fingerprint() == tok.fingerprint()
    path = write_vocab(tmp_path / "bpe.gguf", tok)
    loaded = read_tokenizer(path)
    assert loaded.fingerprint() == tok.fingerprint()
    text = "hello world<|eot_id|><tool> 12 ü"
    for special in (False, True):
        assert loaded.encode(text, special=special) == tok.encode(text, special=special)


def test_missing_merges_or_unknown_pre_in_gguf(tok: BpeTokenizer) -> None:
    meta = tokenizer_metadata(tok)
    with pytest.raises(TokenizerError, match="merges"):
        tokenizer_from_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="'mystery'"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.pre": "mystery"})


def test_spm_parses_control_tokens_only_when_asked() -> None:
    pieces = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a"]
    types = [2, 3, 3, 1, 1, 1, 1]
    spm = SpmTokenizer(pieces, [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5], types, fast=False)
    assert 1 not in spm.encode("a<s>b")
    assert spm.encode("a<s>b", special=True) == [6, 1, 3, 5]  # "▁a", <s>, then a prefixed space
    assert spm.encode_batch(["a<s>b"], special=True) == [spm.encode("a<s>b", special=True)]
