"""Our tokenizers against llama.cpp's own, on a few hundred generated strings per vocabulary.

llama.cpp's test vectors (tests/integration/test_llama_cpp_vocabs.py) are a few dozen strings
each; here the reference is llama.cpp itself (llama-cpp-python, the vocabulary loaded with
``vocab_only=True``) on seeded random text from tests/unit/test_tokenizer_texts.py: many
scripts, combining marks, emoji, digit and whitespace runs, code, contractions, punctuation and
code points newer than Python's Unicode tables. For every llama/gpt2 vocabulary with test
vectors: the ids (``parse_special`` off), each token's rendered bytes, ``decode(encode(s)) ==
s`` wherever llama.cpp's own detokenizer gives ``s`` back, and the ids with control tokens
embedded in the text, parsed (``parse_special`` on) and not. And Llama 3's vocabulary written
as an HF tokenizer.json: it reads back as the same tokenizer, and HF ``tokenizers`` encodes
with it as llama.cpp does.
"""

from __future__ import annotations

import ctypes
import json
import sys
import zlib
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import Llama
from llama_cpp_files import vocab_dir as vocab_dir  # llama.cpp's vocab files
from test_llama_cpp_vocabs import VOCABS
from test_llama_cpp_vocabs import tokenizers as tokenizers  # name -> our tokenizer, read once
from tokenizers import Tokenizer as HFTokenizer

from llamatrain.tokenizer import (
    BpeTokenizer,
    SpmTokenizer,
    Tokenizer,
    read_hf_tokenizer,
    write_hf_tokenizer,
)

# The text generator is shared with the unit tests, whose folder is no package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_tokenizer_texts import ascii_texts, varied_texts, with_tokens  # noqa: E402

N_TEXTS = 300
N_ASCII_TEXTS = 100  # ASCII text takes a fast path of its own
N_SPECIAL_TEXTS = 100
CUT_OUT = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
"""Token attributes llama.cpp cuts out of text before tokenizing the rest."""


@pytest.fixture(scope="module")
def references(vocab_dir: Path) -> dict[str, Llama]:
    """name -> llama.cpp with that vocabulary loaded (no weights), each loaded once."""
    return _LazyReferences(vocab_dir)


class _LazyReferences(dict[str, Llama]):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, name: str) -> Llama:
        path = self.folder / f"ggml-vocab-{name}.gguf"
        self[name] = Llama(model_path=str(path), vocab_only=True, verbose=False)
        return self[name]


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


def reference_ids(llm: Llama, text: str, special: bool = False) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)


def mismatches(
    ours: Tokenizer, llm: Llama, texts: list[str], special: bool = False
) -> list[tuple[str, list[int], list[int]]]:
    """(text, our ids, llama.cpp's ids) for each text where they differ."""
    cases = [(t, ours.encode(t, special=special), reference_ids(llm, t, special)) for t in texts]
    return [case for case in cases if case[1] != case[2]]


def reference_piece(llm: Llama, token_id: int) -> bytes:
    """llama.cpp's ``llama_token_to_piece(special=False)``: what a streamed token renders."""
    size = 4096  # longer than any token
    buffer = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token_id, buffer, size, 0, False)
    assert n >= 0
    return buffer.raw[:n]


def reference_detokenize(llm: Llama, ids: list[int]) -> bytes:
    """llama.cpp's ``llama_detokenize`` (special tokens neither removed nor rendered)."""
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 64 * len(ids)
    buffer = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(llm._model.vocab, tokens, len(ids), buffer, size, False, False)
    assert n >= 0
    return buffer.raw[:n]


def cut_out_tokens(llm: Llama) -> list[str]:
    """The texts of the tokens llama.cpp cuts out of text (control, user-defined, unknown)."""
    vocab = llm._model.vocab
    ids = range(llama_cpp.llama_vocab_n_tokens(vocab))
    special = [i for i in ids if llama_cpp.llama_vocab_get_attr(vocab, i) & CUT_OUT]
    return [llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8") for i in special]


@pytest.mark.parametrize("name", VOCABS)
def test_ids_match_llama_cpp_on_varied_text(
    references: dict[str, Llama],
    tokenizers: dict[str, Tokenizer],
    name: str,
) -> None:
    llm, ours = references[name], tokenizers[name]
    texts = varied_texts(seed_of(name), N_TEXTS) + ascii_texts(seed_of(name), N_ASCII_TEXTS)
    wrong = mismatches(ours, llm, texts)
    assert not wrong, f"{len(wrong)}/{len(texts)} differ; first (text, ours, llama.cpp): {wrong[0]}"


@pytest.mark.parametrize("name", VOCABS)
def test_decoding_matches_llama_cpp(
    references: dict[str, Llama],
    tokenizers: dict[str, Tokenizer],
    name: str,
) -> None:
    """Each token renders llama.cpp's bytes, and ``decode(encode(s)) == s`` wherever llama.cpp's
    detokenizer gives ``s`` back (some vocabularies "clean up" spaces and do not)."""
    llm, ours = references[name], tokenizers[name]
    texts = varied_texts(seed_of(name) + 1, N_TEXTS)
    ids_of = {t: reference_ids(llm, t) for t in texts}
    used = sorted({i for ids in ids_of.values() for i in ids})
    wrong_pieces = [i for i in used if ours.token_bytes(i) != reference_piece(llm, i)]
    assert not wrong_pieces, f"tokens render differently: {wrong_pieces[:10]}"
    round_trips = [t for t, ids in ids_of.items() if reference_detokenize(llm, ids) == t.encode()]
    assert len(round_trips) >= len(texts) // 2  # the check below is not vacuous
    wrong = [(t, ours.decode(ids_of[t])) for t in round_trips if ours.decode(ids_of[t]) != t]
    assert not wrong, f"{len(wrong)} texts do not round-trip; first (text, decoded): {wrong[0]}"


@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_in_text_match_llama_cpp(
    references: dict[str, Llama],
    tokenizers: dict[str, Tokenizer],
    name: str,
) -> None:
    """Text with the vocabulary's control/user-defined/unknown tokens written in it, tokenized
    with ``parse_special`` on (they become their ids) and off (only user-defined ones do)."""
    llm, ours = references[name], tokenizers[name]
    assert isinstance(ours, BpeTokenizer | SpmTokenizer)
    specials = cut_out_tokens(llm)
    assert specials
    texts = with_tokens(varied_texts(seed_of(name) + 2, N_SPECIAL_TEXTS), specials, seed_of(name))
    for special in (True, False):
        wrong = mismatches(ours, llm, texts, special)
        assert not wrong, f"special={special}: {len(wrong)} differ; first: {wrong[0]}"


def test_llama3_as_tokenizer_json_reads_back_and_encodes_like_llama_cpp(
    references: dict[str, Llama],
    tokenizers: dict[str, Tokenizer],
    tmp_path: Path,
) -> None:
    llm, ours = references["llama-bpe"], tokenizers["llama-bpe"]
    assert isinstance(ours, BpeTokenizer)
    path = write_hf_tokenizer(ours, tmp_path)
    config = {"bos_token": ours.piece(ours.bos_id), "eos_token": ours.piece(ours.eos_id)}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_hf_tokenizer(tmp_path).fingerprint() == ours.fingerprint()
    hf = HFTokenizer.from_file(str(path))
    texts = with_tokens(varied_texts(3, N_SPECIAL_TEXTS), cut_out_tokens(llm), seed=3)
    wrong = [
        t
        for t in texts
        if hf.encode(t, add_special_tokens=False).ids != reference_ids(llm, t, True)
    ]
    assert not wrong, f"HF tokenizers differs from llama.cpp on {len(wrong)}, e.g. {wrong[0]!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", VOCABS)
def test_every_token_renders_like_llama_cpp(
    references: dict[str, Llama],
    tokenizers: dict[str, Tokenizer],
    name: str,
) -> None:
    llm, ours = references[name], tokenizers[name]
    wrong = [i for i in range(ours.vocab_size) if ours.token_bytes(i) != reference_piece(llm, i)]
    assert not wrong, f"{len(wrong)} tokens render differently, e.g. {wrong[:10]}"
