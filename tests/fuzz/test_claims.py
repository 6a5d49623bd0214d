"""Each claim a file or flag makes is checked before it is believed (issue 30, items 4 and 6).

The crafted inputs of the issue, one test each: every one fails as one LlamatrainError line
naming the field, in < 2 s and < 500 MB (``conftest.bounded``), and the GGUF tensor data must
be laid out as llama.cpp's loader requires (contiguous, aligned, exact sizes, no overlap).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from fuzz_bounds import bounded

from llamatrain.cli import main
from llamatrain.config import load_config
from llamatrain.errors import ConfigError, GGUFError, LlamatrainError, TokenizerError
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.write import write_gguf
from llamatrain.tokenizer import load_sentencepiece, read_hf_tokenizer
from llamatrain.tokenizer.sentencepiece_proto import _bytes_field, _float_field, _int_field

pytestmark = pytest.mark.fuzz


def refused(call, error: type[LlamatrainError], *words: str) -> str:
    """The one-line message ``call`` is refused with, checked to name ``words``."""
    caught: list[LlamatrainError] = []

    def attempt() -> None:
        try:
            call()
        except LlamatrainError as err:
            caught.append(err)

    bounded(attempt, "a crafted input")
    assert caught and isinstance(caught[0], error), f"not refused as {error.__name__}"
    message = str(caught[0])
    assert "\n" not in message and all(w in message for w in words), message
    return message


# ---------------------------------------------------------------------------------- GGUF


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    tensors = {"a.weight": (torch.ones(4, 32), "f32"), "b.weight": (torch.ones(2, 32), "f32")}
    return write_gguf(tmp_path / "m.gguf", "llama", {"t.n": 1}, tensors)


def record(data: bytes, name: bytes) -> int:
    """Where tensor ``name``'s n_dims field is."""
    return data.index(name + b"\x02\x00\x00\x00") + len(name)


def patched(path: Path, at: int, fmt: str, value: int) -> Path:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(("at", "field"), [(8, "tensors"), (16, "keys")])
def test_gguf_counts_past_what_the_file_can_hold(gguf: Path, at: int, field: str) -> None:
    patched(gguf, at, "<Q", 2**32 - 1)
    refused(lambda: read_gguf(gguf), GGUFError, f"4294967295 {field}", "re-export")


def test_gguf_zero_and_overflowing_dimensions(gguf: Path) -> None:
    at = record(gguf.read_bytes(), b"a.weight") + 4
    data = gguf.read_bytes()
    patched(gguf, at + 8, "<Q", 0)
    refused(lambda: read_gguf(gguf), GGUFError, "a.weight", "one of them zero")
    gguf.write_bytes(data)
    patched(gguf, at + 8, "<Q", 2**62)
    refused(lambda: read_gguf(gguf), GGUFError, "a.weight", "more than 2^63")


def test_gguf_overlapping_and_misaligned_tensor_data(gguf: Path) -> None:
    data = gguf.read_bytes()
    offset_at = record(data, b"b.weight") + 4 + 16 + 4
    patched(gguf, offset_at, "<Q", 0)  # b.weight's data is a.weight's
    refused(lambda: read_gguf(gguf), GGUFError, "b.weight", "starts at data offset 0", "ends at")
    gguf.write_bytes(data)
    patched(gguf, offset_at, "<Q", 4 * 32 * 4 + 4)
    refused(lambda: read_gguf(gguf), GGUFError, "b.weight", "alignment")


@pytest.mark.parametrize("name", [b"a.weight", b"b.weight"])
def test_gguf_type_that_does_not_fit_its_bytes(gguf: Path, name: bytes) -> None:
    """An F32 tensor relabelled Q4_0 (type 2): its bytes are 7x what Q4_0 needs."""
    patched(gguf, record(gguf.read_bytes(), name) + 4 + 16, "<I", 2)
    refused(lambda: read_gguf(gguf), GGUFError, "re-export")


def test_gguf_written_by_llamatrain_is_laid_out_as_llama_cpp_requires(gguf: Path) -> None:
    contents = read_gguf(gguf)
    a, b = contents.infos["a.weight"], contents.infos["b.weight"]
    assert b.offset == a.offset + a.n_bytes  # 512 bytes: already aligned, no gap
    assert gguf.stat().st_size == b.offset + b.n_bytes


# ------------------------------------------------------------------------- tokenizer.json


def tokenizer_folder(folder: Path, doc: object, config: object = None) -> Path:
    folder.mkdir(exist_ok=True)
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (folder / "tokenizer.json").write_text(text, encoding="utf-8", errors="surrogatepass")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def bpe_doc(**model: object) -> dict:
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    return {"model": {"type": "BPE", "vocab": vocab, "merges": [], **model},
            "pre_tokenizer": byte_level}  # fmt: skip


def test_tokenizer_json_claims(tmp_path: Path) -> None:
    doc = bpe_doc()
    doc["added_tokens"] = [{"id": 3 * 10**8, "content": "<x>", "special": True}]
    folder = tokenizer_folder(tmp_path / "id", doc)
    refused(lambda: read_hf_tokenizer(folder), TokenizerError, "300,000,000", "define only 27")
    folder = tokenizer_folder(tmp_path / "size", bpe_doc(), {"vocab_size": 10**8})
    refused(lambda: read_hf_tokenizer(folder), TokenizerError, "config.json vocab_size")
    doc = bpe_doc()
    doc["model"]["vocab"]["z"] = -5
    folder = tokenizer_folder(tmp_path / "negative", doc)
    refused(lambda: read_hf_tokenizer(folder), TokenizerError, 'model.vocab["z"]', "negative")
    folder = tokenizer_folder(tmp_path / "merges", bpe_doc(merges=[["a", 7]]))
    refused(lambda: read_hf_tokenizer(folder), TokenizerError, "model.merges[0]", "a string")
    folder = tokenizer_folder(tmp_path / "type", bpe_doc(vocab=[1, 2]))
    refused(lambda: read_hf_tokenizer(folder), TokenizerError, "model.vocab must be an object")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests"),
        ('{"model": ' + "9" * 5000 + "}", "digits"),
        ('{"model": {"type": "BPE", "vocab": {"\\ud800": 0}}}', "lone surrogate"),
        ("\xff", "not a readable JSON file"),
    ],
)
def test_tokenizer_json_that_python_cannot_hold(tmp_path: Path, text: str, words: str) -> None:
    folder = tokenizer_folder(tmp_path, text)
    refused(lambda: read_hf_tokenizer(folder), TokenizerError, words)


# ---------------------------------------------------------------------- sentencepiece model


@pytest.mark.filterwarnings("ignore:This sentencepiece model normalizes")
def test_small_sentencepiece_model_claiming_huge_sizes(tmp_path: Path) -> None:
    """~70 bytes whose normalizer name is a varint 2^32-1 (read as a length: 4 GB)."""

    def piece(text: bytes, piece_type: int) -> bytes:
        return _bytes_field(
            1, _bytes_field(1, text) + _float_field(2, 0.0) + _int_field(3, piece_type)
        )

    model = piece(b"<unk>", 2) + piece(b"<s>", 3) + piece(b"</s>", 3) + piece(b"a", 1)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model + _bytes_field(3, _int_field(1, 2**32 - 1)))
    refused(lambda: load_sentencepiece(path), TokenizerError, "normalizer_spec field 1")
    path.write_bytes(model + piece(b"b", 2**40))
    refused(lambda: load_sentencepiece(path), TokenizerError, "Token 4 has type 1099511627776")


# ----------------------------------------------------------------------- TOML and --set


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[optim]\nlr = " + "[" * 100_000 + "]" * 100_000, ("nests",)),
        ("[train]\nseed = " + "9" * 5000, ("digits",)),
        ('[data]\npath = "\\ud800"', ("not valid TOML",)),
        ("[optim]\nlr = nan", ("optim.lr", "nan")),
    ],
)
def test_toml_that_python_cannot_hold(tmp_path: Path, text: str, words: tuple[str, ...]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    refused(lambda: load_config(path), ConfigError, *words)


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("optim.lr=" + "[" * 100_000, ("optim.lr", "must be a number")),
        ("train.seed=" + "9" * 5000, ("train.seed", "must be an integer")),
        ("data.path=a\udcffb", ("data.path", "not text")),
        ("optim.lr=nan", ("optim.lr", "nan")),
        ("optim.lr=[\n1]", ("optim.lr", "\\n")),
    ],
)
def test_overrides_python_cannot_hold(item: str, words: tuple[str, ...]) -> None:
    refused(lambda: load_config(None, [item]), ConfigError, *words)


# ---------------------------------------------------------------------------- sampler flags


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--temp", "nan"], "--temperature nan"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--top-p", "2"], "--top-p 2.0"),
        (["--top-p", "nan"], "--top-p nan"),
        (["--top-k", "-1"], "--top-k -1"),
        (["--repeat-penalty", "inf"], "--repeat-penalty inf"),
        (["--repeat-last-n", "-2"], "--repeat-last-n -2"),
        (["--seed", "-2"], "--seed -2"),
        (["--seed", str(2**64)], "--seed"),
        (["--max-tokens", "0"], "--max-tokens 0"),
        (["--max-tokens", str(10**12)], "--max-tokens"),
    ],
)
def test_generate_flags_out_of_range_are_one_line(tmp_path: Path, capsys, flags, words) -> None:
    """Refused before the model is read (the path need not exist)."""
    assert main(["generate", str(tmp_path / "none.gguf"), *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "must be" in err, err


def test_eval_n_ctx_out_of_range_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["eval", str(tmp_path / "none.gguf"), "--data", "x", "--n-ctx", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--n-ctx 0" in err, err
