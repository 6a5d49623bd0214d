"""llama.cpp's own tokenizer test vectors: every llama/gpt2 vocabulary gives identical ids.

llama.cpp ships ``models/ggml-vocab-*.gguf`` (vocab-only files of real models) with ``.inp``
(test strings separated by ``\\n__ggml_vocab_test__\\n``) and ``.out`` (one line of ids per
string), checked by its test-tokenizer-0: no BOS, no special-token parsing. The files come from
the llama-cpp-python sdist (which vendors llama.cpp), downloaded once with pip into a cache
folder. Without them the tests fail (they never skip): pip must reach the package index once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_cpp_files import vocab_dir as vocab_dir  # llama.cpp's vocab files

from llamatrain.gguf.llama import read_tokenizer
from llamatrain.tokenizer import BpeTokenizer, SpmTokenizer, Tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"
VOCABS = (
    "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm",
    "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
"""The vocabularies with test vectors whose tokenizer.ggml.model is "llama" or "gpt2"."""
OTHER_MODELS = {"bert-bge": "bert", "gemma-4": "gemma4"}
"""The vocabularies with test vectors of models llamatrain does not tokenize."""


def cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs, split as test-tokenizer-0 splits them."""
    raw = gguf.with_name(gguf.name + ".inp").read_bytes().decode("utf-8")  # keep any "\r"
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()  # the file ends with a separator
    lines = gguf.with_name(gguf.name + ".out").read_text(encoding="utf-8").split("\n")
    return [
        (text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=False)
    ]


@pytest.fixture(scope="session")
def tokenizers(vocab_dir: Path) -> dict[str, Tokenizer]:
    """name -> tokenizer, each read once (reading a 250k-token vocabulary takes a second)."""
    return _LazyTokenizers(vocab_dir)


class _LazyTokenizers(dict[str, Tokenizer]):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, name: str) -> Tokenizer:
        self[name] = read_tokenizer(self.folder / f"ggml-vocab-{name}.gguf")
        return self[name]


def test_every_vocabulary_with_vectors_is_known(vocab_dir: Path) -> None:
    """A vocabulary added to llama.cpp's tests must be added to VOCABS or OTHER_MODELS."""
    inputs = vocab_dir.glob("ggml-vocab-*.gguf.inp")
    names = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in inputs}
    assert names == set(VOCABS) | set(OTHER_MODELS)


@pytest.mark.parametrize("name", VOCABS)
def test_ids_match_llama_cpp(vocab_dir: Path, tokenizers: dict[str, Tokenizer], name: str) -> None:
    tok = tokenizers[name]
    vectors = cases(vocab_dir / f"ggml-vocab-{name}.gguf")
    assert len(vectors) >= 40
    wrong = [(text, tok.encode(text), ids) for text, ids in vectors if tok.encode(text) != ids]
    assert not wrong, f"{len(wrong)}/{len(vectors)} cases differ; first: {wrong[0]!r}"
    trips = [text for text, _ in vectors if tok.decode(tok.encode(text)) != text]
    assert not trips, f"decode(encode(s)) != s for {trips[:3]!r}"


@pytest.mark.parametrize(
    ("name", "control"),
    [("llama-bpe", "<|begin_of_text|>"), ("qwen2", "<|im_start|>"), ("llama-spm", "<s>")],
)
def test_special_parses_control_tokens(
    tokenizers: dict[str, Tokenizer], name: str, control: str
) -> None:
    tok = tokenizers[name]
    assert isinstance(tok, BpeTokenizer | SpmTokenizer)
    text = f"{control}user\nhi"
    control_id = tok.piece_to_id(control)
    assert tok.encode(text, special=True)[0] == control_id
    assert control_id not in tok.encode(text)  # plain text never becomes a control token
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("name", [*VOCABS, "baichuan"])
def test_a_prompt_gets_bos_and_eos_where_llama_cpp_puts_them(
    vocab_dir: Path, tokenizers: dict[str, Tokenizer], name: str
) -> None:
    """Real files, most without ``add_bos_token`` / ``add_eos_token``: the keys where a file
    has them, else llama.cpp's default for the vocabulary (BOS for llama's SPM, as for
    baichuan's file, which has neither key; for byte-level BPE by pre-tokenizer, Llama 3's BOS
    and Qwen2's none), frame our prompt as llama.cpp frames it (``tokenize(add_bos=True)`` is
    ``add_special``)."""
    import llama_cpp

    tok = tokenizers[name]
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        decided = (llm._model.add_bos_token(), llm._model.add_eos_token())
        assert (tok.add_bos, tok.add_eos) == decided
        for text in ("Hello world, 123!", ""):
            theirs = llm.tokenize(text.encode(), add_bos=True, special=True)
            assert tok.encode_prompt(text) == theirs, repr(text)
    finally:
        llm.close()
